"""DeepSpeed through accelerate: HF's ``deepspeed`` argument -> accelerate's ``DeepSpeedPlugin`` -> ZeRO.

``deepspeed_plugin_for(args)`` reads the config as transformers does (a path to a JSON file or a
dict; a JSON string from the command line too), fills its ``"auto"`` values from the
``TrainingArguments`` (transformers' ``trainer_config_process``: micro batch, accumulation steps,
train batch, gradient clipping, fp16 / bf16) and refuses values that contradict them, so a bad
config fails when the arguments are made. Without ``deepspeed`` it honours ``accelerate launch``'s
DeepSpeed config (``ACCELERATE_USE_DEEPSPEED``), as transformers does.

``ZeroSteps`` runs a trainbus step through the DeepSpeed engine accelerate prepares: the training
forward goes through the engine, ``backward`` is accelerate's (DeepSpeed's backward, and at the
last micro-batch of a window its ``step``: clipping, the optimizer step, loss-scale overflow check
and zeroing), so the engine's own optimizer step only reports whether DeepSpeed stepped. trainbus
normalises the loss itself (item-weighted accumulation), so DeepSpeed's division by the
accumulation steps is switched off (``scale_wrt_gas=False``, as transformers does).
"""

from __future__ import annotations

import copy
import enum
import json
import os
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Event, Priority

if TYPE_CHECKING:
    from trainbus.engine import Engine, Plugin
    from trainbus.engine.events import BatchStartEvent, TrainStartEvent

#: config sections trainbus builds itself from TrainingArguments
OWN_SECTIONS = {"optimizer": "optim / learning_rate / adam_*", "scheduler": "lr_scheduler_type / warmup_*"}
ZERO_STAGES = (0, 1, 2, 3)


def read_deepspeed_config(value: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """The DeepSpeed config as a fresh dict: from a dict, a JSON file, or a JSON string (the command line)."""
    if isinstance(value, Mapping):
        return copy.deepcopy(dict(value))
    if not isinstance(value, str | os.PathLike):
        raise ConfigError(f"deepspeed must be a path to a JSON file or a dict, got {type(value).__name__}")
    text, where = str(value), f"deepspeed config file {str(value)!r}"
    if text.lstrip().startswith("{"):
        where = "the deepspeed JSON string"
    else:
        try:
            text = Path(value).read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise ConfigError(f"{where} does not exist") from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where} cannot be read: {exc}") from exc
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{where} must hold a JSON object, got {type(config).__name__}")
    return config


def check_deepspeed_config(config: Mapping[str, Any], where: str = "the deepspeed config") -> None:
    """What trainbus needs of a DeepSpeed config: a ZeRO section with a stage, no optimizer / scheduler."""
    zero = config.get("zero_optimization")
    if not isinstance(zero, Mapping):
        raise ConfigError(f"{where} needs a 'zero_optimization' object with a 'stage' (one of {ZERO_STAGES})")
    stage = zero.get("stage", 0)
    if stage != "auto" and (isinstance(stage, bool) or stage not in ZERO_STAGES):
        raise ConfigError(f"{where}: zero_optimization.stage={stage!r}; allowed: {ZERO_STAGES}")
    for section, instead in OWN_SECTIONS.items():
        if section in config:
            raise ConfigError(
                f"{where} has a {section!r} section: trainbus builds the {section} from TrainingArguments "
                f"({instead}); remove the section"
            )
    enabled = [k for k in ("fp16", "bf16") if isinstance(config.get(k), Mapping) and config[k].get("enabled") is True]
    if len(enabled) == 2:
        raise ConfigError(f"{where} enables both fp16 and bf16; enable at most one")


def _node(config: dict[str, Any], dotted: str) -> tuple[dict[str, Any] | None, str]:
    *parents, leaf = dotted.split(".")
    node: Any = config
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    return (node if isinstance(node, dict) else None), leaf


def fill_from_arguments(config: dict[str, Any], args: Any, where: str = "the deepspeed config") -> None:
    """Replace ``"auto"`` values with the arguments' values; raise on values that contradict them (HF's rules)."""
    micro = args.per_device_train_batch_size
    steps = args.gradient_accumulation_steps
    flexible = bool(getattr(args, "auto_find_batch_size", False))  # the batch size may still shrink
    config.setdefault("train_micro_batch_size_per_gpu", micro)
    config.setdefault("gradient_accumulation_steps", steps)
    fills = [
        ("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size", not flexible),
        ("gradient_accumulation_steps", steps, "gradient_accumulation_steps", True),
        ("train_batch_size", args.world_size * micro * steps, "train_batch_size (calculated)", not flexible),
        ("gradient_clipping", args.max_grad_norm, "max_grad_norm", True),
        ("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval", True),
        ("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval", True),
    ]
    mismatches = []
    for dotted, value, name, must_match in fills:
        node, leaf = _node(config, dotted)
        if node is None:
            continue
        if node.get(leaf) == "auto":
            node[leaf] = value
        elif must_match and node.get(leaf) is not None and node[leaf] != value:
            mismatches.append(f"{dotted}={node[leaf]!r} but {name}={value!r}")
    if mismatches:
        raise ConfigError(
            f"{where} contradicts the TrainingArguments: {'; '.join(mismatches)}; set these DeepSpeed values to "
            "'auto' (they are then taken from the arguments)"
        )


def deepspeed_plugin_for(args: Any) -> Any:
    """accelerate's ``DeepSpeedPlugin`` for ``args.deepspeed`` or an ``accelerate launch`` DeepSpeed config."""
    from_launcher = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() in ("1", "true", "yes")
    if not args.deepspeed and not from_launcher:
        return None
    from accelerate.utils import DeepSpeedPlugin

    if args.deepspeed:
        where = (
            f"deepspeed config file {str(args.deepspeed)!r}"
            if isinstance(args.deepspeed, str | os.PathLike)
            else "the deepspeed config"
        )
        config = read_deepspeed_config(args.deepspeed)
        check_deepspeed_config(config, where)
        fill_from_arguments(config, args, where)
        source: Any = config
    else:
        where, source = "accelerate launch's DeepSpeed config", None  # DeepSpeedPlugin reads ACCELERATE_DEEPSPEED_*
    try:
        plugin = DeepSpeedPlugin(hf_ds_config=source)
    except (ValueError, TypeError, OSError) as exc:
        raise ConfigError(f"accelerate refused {where}: {exc}") from exc
    check_deepspeed_config(plugin.deepspeed_config, where)
    fill_from_arguments(plugin.deepspeed_config, args, where)
    return plugin


# -- training through the DeepSpeed engine ---------------------------------------------------------
_ENGINES: weakref.WeakKeyDictionary[torch.nn.Module, Any] = weakref.WeakKeyDictionary()


def deepspeed_engine_of(model: torch.nn.Module) -> Any:
    """The DeepSpeed engine accelerate made for ``model`` (None when DeepSpeed does not run it)."""
    return _ENGINES.get(model)


class ZeroSteps:
    """The step functions of a trainbus engine whose model DeepSpeed runs (a part of ``Distributed``).

    ``prepare`` hands the model and optimizer to ``accelerator.prepare`` once the optimizer exists
    (the Trainer calls it before a resume loads a checkpoint; otherwise TRAIN_START does).
    ``engine.model`` stays the user's module and ``engine.optimizer`` the torch optimizer whose
    parameter groups DeepSpeed steps, so schedulers and evaluation work unchanged.
    """

    def __init__(self, owner: Plugin, engine: Engine, accelerator: Any) -> None:
        self.accelerator = accelerator
        self.engine = engine
        self.model = engine.model
        self.ds_engine: Any = None
        self.ds_optimizer: Any = None
        self._boundary = True
        # before the LR scheduler (PRODUCER) builds on the optimizer DeepSpeed now owns
        owner.on(engine, Event.TRAIN_START, self._train_start, priority=Priority.FIRST)
        owner.on(engine, Event.BATCH_START, self._batch_start, priority=Priority.LAST)
        owner.wrap_hook(engine, "forward", self._forward)
        owner.wrap_hook(engine, "backward", self._backward)
        owner.wrap_hook(engine, "optimizer_step", self._optimizer_step)
        owner.wrap_hook(engine, "zero_grad", lambda inner: _no_zero_grad)

    @property
    def stage(self) -> int:
        return int(self.ds_engine.zero_optimization_stage()) if self.ds_engine is not None else -1

    def prepare(self, engine: Engine) -> None:
        """Let accelerate build the DeepSpeed engine around the model and optimizer (once)."""
        if self.ds_engine is not None:
            return
        if engine.optimizer is None:
            raise ConfigError("DeepSpeed needs engine.optimizer before training starts")
        try:
            self.ds_engine, self.ds_optimizer = self.accelerator.prepare(engine.model, engine.optimizer)
        except ValueError as exc:  # accelerate's config checks (e.g. an 'auto' value it cannot fill)
            raise ConfigError(f"DeepSpeed could not be set up: {exc}") from exc
        _ENGINES[self.model] = self.ds_engine

    def _train_start(self, ev: TrainStartEvent) -> None:
        self.prepare(ev.engine)

    def _batch_start(self, ev: BatchStartEvent) -> None:
        self._boundary = ev.micro_index == ev.window_size - 1

    def _forward(self, inner: Callable[[torch.nn.Module, Any], Any]) -> Callable[[torch.nn.Module, Any], Any]:
        model = self.model

        def forward(m: torch.nn.Module, batch: Any) -> Any:
            if m is model and m.training and torch.is_grad_enabled() and self.ds_engine is not None:
                return inner(self.ds_engine, batch)
            return inner(m, batch)

        return forward

    def _backward(self, inner: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        def backward(loss: torch.Tensor) -> None:
            # DeepSpeed's backward, and at the window's last micro-batch its step (clip, step, zero grads)
            self.accelerator.deepspeed_engine_wrapped.backward(loss, sync_gradients=self._boundary, scale_wrt_gas=False)

        return backward

    def _optimizer_step(self, inner: Callable[[Any], Any]) -> Callable[[Any], bool]:
        def optimizer_step(optimizer: Any) -> bool:
            norm = self.ds_engine.get_global_grad_norm()  # before clipping, over all partitions (as HF logs it)
            if norm is not None:
                self.engine.step_outputs["grad_norm"] = norm if isinstance(norm, torch.Tensor) else torch.tensor(norm)
            return not bool(self.ds_optimizer.step_was_skipped)  # stepped in backward; False on fp16 overflow

        return optimizer_step


def _no_zero_grad(optimizer: Any) -> None:
    """DeepSpeed zeroes the gradients in its step."""


# -- this rank's DeepSpeed state as plain values (checkpoints without pickle) -----------------------
#: the DeepSpeed engine's counters a checkpoint keeps
ENGINE_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
_KEPT, _OBJECT = "__kept__", "__object__"


def _plain(value: Any) -> Any:
    """Tensors and JSON values as they are; an object by its plain attributes; anything else left to the live state.

    A ZeRO optimizer's state holds, besides tensors and numbers, its loss scaler (an object of
    numbers: kept by its attributes), an enum and parameter mappings the live optimizer rebuilds.
    """
    if isinstance(value, enum.Enum):  # ZeRO's stage enum: the live optimizer's own
        return {_KEPT: type(value).__name__}
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        if all(isinstance(k, str | int) and not isinstance(k, bool) for k in value):
            return {k: _plain(v) for k, v in value.items()}
        return {_KEPT: type(value).__name__}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    if hasattr(value, "__dict__") and not isinstance(value, type) and not callable(value):
        attributes = {k: _plain(v) for k, v in vars(value).items() if not k.startswith("__")}
        return {_OBJECT: {k: v for k, v in attributes.items() if not (isinstance(v, dict) and _KEPT in v)}}
    return {_KEPT: type(value).__name__}


def _overlay(live: Any, saved: Any) -> Any:
    """``saved`` put onto ``live``: what was not saved (kept markers) comes from the live state."""
    if isinstance(saved, dict) and _KEPT in saved and len(saved) == 1:
        return live
    if isinstance(saved, dict) and _OBJECT in saved and len(saved) == 1:
        for name, value in saved[_OBJECT].items():
            setattr(live, name, _overlay(getattr(live, name, None), value))
        return live
    if isinstance(saved, dict) and isinstance(live, dict):
        return {**live, **{k: _overlay(live.get(k), v) for k, v in saved.items()}}
    if isinstance(saved, list | tuple) and isinstance(live, list | tuple) and len(saved) == len(live):
        return type(saved)(_overlay(a, b) for a, b in zip(live, saved, strict=True))
    if isinstance(saved, torch.Tensor) and isinstance(live, torch.Tensor):
        return saved.to(live.device)
    return saved


def zero_state(ds_engine: Any) -> dict[str, Any]:
    """This rank's ZeRO optimizer state (its partitions) and the engine's counters, as plain values."""
    counters = {name: int(getattr(ds_engine, name, 0)) for name in ENGINE_COUNTERS}
    return {"optimizer": _plain(ds_engine.optimizer.state_dict()), "engine": counters}


def load_zero_state(ds_engine: Any, saved: Mapping[str, Any]) -> None:
    """Put ``zero_state``'s values back: the fp32 master partitions, the optimizer states, the loss scale.

    ZeRO-1/2 keep the model's weights in the module (load them first); ZeRO-3 copies its fp32
    partitions into the model's partitions here.
    """
    import torch.distributed as dist

    merged = _overlay(ds_engine.optimizer.state_dict(), saved["optimizer"])
    # every rank passes its own state at its own index: only that one is read for a rigid checkpoint
    ds_engine.optimizer.load_state_dict(
        [merged] * dist.get_world_size(), load_optimizer_states=True, load_from_fp32_weights=True
    )
    for name, value in saved.get("engine", {}).items():
        setattr(ds_engine, name, value)


__all__ = [
    "ENGINE_COUNTERS",
    "ZeroSteps",
    "check_deepspeed_config",
    "deepspeed_engine_of",
    "deepspeed_plugin_for",
    "fill_from_arguments",
    "load_zero_state",
    "read_deepspeed_config",
    "zero_state",
]
