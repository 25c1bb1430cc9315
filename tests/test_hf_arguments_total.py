"""TrainingArguments fields that transformers gives to features trainbus has in another form (#34 item 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.facade_helpers import Regressor, quiet_args, regression_data
from trainbus.engine import ConfigError
from trainbus.plugins import Trainer, TrainingArguments
from trainbus.plugins.control.preemption import Preemption

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize(
    "given",
    [
        {"activation_checkpointing": True},
        {"gradient_checkpointing": True},
        {"activation_checkpointing": False, "gradient_checkpointing": True},
        {"activation_checkpointing_kwargs": {"use_reentrant": False}},
        {},
    ],
)
def test_activation_and_gradient_checkpointing_mirror_as_in_transformers(given: dict, tmp_path: Path) -> None:
    import dataclasses

    if not any(f.name == "activation_checkpointing" for f in dataclasses.fields(transformers.TrainingArguments)):
        pytest.skip(f"transformers {transformers.__version__} has no activation_checkpointing")
    hf = transformers.TrainingArguments(str(tmp_path), **given)
    ours = TrainingArguments(str(tmp_path), **given)
    for name in ("activation_checkpointing", "gradient_checkpointing", "activation_checkpointing_kwargs",
                 "gradient_checkpointing_kwargs"):  # fmt: skip
        assert getattr(ours, name) == getattr(hf, name), name


def test_activation_checkpointing_turns_gradient_checkpointing_on_in_the_model(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    data = [{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4]}] * 4
    Trainer(model, quiet_args(tmp_path, max_steps=1, activation_checkpointing=True), train_dataset=data).train()
    assert model.is_gradient_checkpointing


@pytest.mark.parametrize("enabled", [True, False])
def test_enable_jit_checkpoint_is_the_stop_checkpoint_on_sigterm(enabled: bool, tmp_path: Path) -> None:
    """transformers' JIT checkpoint on SIGTERM is trainbus's Preemption plugin, present either way: a preempted
    run is never lost (tests/test_preemption.py kills real runs)."""
    args = quiet_args(tmp_path, max_steps=1, enable_jit_checkpoint=enabled)
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(4))
    assert args.enable_jit_checkpoint is enabled
    preemption = trainer.get_plugin(Preemption)
    assert preemption is not None and preemption.return_after_stop is enabled


def test_accelerator_config_as_transformers_reads_it(tmp_path: Path) -> None:
    from transformers.trainer_pt_utils import AcceleratorConfig

    path = tmp_path / "accelerator.json"
    path.write_text(json.dumps({"non_blocking": True}))
    for given in (None, {"non_blocking": True}, json.dumps({"even_batches": True}), str(path), AcceleratorConfig()):
        hf = transformers.TrainingArguments(str(tmp_path), accelerator_config=given)
        ours = TrainingArguments(str(tmp_path), accelerator_config=given)
        assert ours.accelerator_config == hf.accelerator_config, given


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"split_batches": True}, "split_batches"),
        ({"dispatch_batches": True}, "dispatch_batches"),
        ({"even_batches": False}, "even_batches"),
        ({"use_seedable_sampler": False}, "use_seedable_sampler"),
        ({"gradient_accumulation_kwargs": {"num_steps": 2}}, "gradient_accumulation_kwargs"),
        ({"spilt_batches": True}, "spilt_batches"),
        ("not a file.json", "not a file.json"),
    ],
)
def test_an_accelerator_config_trainbus_cannot_honour_is_refused_naming_the_key(config: object, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        TrainingArguments("out", accelerator_config=config)
