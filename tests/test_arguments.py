"""TrainingArguments: HF names and defaults, unsupported and misspelt fields, early validation."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import ConfigError
from trainbus.plugins.facade.arguments import UNSUPPORTED, IntervalStrategy, SaveStrategy, TrainingArguments

FIELDS = [f.name for f in dataclasses.fields(TrainingArguments)]
#: fields whose default deliberately differs from transformers 5 (it has no warmup_ratio, for one)
NOT_IN_HF5 = {"warmup_ratio", "overwrite_output_dir", "logging_dir", "evaluation_strategy"}


def test_defaults_equal_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    hf = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}
    ours = TrainingArguments("x")
    reference = transformers.TrainingArguments("x")
    for name in FIELDS:
        if name in NOT_IN_HF5 or name not in hf:
            continue
        mine, theirs = getattr(ours, name), getattr(reference, name)
        if name in ("disable_tqdm", "report_to"):
            continue  # HF derives them from the logger level / installed integrations
        assert mine == theirs or str(mine) == str(getattr(theirs, "value", theirs)), (name, mine, theirs)


def test_every_transformers_field_is_known() -> None:
    """Each HF field is either supported or listed as unsupported (so its error says so)."""
    transformers = pytest.importorskip("transformers")
    missing = [
        f.name
        for f in dataclasses.fields(transformers.TrainingArguments)
        if f.init and f.name not in FIELDS and f.name not in UNSUPPORTED
    ]
    assert missing == []


def test_unsupported_field_with_non_default_value() -> None:
    with pytest.raises(
        ConfigError, match=r"push_to_hub=True is a transformers argument that trainbus does not support"
    ):
        TrainingArguments("x", push_to_hub=True)
    with pytest.raises(ConfigError, match="renamed eval_strategy"):
        TrainingArguments("x", evaluation_strategy="steps")


def test_unsupported_field_with_hf_default_is_accepted() -> None:
    args = TrainingArguments("x", push_to_hub=False, local_rank=-1, ddp_timeout=1800)
    # read back at HF's default, as transformers' example scripts read them (is_main_process(args.local_rank))
    assert args.push_to_hub is False and args.local_rank == -1
    assert TrainingArguments("y").local_rank == -1


@given(st.sampled_from(FIELDS), st.data())
def test_misspelt_field_names_the_closest(name: str, data: st.DataObject) -> None:
    i = data.draw(st.integers(0, len(name) - 1))
    typo = name[:i] + name[i + 1 :]  # one character dropped
    if typo in FIELDS or typo in UNSUPPORTED or not typo:
        return
    with pytest.raises(ConfigError) as info:
        TrainingArguments("x", **{typo: 1})
    assert f"unknown argument {typo!r}" in str(info.value)
    assert "did you mean" in str(info.value)


def test_strategies_are_str_enums() -> None:
    args = TrainingArguments("x", eval_strategy="epoch", save_strategy="best", metric_for_best_model="loss")
    assert args.eval_strategy == "epoch" and args.eval_strategy is IntervalStrategy.EPOCH
    assert args.save_strategy == SaveStrategy.BEST
    with pytest.raises(ConfigError, match=r"eval_strategy must be one of.*did you mean 'epoch'"):
        TrainingArguments("x", eval_strategy="epochs")


def test_eval_steps_fall_back_to_logging_steps() -> None:
    assert TrainingArguments("x", eval_strategy="steps", logging_steps=7).eval_steps == 7


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"save_total_limit": 0}, "save_total_limit"),
        ({"fp16": True, "bf16": True}, "fp16 and bf16"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
        ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
        ({"logging_steps": 2.5}, "logging_steps must be an integer"),
        ({"load_best_model_at_end": True}, "eval_strategy other than 'no'"),
        ({"load_best_model_at_end": True, "eval_strategy": "epoch"}, "save and eval strategy to match"),
        (
            {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3, "save_steps": 4},
            "multiple of eval_steps",
        ),
        ({"warmup_ratio": 1.5}, "warmup_ratio"),
        ({"include_num_input_tokens_seen": "some"}, "include_num_input_tokens_seen"),
        ({"max_steps": 0}, "max_steps"),
        ({"save_strategy": "best"}, "metric_for_best_model"),
    ],
)
def test_bad_values(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TrainingArguments("x", **kwargs)


def test_best_model_defaults() -> None:
    args = TrainingArguments("x", load_best_model_at_end=True, eval_strategy="steps", eval_steps=5, save_steps=10)
    assert args.metric_for_best_model == "loss" and args.greater_is_better is False
    assert TrainingArguments("x", metric_for_best_model="accuracy").greater_is_better is True


def test_conveniences() -> None:
    args = TrainingArguments(per_device_train_batch_size=3, warmup_steps=0.1, include_num_input_tokens_seen=True)
    assert args.output_dir == "trainer_output"
    assert args.train_batch_size == 3 and args.world_size == 1
    assert args.get_warmup_steps(100) == 10
    assert args.include_num_input_tokens_seen == "all"
    assert '"eval_strategy": "no"' in args.to_json_string()
