"""Bad inputs to trainbus plugins fail at construction, naming the value and what is allowed (issue 29, item 10).

Before, these were taken and failed later with torch's words (``Invalid beta parameter`` when the optimizer
was made, ``'int' object is not iterable``, an ``AssertionError`` from ``GradScaler``) or never.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from trainbus.engine import ConfigError
from trainbus.plugins.optimization import model_setup as setup
from trainbus.plugins.optimization import regularization
from trainbus.plugins.optimization.optimizers import OptimizerSetup
from trainbus.plugins.optimization.precision import MixedPrecision
from trainbus.plugins.optimization.schedulers import LRScheduler


def _check_output_dir(value: Any) -> None:
    from trainbus.plugins.checkpoints.output_dir_check import check_output_dir

    check_output_dir(value)


#: (id, construction, expected error type, texts the message must contain)
CASES: list[tuple[str, Callable[[], Any], type[Exception], tuple[str, ...]]] = [
    ("optimizer lr negative", lambda: OptimizerSetup("adamw_torch", lr=-1.0), ConfigError, ("lr", "-1.0", ">= 0")),
    ("optimizer lr a string", lambda: OptimizerSetup("adamw_torch", lr="1e-3"), TypeError, ("lr", "'1e-3'", "number")),
    ("optimizer beta1 above 1", lambda: OptimizerSetup("adamw_torch", adam_beta1=2.0), ConfigError,
     ("adam_beta1", "2.0", "[0, 1)")),
    ("optimizer epsilon negative", lambda: OptimizerSetup("adamw_torch", adam_epsilon=-1.0), ConfigError,
     ("adam_epsilon", "-1.0", ">= 0")),
    ("optimizer weight_decay negative", lambda: OptimizerSetup("sgd", weight_decay=-0.1), ConfigError,
     ("weight_decay", "-0.1", ">= 0")),
    ("optimizer name a number", lambda: OptimizerSetup(5), TypeError, ("5", "name", "callable")),
    ("optim_args a number", lambda: OptimizerSetup("sgd", optim_args=5), TypeError, ("optim_args", "5", "dict")),
    ("scheduler kwargs a number", lambda: LRScheduler("linear", scheduler_kwargs=5), TypeError,
     ("scheduler_kwargs", "5", "dict")),
    ("scheduler kwargs a string", lambda: LRScheduler("linear", scheduler_kwargs="abc"), TypeError,
     ("scheduler_kwargs", "'abc'", "dict")),
    ("scheduler steps 0", lambda: LRScheduler("linear", num_training_steps=0), ConfigError,
     ("num_training_steps", "0")),
    ("scheduler metric a number", lambda: LRScheduler("reduce_lr_on_plateau", metric=5), TypeError,
     ("metric", "5", "name")),
    ("scaler growth below 1", lambda: MixedPrecision("fp16", growth_factor=0.5), ConfigError,
     ("growth_factor", "0.5", "> 1")),
    ("scaler backoff above 1", lambda: MixedPrecision("fp16", backoff_factor=2.0), ConfigError,
     ("backoff_factor", "2.0", "(0, 1)")),
    ("scaler interval 0", lambda: MixedPrecision("fp16", growth_interval=0), ConfigError,
     ("growth_interval", "0", ">= 1")),
    ("autocast device unknown", lambda: MixedPrecision("bf16", device_type="tpu"), ConfigError,
     ("device_type", "'tpu'", "'cpu'")),
    ("checkpointing kwargs a number", lambda: setup.GradientCheckpointing(5), TypeError,
     ("gradient_checkpointing_kwargs", "5", "dict")),
    ("compile mode unknown", lambda: setup.TorchCompile(mode="fastest"), ConfigError,
     ("mode", "'fastest'", "max-autotune")),
    ("label smoothing ignore_index a float", lambda: regularization.LabelSmoothing(0.1, ignore_index=1.5), TypeError,
     ("ignore_index", "1.5", "int")),
    ("NEFTune embeddings a number", lambda: regularization.NEFTune(5.0, embeddings=5), TypeError,
     ("embeddings", "5", "Module")),
    ("output_dir None", lambda: _check_output_dir(None), TypeError, ("output_dir", "None", "path")),
    ("output_dir a number", lambda: _check_output_dir(5), TypeError, ("output_dir", "5", "path")),
    ("output_dir empty", lambda: _check_output_dir(""), ConfigError, ("output_dir", "''", "'.'")),
]  # fmt: skip


@pytest.mark.parametrize("make, error, texts", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_plugin_argument_fails_at_construction_naming_it(
    make: Callable[[], Any], error: type[Exception], texts: tuple[str, ...]
) -> None:
    with pytest.raises(error) as raised:
        make()
    for text in texts:
        assert text in str(raised.value), f"{text!r} not in: {raised.value}"


def test_the_edges_of_each_range_are_still_taken() -> None:
    OptimizerSetup("adamw_torch", lr=0.0, adam_beta1=0.0, adam_beta2=0.0, adam_epsilon=0.0, weight_decay=0.0)
    OptimizerSetup(lambda params: None, optim_args={"momentum": 0.9})
    LRScheduler("linear", scheduler_kwargs={}, num_training_steps=1)
    MixedPrecision("fp16", growth_factor=1.5, backoff_factor=0.25, growth_interval=1, device_type="cpu")
    setup.GradientCheckpointing({"use_reentrant": False})
    setup.TorchCompile(mode="max-autotune", backend="eager")
    regularization.LabelSmoothing(0.1, ignore_index=-1)
