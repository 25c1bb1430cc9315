"""TrainingArguments under transformers' HfArgumentParser, as transformers' example scripts use it.

Each command line (and JSON file) is parsed twice, into (ModelArguments, DataTrainingArguments,
trainbus TrainingArguments) and into (..., transformers.TrainingArguments); every field both
classes define must come out equal (enums compared by value).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import transformers
from transformers import HfArgumentParser

from trainbus.plugins.facade.arguments import ParallelMode, TrainingArguments


@dataclass
class ModelArguments:
    """As in transformers' examples/pytorch/text-classification/run_glue.py."""

    model_name_or_path: str = field(metadata={"help": "Path to pretrained model"})
    config_name: str | None = None
    cache_dir: str | None = None
    use_fast_tokenizer: bool = True
    model_revision: str = "main"
    token: str | None = None
    trust_remote_code: bool = False


@dataclass
class DataTrainingArguments:
    task_name: str | None = None
    max_seq_length: int = 128
    overwrite_cache: bool = False
    pad_to_max_length: bool = True
    max_train_samples: int | None = None
    train_file: str | None = None
    validation_file: str | None = None


#: the brief's command line, as a run_glue.py user types it
BASIC = (
    "--model_name_or_path tiny --output_dir out --do_train --per_device_train_batch_size 4 --report_to none "
    "--learning_rate 3e-5 --fsdp '' --optim adamw_torch"
)
#: most option kinds: enums, Optional numbers, ratios, lists, --no_*, JSON dicts, bool | None, Literal unions
FULL = [
    "--model_name_or_path", "tiny", "--task_name", "mrpc", "--max_seq_length", "64", "--output_dir", "out",
    "--do_train", "--do_eval", "--eval_strategy", "steps", "--eval_steps", "10",
    "--save_steps", "20", "--load_best_model_at_end", "--metric_for_best_model", "accuracy",
    "--greater_is_better", "true", "--lr_scheduler_type", "cosine", "--warmup_steps", "0.1",
    "--label_names", "labels", "start_positions", "--include_for_metrics", "inputs", "--no_remove_unused_columns",
    "--seed", "7", "--data_seed", "3", "--gradient_accumulation_steps", "2", "--logging_steps", "5",
    "--save_total_limit", "2", "--lr_scheduler_kwargs", '{"num_cycles": 1}', "--debug", "underflow_overflow",
    "--include_num_input_tokens_seen", "true", "--max_grad_norm", "0.5", "--num_train_epochs", "2",
    "--gradient_checkpointing", "true", "--gradient_checkpointing_kwargs", '{"use_reentrant": false}',
    "--trackio_static_space_id", "me/space", "--tf32", "false", "--deepspeed", "", "--ddp_timeout", "60",
    "--eval_delay", "1", "--optim", "sgd", "--weight_decay", "0.01", "--no_dataloader_pin_memory",
    "--logging_first_step", "--run_name", "glue", "--dataloader_num_workers", "0", "--fsdp", "",
]  # fmt: skip


def normal(value: Any) -> Any:
    """Enums as their values, tuples as lists: how the two classes' parsed values are compared."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list | tuple):
        return [normal(v) for v in value]
    return value


def parse_both(argv: list[str]) -> tuple[Any, Any, Any, Any]:
    """(model, data, trainbus args, transformers args) from one command line."""
    model, data, ours = HfArgumentParser(
        (ModelArguments, DataTrainingArguments, TrainingArguments)
    ).parse_args_into_dataclasses(argv, look_for_args_file=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # HF 5 deprecates gradient_checkpointing's name
        hf = HfArgumentParser(
            (ModelArguments, DataTrainingArguments, transformers.TrainingArguments)
        ).parse_args_into_dataclasses(argv, look_for_args_file=False)[2]
    return model, data, ours, hf


def differences(ours: TrainingArguments, hf: Any) -> dict[str, tuple[Any, Any]]:
    theirs = {f.name for f in dataclasses.fields(hf)}
    shared = [f.name for f in dataclasses.fields(ours) if f.name in theirs]
    assert len(shared) > 90, shared
    return {
        name: (getattr(ours, name), getattr(hf, name))
        for name in shared
        if normal(getattr(ours, name)) != normal(getattr(hf, name))
    }


def test_the_basic_command_line_parses_as_transformers_parses_it() -> None:
    import shlex

    model, data, ours, hf = parse_both(shlex.split(BASIC))
    assert isinstance(ours, TrainingArguments) and isinstance(model, ModelArguments)
    assert isinstance(data, DataTrainingArguments) and model.model_name_or_path == "tiny"
    assert (ours.output_dir, ours.do_train, ours.per_device_train_batch_size) == ("out", True, 4)
    assert (ours.learning_rate, ours.optim, ours.report_to, ours.fsdp_plugin_args) == (3e-5, "adamw_torch", [], None)
    assert differences(ours, hf) == {}


def test_a_full_command_line_parses_as_transformers_parses_it() -> None:
    _, data, ours, hf = parse_both(FULL)
    assert data.task_name == "mrpc" and data.max_seq_length == 64
    assert ours.label_names == ["labels", "start_positions"] and ours.remove_unused_columns is False
    assert ours.lr_scheduler_kwargs == {"num_cycles": 1} and ours.gradient_checkpointing_kwargs == {
        "use_reentrant": False
    }
    assert ours.debug == ["underflow_overflow"] and ours.dataloader_pin_memory is False
    assert ours.eval_steps == 10 and ours.warmup_steps == 0.1 and ours.do_eval
    assert differences(ours, hf) == {}


def test_an_empty_command_line_gives_the_defaults() -> None:
    """HfArgumentParser gives None for some absent options (a list field with a non-list default: debug)."""
    _, _, ours, hf = parse_both(["--model_name_or_path", "m"])
    assert differences(ours, hf) == {}
    defaults = TrainingArguments()
    for f in dataclasses.fields(TrainingArguments):
        assert getattr(ours, f.name) == getattr(defaults, f.name), f.name


def test_an_eval_strategy_sets_do_eval_as_transformers_does() -> None:
    assert TrainingArguments("x", eval_strategy="epoch").do_eval
    assert not TrainingArguments("x").do_eval


def test_a_json_file_parses_as_transformers_parses_it(tmp_path: Path) -> None:
    """transformers' examples: ``parser.parse_json_file(json_file=sys.argv[1])`` (JSON numbers, lists, null)."""
    config = {
        "model_name_or_path": "tiny", "task_name": "mrpc", "output_dir": str(tmp_path / "out"), "do_train": True,
        "per_device_train_batch_size": 4, "num_train_epochs": 3, "learning_rate": 3e-5, "report_to": ["none"],
        "fsdp": "", "optim": "adamw_torch", "label_names": ["labels"], "lr_scheduler_kwargs": {"num_cycles": 1},
        "eval_strategy": "epoch", "save_strategy": "epoch", "logging_steps": 1, "data_seed": None,
        "debug": "", "max_grad_norm": 1, "gradient_checkpointing_kwargs": None, "trackio_static_space_id": False,
    }  # fmt: skip
    path = tmp_path / "args.json"
    path.write_text(json.dumps(config))
    model, data, ours = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments)).parse_json_file(
        str(path)
    )
    hf = HfArgumentParser((ModelArguments, DataTrainingArguments, transformers.TrainingArguments)).parse_json_file(
        str(path)
    )[2]
    assert model.model_name_or_path == "tiny" and data.task_name == "mrpc"
    assert ours.num_train_epochs == 3 and ours.report_to == [] and ours.lr_scheduler_kwargs == {"num_cycles": 1}
    assert differences(ours, hf) == {}


def test_a_bad_value_on_the_command_line_names_the_field() -> None:
    from trainbus.engine import ConfigError

    parser = HfArgumentParser((ModelArguments, TrainingArguments))
    with pytest.raises(ConfigError, match="learning_rate must be a finite number, got inf"):
        parser.parse_args_into_dataclasses(["--model_name_or_path", "m", "--learning_rate", "inf"])
    with pytest.raises(SystemExit):  # argparse's own error: the option's type is int
        parser.parse_args_into_dataclasses(["--model_name_or_path", "m", "--seed", "abc"])


def test_the_parser_leaves_the_class_checks_intact() -> None:
    """HfArgumentParser rewrites ``Field.type`` of the class in place (report_to -> str); the checks still read
    the annotations, so a list report_to stays allowed from Python after a parser was built."""
    HfArgumentParser(TrainingArguments)
    assert TrainingArguments("x", report_to=["tensorboard"]).report_to == ["tensorboard"]
    assert TrainingArguments("x", fsdp=False).fsdp_plugin_args is None


def test_parallel_mode_and_main_process_first_in_one_process() -> None:
    args = TrainingArguments("x")
    assert args.parallel_mode == ParallelMode.NOT_PARALLEL and args.parallel_mode.value == "not_parallel"
    assert args.parallel_mode.value == transformers.training_args.ParallelMode.NOT_PARALLEL.value
    ran = []
    with args.main_process_first(desc="tokenize"):
        ran.append(1)
    with args.main_process_first(local=False):
        ran.append(2)
    assert ran == [1, 2]
    with pytest.raises(KeyError), args.main_process_first():
        raise KeyError("the body's error propagates")
