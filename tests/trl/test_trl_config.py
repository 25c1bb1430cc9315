"""SFTConfig / DPOConfig carry TRL's fields and defaults; options trainbus.trl lacks fail when the trainer is made."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from trl_jobs import preference_rows, text_rows, tiny_model

from trainbus.engine import ConfigError


def _default(f: dataclasses.Field) -> object:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


@pytest.mark.parametrize("name", ["SFTConfig", "DPOConfig"])
def test_config_has_every_trl_field_with_trls_default(name: str) -> None:
    import transformers
    import trl

    import trainbus.trl

    ours = {f.name: f for f in dataclasses.fields(getattr(trainbus.trl, name))}
    hf = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}
    checked = 0
    for f in dataclasses.fields(getattr(trl, name)):
        if f.init and (f.name not in hf or (f.name in ours and _default(f) != _default(hf[f.name]))):
            assert f.name in ours, f"{name} lacks TRL's field {f.name}"
            assert _default(ours[f.name]) == _default(f), f"{name}.{f.name}: TRL's default is {_default(f)!r}"
            checked += 1
    assert checked > 20


def test_trl_post_init_conversions(tmp_path: Path) -> None:
    from trainbus.trl import DPOConfig, SFTConfig

    sft = SFTConfig(str(tmp_path), use_cpu=True)
    assert (sft.bf16, sft.gradient_checkpointing, sft.logging_steps, sft.pad_to_multiple_of) == (True, True, 10, None)
    assert SFTConfig(str(tmp_path), fp16=False, bf16=False).bf16 is False
    assert DPOConfig(str(tmp_path), loss_type="ipo").loss_type == ["ipo"]
    with pytest.raises(ConfigError, match="one weight per loss_type"):
        DPOConfig(str(tmp_path), loss_type=["sigmoid", "ipo"], loss_weights=[1.0])
    with pytest.raises(ConfigError, match="did you mean 'packing'"):
        SFTConfig(str(tmp_path), packin=True)
    with pytest.raises(ConfigError, match="truncation_mode"):
        SFTConfig(str(tmp_path), truncation_mode="middle")


def _trainer_error(tmp_path: Path, tokenizer_dir: str, which: str, **config: object) -> Exception:
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trainbus.trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model("llama", len(tokenizer))
    args = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **config)
    with pytest.raises(Exception) as caught:
        if which == "sft":
            rows = Dataset.from_list(text_rows(4, 0))
            SFTTrainer(model, SFTConfig(**args), train_dataset=rows, processing_class=tokenizer)
        else:
            DPOTrainer(model, tiny_model("llama", len(tokenizer)), DPOConfig(**args),
                       train_dataset=Dataset.from_list(preference_rows(4, 0)), processing_class=tokenizer)  # fmt: skip
    return caught.value


def test_unsupported_options_fail_when_the_trainer_is_made(tmp_path: Path, tokenizer_dir: str) -> None:
    assert "exo_pair" in str(_trainer_error(tmp_path, tokenizer_dir, "dpo", loss_type="exo_pair", label_smoothing=0.1))
    assert "use_weighting" in str(_trainer_error(tmp_path, tokenizer_dir, "dpo", use_weighting=True))
    assert "activation_offloading" in str(_trainer_error(tmp_path, tokenizer_dir, "sft", activation_offloading=True))
    assert "max_length" in str(_trainer_error(tmp_path, tokenizer_dir, "sft", padding_free=True))
    error = _trainer_error(tmp_path, tokenizer_dir, "sft", assistant_only_loss=True)
    assert "conversational" in str(error)
