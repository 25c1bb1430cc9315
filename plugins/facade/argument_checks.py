"""Checks of TrainingArguments values, and the tables they read.

Kept apart from ``arguments.py`` so the dataclass stays a list of fields (this module does not import it:
the checks take the arguments object as ``Any``, so the two form no import cycle). The central check,
``check_field_types``, compares every field's value with its annotation before ``__post_init__``
converts anything, so a value of the wrong type (``learning_rate='0.01'``, ``label_names='labels'``)
fails at construction with the field, the value and what is allowed, instead of a traceback deep in
the optimizer or a silent misreading. The annotations are transformers' own (``HfArgumentParser``
reads them to build a command line), so where trainbus accepts more than the annotation says (a
``pathlib.Path`` output_dir, ``fsdp=True``) ``ACCEPTED`` widens it.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import numbers
import os
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from trainbus.engine import ConfigError
from trainbus.engine.errors import ConfigTypeError, check_positive_int

from ..optimization.optimizer_checks import check_optimizer_hyperparameters

#: HF fields trainbus does not implement, with HF's default: passing the default is accepted
#: (it changes nothing), any other value raises. A hint names the trainbus way when there is one.
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "save_on_each_node": (False, "only the main process saves"),
    "push_to_hub": (False, "trainbus never uploads"),
    "hub_token": (None, "trainbus never talks to the Hub"),
    "hub_model_id": (None, "trainbus never uploads"),
    "hub_always_push": (False, "trainbus never uploads"),
    "hub_revision": (None, "trainbus never uploads"),
    "parallelism_config": (None, "trainbus has no tensor, context or sequence parallelism (use fsdp or deepspeed)"),
    "dataloader_in_order": (True, "a resume replays the loader's order, which batches yielded as ready do not keep"),
    "local_rank": (-1, "the process index comes from accelerate"),
    "evaluation_strategy": (None, "renamed eval_strategy in transformers 4.46"),
    "no_cuda": (False, "renamed use_cpu"),
    "use_mps_device": (False, ""),
    "use_ipex": (False, ""),
    "jit_mode_eval": (False, ""),
    "half_precision_backend": ("auto", ""),
    "tpu_num_cores": (None, ""),
    "past_index": (-1, ""),
    "include_inputs_for_metrics": (False, "renamed include_for_metrics"),
    "adafactor": (False, "use optim='adafactor'"),
    "torchdynamo": (None, "use torch_compile"),
    "ray_scope": ("last", ""),
    "mp_parameters": ("", ""),
    "dispatch_batches": (None, ""),
    "split_batches": (None, ""),
    "fp16_opt_level": ("O1", ""),
    "fp16_backend": ("auto", ""),
    "save_safetensors": (True, "checkpoints are always safetensors (no pickle)"),
}

#: HF's log_level names; "passive" leaves the level as it is
LOG_LEVELS: dict[str, int | None] = {
    "detail": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "passive": None,
}

#: torch.distributed backends HF accepts for ddp_backend
DDP_BACKENDS = ("nccl", "gloo", "mpi", "ccl", "hccl", "cncl", "mccl", "xccl")

#: what a field accepts from Python beyond its (HF) annotation; the command line follows the annotation
ACCEPTED: dict[str, Any] = {
    "output_dir": str | os.PathLike | None,
    "logging_dir": str | os.PathLike | None,
    "resume_from_checkpoint": str | os.PathLike | None,
    "fsdp": bool | str | list[str] | None,  # HF's code takes True and option lists too
    "debug": str | list[str] | None,  # HfArgumentParser gives None when --debug is absent (HF's does too)
}

#: what an error message says a field allows, where the type alone says too little
ALLOWED_WORDS: dict[str, str] = {
    "trackio_static_space_id": "a Space id, None (a generated name) or False (no static Space)",
    "label_names": "None or a list of str (e.g. ['labels'])",
    "fsdp": "True, an option string (e.g. 'full_shard auto_wrap'), a list of options, or None",
}

#: float fields where infinity means something (no clipping, but the norm is still computed and logged)
INFINITY_ALLOWED = frozenset({"max_grad_norm"})


def check_field_types(args: Any) -> None:
    """Raise ConfigError for the first field whose value does not fit its annotation (or ``ACCEPTED``).

    A value of the wrong type is a ``ConfigTypeError`` (also a ``TypeError``, what transformers raises where
    it checks a type, e.g. ``optim_target_modules``); a number out of range stays a ``ValueError``.

    Numbers: an int fits a float field, a bool fits no number field, and float fields must be finite
    (NaN never, infinity only where ``INFINITY_ALLOWED``) so ``learning_rate=inf`` fails here.
    """
    for name, expected in field_types(type(args)).items():
        value = getattr(args, name)
        if not _fits(value, expected):
            allowed = ALLOWED_WORDS.get(name) or _describe(expected)
            raise ConfigTypeError(f"TrainingArguments: {name} must be {allowed}, got {_show(value)}")
        if isinstance(value, float) and (math.isnan(value) or (math.isinf(value) and name not in INFINITY_ALLOWED)):
            raise ConfigError(f"TrainingArguments: {name} must be a finite number, got {value!r}")


def field_types(cls: type) -> dict[str, Any]:
    """Each init field's accepted type, resolved once per class (``HfArgumentParser`` rewrites ``Field.type``
    in place, so the annotations are read from the class, not from the fields)."""
    import dataclasses

    if cls not in _FIELD_TYPES:
        hints = typing.get_type_hints(cls)
        _FIELD_TYPES[cls] = {f.name: ACCEPTED.get(f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init}
    return _FIELD_TYPES[cls]


_FIELD_TYPES: dict[type, dict[str, Any]] = {}


def _fits(value: Any, expected: Any) -> bool:
    if expected is Any:
        return True
    if expected is type(None):
        return value is None
    origin = typing.get_origin(expected)
    if origin is Union or origin is types.UnionType:
        return any(_fits(value, option) for option in typing.get_args(expected))
    if origin is Literal:
        return any(value == v and type(value) is type(v) for v in typing.get_args(expected))
    if origin in (list, tuple):
        item = typing.get_args(expected)[0] if typing.get_args(expected) else Any
        return isinstance(value, list | tuple) and all(_fits(v, item) for v in value)
    if origin is dict or expected is dict:
        return isinstance(value, Mapping)
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if isinstance(expected, type) and issubclass(expected, enum.Enum):
        return isinstance(value, expected) or value in {m.value for m in expected}
    return isinstance(expected, type) and isinstance(value, expected)


def _describe(expected: Any) -> str:
    """``float | None`` -> 'a number or None', ``list[str]`` -> 'a list of str' (for the error message)."""
    return _or(_words(expected))


def _words(expected: Any) -> list[str]:
    if expected is type(None):
        return ["None"]
    origin = typing.get_origin(expected)
    if origin is Union or origin is types.UnionType:
        return [word for option in typing.get_args(expected) for word in _words(option)]
    if origin is Literal:
        return [repr(v) for v in typing.get_args(expected)]
    if origin in (list, tuple):
        args = typing.get_args(expected)
        return [f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}" if args else "a list"]
    if origin is dict or expected is dict:
        return ["a dict"]
    if expected is bool:
        return ["True", "False"]
    if expected is float:
        return ["a number"]
    if expected is os.PathLike:
        return ["a path"]
    return [_a(getattr(expected, "__name__", str(expected)))]


def _a(name: str) -> str:
    return f"{'an' if name[:1] in 'aeiou' else 'a'} {name}"


def _or(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _show(value: Any) -> str:
    """The value and its type, with the fix when it is a number written as a string."""
    shown = f"{value!r} ({_a(type(value).__name__)})"
    if isinstance(value, str):
        for convert in (int, float):
            try:
                number = convert(value)
            except ValueError:
                continue
            return f"{shown}; pass the number itself, e.g. {number!r}"
    return shown


def check_numbers(args: Any) -> None:
    """Ranges of the numeric fields (types were checked already)."""
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        check_positive_int(name, getattr(args, name))
    if args.max_steps != -1:
        check_positive_int("max_steps (or -1 to use num_train_epochs)", args.max_steps)
    if args.max_steps == -1 and not args.num_train_epochs > 0:
        raise ConfigError(f"num_train_epochs must be > 0 when max_steps is -1, got {args.num_train_epochs!r}")
    if args.save_total_limit is not None:
        check_positive_int("save_total_limit (or None to keep every checkpoint)", args.save_total_limit)
    if args.eval_accumulation_steps is not None:
        check_positive_int("eval_accumulation_steps", args.eval_accumulation_steps)
    names = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon")
    check_optimizer_hyperparameters({name: getattr(args, name) for name in names})  # torch's ranges, now
    if args.eval_delay < 0:
        raise ConfigError(f"eval_delay must be >= 0 (epochs or steps before evaluating), got {args.eval_delay!r}")
    if not 0.0 <= args.warmup_ratio <= 1.0:
        raise ConfigError(f"warmup_ratio must be in [0, 1], got {args.warmup_ratio!r}")
    if args.warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be >= 0 (a float < 1 is a ratio), got {args.warmup_steps!r}")
    if not 0.0 <= args.label_smoothing_factor < 1.0:
        raise ConfigError(f"label_smoothing_factor must be in [0, 1), got {args.label_smoothing_factor!r}")
    if args.max_grad_norm is not None and args.max_grad_norm < 0:
        raise ConfigError(f"max_grad_norm must be >= 0 (0 disables clipping), got {args.max_grad_norm!r}")
    if args.dataloader_num_workers < 0:
        raise ConfigError(f"dataloader_num_workers must be >= 0, got {args.dataloader_num_workers!r}")
    check_loading_and_names(args)
    if args.neftune_noise_alpha is not None and args.neftune_noise_alpha <= 0:
        raise ConfigError(f"neftune_noise_alpha must be > 0 or None, got {args.neftune_noise_alpha!r}")


#: what HF's ``include_for_metrics`` lists may hold (HF ignores any other word: a typo passes silently)
INCLUDE_FOR_METRICS = ("inputs", "loss")


def check_loading_and_names(args: Any) -> None:
    """``dataloader_prefetch_factor`` (HF refuses it without worker processes; torch asserts it > 0 only when
    the workers start), ``include_for_metrics`` words and ``label_names`` that name something."""
    prefetch = args.dataloader_prefetch_factor
    if prefetch is not None:
        check_positive_int("dataloader_prefetch_factor (or None)", prefetch)
        if args.dataloader_num_workers == 0:
            raise ConfigError(
                f"dataloader_prefetch_factor={prefetch!r} is for worker processes, but dataloader_num_workers=0 loads "
                "in the main process: set dataloader_num_workers > 0 or leave it None (as transformers requires)"
            )
    for word in args.include_for_metrics:
        if word not in INCLUDE_FOR_METRICS:
            raise ConfigError(f"include_for_metrics may hold {list(INCLUDE_FOR_METRICS)}, got {word!r}")
    for name in args.label_names or ():
        if not name:
            raise ConfigError(f"label_names must be non-empty field names (e.g. ['labels']), got {args.label_names!r}")


def check_lr_scheduler(args: Any) -> None:
    """A known ``lr_scheduler_type``; ``reduce_lr_on_plateau`` needs evaluations to watch (HF's ValueError
    in TrainingArguments: without an eval_strategy the schedule would never step)."""
    from ..optimization.schedulers import check_scheduler_name

    name = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    check_scheduler_name(name)
    if name == "reduce_lr_on_plateau" and str(getattr(args.eval_strategy, "value", args.eval_strategy)) == "no":
        raise ConfigError(
            "lr_scheduler_type='reduce_lr_on_plateau' requires an eval strategy: it lowers the rate when the "
            "eval metric stops improving; set eval_strategy='steps' or 'epoch'"
        )


def check_output_dir(path: str) -> None:
    """A non-empty output_dir (``''`` would write into the working directory: ``'.'`` says so) that, if it
    exists, is a directory: a file there would fail only at the first save."""
    from ..checkpoints.output_dir_check import check_output_dir as check_path

    check_path(path)


def dict_argument(name: str, value: Any) -> Any:
    """A ``*_kwargs`` field: a dict, None, or a JSON object string (the command line's form, parsed as HF does).

    HF keeps any other string, which fails later as ``**'warmup'``; here it fails now, naming it.
    """
    if not isinstance(value, str):
        return value
    if value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{name} must be a dict or a JSON object string; {value!r} is not valid JSON ({exc})"
            ) from None
    raise ConfigError(f"{name} must be a dict, a JSON object string such as '{{\"key\": 1}}' or None, got {value!r}")


def check_compile_settings(args: Any) -> None:
    """HF's rule: a torch_compile_mode or _backend turns torch_compile on; the mode is one torch knows."""
    from ..optimization.model_setup import check_compile_mode

    if (args.torch_compile_mode is not None or args.torch_compile_backend is not None) and not args.torch_compile:
        args.torch_compile = True  # HF 5 does the same rather than ignoring them
    if args.torch_compile and args.torch_compile_backend is None:
        args.torch_compile_backend = "inductor"  # HF's default backend (torch.compile's too)
    check_compile_mode(args.torch_compile_mode, "torch_compile_mode")


#: HF's hub_strategy values (HubStrategy)
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")


def one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    """Raise ConfigError unless ``value`` is one of ``allowed``."""
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")


def check_trackers(args: Any) -> None:
    """The experiment trackers' settings (types are checked already)."""
    if not args.project:
        raise ConfigError(f"project must be a non-empty string (the tracker's project name), got {args.project!r}")


def report_to_list(value: Any) -> list[str]:
    """HF's ``report_to`` as a list of names ("none" and None: no tracker)."""
    if value is None or value == "none" or value == ["none"]:
        return []
    names = [value] if isinstance(value, str) else list(value)
    return [str(n) for n in names]
