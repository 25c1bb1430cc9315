"""Bad inputs to the facade fail clearly and early (issue 29, "Why" item 10).

Each case is a value transformers or torch would take only to fail later (at the optimizer's creation,
mid-training at the first evaluation), fail with a raw error (a ``TypeError`` from ``default_collate``,
``torch.stack``'s shapes), misname (a per-sample loss vector reported as "no loss"), or take silently
(``output_dir=''`` writing checkpoints into the working directory). Each must now raise at construction,
or for data content at the first batch, an error of the stated type whose message names the bad value
and says what is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.facade_helpers import Regressor, quiet_args, regression_data
from trainbus.engine import ConfigError
from trainbus.plugins import Trainer, TrainingArguments


def _args(tmp: Path, **kwargs: Any) -> TrainingArguments:
    return quiet_args(tmp / "run", max_steps=1, **kwargs)


def _trainer(tmp: Path, data: Any = None, model: Any = None, **kwargs: Any) -> Trainer:
    return Trainer(model or Regressor(), _args(tmp), train_dataset=regression_data(8) if data is None else data,
                   **kwargs)  # fmt: skip


class PerSampleLoss(Regressor):
    """Returns the loss of every sample (``reduction='none'``): a vector, not the batch's one number."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.lin(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels, reduction="none"), "logits": out}


def _samples(make: Callable[[int], Any]) -> list[Any]:
    return [make(i) for i in range(8)]


#: (id, what to do with a tmp dir, expected error type, texts the message must contain)
CONSTRUCTION: list[tuple[str, Callable[[Path], Any], type[Exception], tuple[str, ...]]] = [
    ("adam_beta1 above 1", lambda t: _args(t, adam_beta1=1.5), ConfigError, ("adam_beta1", "1.5", "[0, 1)")),
    ("adam_beta1 negative", lambda t: _args(t, adam_beta1=-0.1), ConfigError, ("adam_beta1", "-0.1", "[0, 1)")),
    ("adam_beta2 of 1", lambda t: _args(t, adam_beta2=1.0), ConfigError, ("adam_beta2", "1.0", "[0, 1)")),
    ("adam_epsilon negative", lambda t: _args(t, adam_epsilon=-1e-8), ConfigError, ("adam_epsilon", "-1e-08", ">= 0")),
    ("eval_delay negative", lambda t: _args(t, eval_delay=-1), ConfigError, ("eval_delay", "-1", ">= 0")),
    ("output_dir empty", lambda t: TrainingArguments("", use_cpu=True), ConfigError, ("output_dir", "''", "'.'")),
    ("lr_scheduler_kwargs not JSON", lambda t: _args(t, lr_scheduler_kwargs="warmup"), ConfigError,
     ("lr_scheduler_kwargs", "'warmup'", "a dict")),
    ("lr_scheduler_kwargs bad JSON", lambda t: _args(t, lr_scheduler_kwargs='{"num_cycles": }'), ConfigError,
     ("lr_scheduler_kwargs", '\'{"num_cycles": }\'', "JSON")),
    ("gradient_checkpointing_kwargs not JSON", lambda t: _args(t, gradient_checkpointing_kwargs="reentrant"),
     ConfigError, ("gradient_checkpointing_kwargs", "'reentrant'", "a dict")),
    ("torch_compile_mode unknown", lambda t: _args(t, torch_compile=True, torch_compile_mode="fastest"),
     ConfigError, ("torch_compile_mode", "'fastest'", "max-autotune")),
    ("prefetch without workers", lambda t: _args(t, dataloader_prefetch_factor=2), ConfigError,
     ("dataloader_prefetch_factor", "2", "dataloader_num_workers > 0")),
    ("prefetch of 0", lambda t: _args(t, dataloader_prefetch_factor=0, dataloader_num_workers=1), ConfigError,
     ("dataloader_prefetch_factor", "0", ">= 1")),
    ("include_for_metrics unknown", lambda t: _args(t, include_for_metrics=["input"]), ConfigError,
     ("include_for_metrics", "'input'", "'inputs'")),
    ("label_names with an empty name", lambda t: _args(t, label_names=[""]), ConfigError, ("label_names", "''")),
    ("optimizers with a name", lambda t: _trainer(t, optimizers=("adam", None)), TypeError,
     ("optimizers", "'adam'", "torch.optim.Optimizer")),
    ("optimizers None", lambda t: _trainer(t, optimizers=None), TypeError, ("optimizers", "None", "(optimizer, ")),
    ("optimizers scheduler not one", lambda t: _trainer(t, optimizers=(None, 0.5)), TypeError,
     ("optimizers", "0.5", "step()")),
    ("eval_dataset empty", lambda t: _trainer(t, eval_dataset=[]), ConfigError, ("eval_dataset", "empty", "length 0")),
    ("one of the eval datasets empty", lambda t: _trainer(t, eval_dataset={"dev": regression_data(4), "test": []}),
     ConfigError, ("eval_dataset['test']", "empty")),
]  # fmt: skip


@pytest.mark.parametrize("make, error, texts", [c[1:] for c in CONSTRUCTION], ids=[c[0] for c in CONSTRUCTION])
def test_a_bad_argument_fails_at_construction_naming_it(
    tmp_path: Path, make: Callable[[Path], Any], error: type[Exception], texts: tuple[str, ...]
) -> None:
    with pytest.raises(error) as raised:
        make(tmp_path)
    for text in texts:
        assert text in str(raised.value), f"{text!r} not in: {raised.value}"


FIRST_BATCH: list[tuple[str, Callable[[Path], Trainer], type[Exception], tuple[str, ...]]] = [
    ("a per-sample loss vector", lambda t: _trainer(t, model=PerSampleLoss()), ConfigError,
     ("shape (4,)", "one number", ".mean()")),
    ("string labels", lambda t: _trainer(t, _samples(lambda i: {"x": torch.randn(2), "labels": "cat"})),
     ConfigError, ("'labels'", "'cat'", "numbers")),
    ("None samples", lambda t: _trainer(t, [None] * 8), ConfigError, ("None", "sample")),
    ("ragged tensors", lambda t: _trainer(t, _samples(lambda i: {"x": torch.randn(2 + i % 2), "labels": 1.0})),
     ConfigError, ("'x'", "(2,)", "(3,)", "pad")),
]  # fmt: skip


@pytest.mark.parametrize("make, error, texts", [c[1:] for c in FIRST_BATCH], ids=[c[0] for c in FIRST_BATCH])
def test_bad_data_fails_at_the_first_batch_naming_it(
    tmp_path: Path, make: Callable[[Path], Trainer], error: type[Exception], texts: tuple[str, ...]
) -> None:
    trainer = make(tmp_path)
    with pytest.raises(error) as raised:
        trainer.train()
    for text in texts:
        assert text in str(raised.value), f"{text!r} not in: {raised.value}"
    assert trainer.state.global_step == 0


def test_a_warmup_over_the_whole_run_is_taken(tmp_path: Path) -> None:
    """warmup_ratio=1.0 is in transformers' range [0, 1]: TrainingArguments took it, the schedule refused it later."""
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=2, warmup_ratio=1.0, learning_rate=0.1),
                      train_dataset=regression_data(8))  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2


def test_what_transformers_takes_is_still_taken(tmp_path: Path) -> None:
    """The edges of each range stay allowed: beta 0, epsilon 0, no delay, '.' as output_dir, JSON kwargs."""
    _args(tmp_path, adam_beta1=0.0, adam_beta2=0.0, adam_epsilon=0.0, eval_delay=0, weight_decay=0.0)
    args = _args(tmp_path, lr_scheduler_kwargs='{"num_cycles": 2}', lr_scheduler_type="cosine_with_restarts")
    assert args.lr_scheduler_kwargs == {"num_cycles": 2}
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert TrainingArguments(".", use_cpu=True).output_dir == "."
    finally:
        os.chdir(cwd)
    optimizer = torch.optim.SGD(Regressor().parameters(), lr=0.1)
    _trainer(tmp_path, optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)))
