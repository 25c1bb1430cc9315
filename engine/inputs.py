"""Checks of what an Engine is given that torch would otherwise refuse late or with its own words."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .errors import ConfigError, ConfigTypeError, check_callable, check_flag
from .signatures import check_hooks, describe_callable

_OPTIMIZER_PROTOCOL = ("step", "zero_grad", "param_groups")


def check_device(device: torch.device | str | int) -> torch.device:
    """``device`` as a torch.device; a ConfigError naming it when torch cannot parse it or has no such GPU."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(
            f"device={device!r} is not a device torch knows: use 'cpu', 'cuda', 'cuda:N', 'mps' or a torch.device "
            f"({error})"
        ) from None
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(f"device={device!r}: CUDA is not available here (no GPU, or torch built without CUDA)")
        if parsed.index is not None and parsed.index >= count:
            raise ConfigError(f"device={device!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return parsed


def check_optimizer(optimizer: Any) -> None:
    """A ConfigError unless ``optimizer`` is None or has torch.optim.Optimizer's step/zero_grad/param_groups."""
    if optimizer is None:
        return
    missing = [name for name in _OPTIMIZER_PROTOCOL if not hasattr(optimizer, name)]
    if missing:
        raise ConfigError(
            f"optimizer must be a torch.optim.Optimizer (or have {', '.join(_OPTIMIZER_PROTOCOL)}), got "
            f"{optimizer!r} of type {type(optimizer).__name__}, which has no {', '.join(missing)}"
        )


def _kind(value: object) -> str:
    return type(value).__name__


def check_data(name: str, data: Any, *, named: bool = False) -> None:
    """A ConfigError unless ``data`` is None or an iterable of batches (``named``: or a dict of such by name).

    A str or bytes iterates its characters, a dict its keys, a number not at all: each fails here, naming
    the value, instead of inside the model's forward or as "no length".
    """
    if data is None:
        return
    if named and isinstance(data, Mapping):
        for key, subset in data.items():
            if not isinstance(key, str):
                raise ConfigTypeError(
                    f"{name} as a dict maps set names (str) to data, got the key {key!r} ({_kind(key)})"
                )
            check_data(f"{name}[{key!r}]", subset)
        return
    iterable = hasattr(type(data), "__iter__") or hasattr(type(data), "__getitem__")
    if not iterable or isinstance(data, str | bytes | Mapping):
        allowed = "an iterable of batches (a DataLoader, a list of batches, an IterableDataset)"
        if named:
            allowed += " or a dict of such by name"
        raise ConfigTypeError(f"{name} must be {allowed}, got {data!r:.80} ({_kind(data)})")


def check_label_names(label_names: Any) -> tuple[str, ...]:
    """``label_names`` as a tuple of str; a ConfigError for a bare str (its characters) or anything else."""
    if isinstance(label_names, str) or not isinstance(label_names, Iterable):
        hint = f" (one str: write ({label_names!r},))" if isinstance(label_names, str) else f" ({_kind(label_names)})"
        raise ConfigTypeError(
            f"label_names must be a list or tuple of str, e.g. ('labels',), got {label_names!r:.80}{hint}"
        )
    names = tuple(label_names)
    wrong = [name for name in names if not isinstance(name, str)]
    if wrong:
        raise ConfigTypeError(f"label_names must hold str only, got {wrong[0]!r} ({_kind(wrong[0])}) in {names!r:.80}")
    return names


def check_plugins(plugins: Any) -> list[Any]:
    """``plugins`` as a list; a ConfigError for one plugin given bare, or for anything not iterable."""
    if hasattr(plugins, "attach"):
        raise ConfigTypeError(f"plugins must be a list of trainbus Plugins, got one {_kind(plugins)}: pass [it]")
    if isinstance(plugins, str) or not isinstance(plugins, Iterable):
        raise ConfigTypeError(f"plugins must be a list of trainbus Plugins, got {plugins!r:.80} ({_kind(plugins)})")
    return list(plugins)


def check_engine_arguments(loss_fn: Any, trace: Any, eval_data: Any, hooks: Any = None) -> None:
    """The Engine's arguments that only need a look (the others are converted where they are stored).

    Every field of ``hooks`` is checked (``signatures.check_hooks``), also a ``compute_loss`` that ``loss_fn`` would
    replace unseen; a custom ``compute_loss`` and a ``loss_fn`` together are refused: one of them would be ignored.
    """
    if hooks is not None:
        check_hooks(hooks, "set_hook / Hooks(...) gave")  # the words of assembly.py's check
        if loss_fn is not None and hooks.compute_loss is not type(hooks)().compute_loss:
            raise ConfigError(
                f"loss_fn={describe_callable(loss_fn)} and hooks=Hooks(compute_loss=...) both give the loss, and "
                "loss_fn would replace the hook unseen: pass one of them"
            )
    check_callable(
        "loss_fn", loss_fn, "a callable loss_fn(prediction, labels) -> scalar tensor (e.g. torch.nn.MSELoss())"
    )
    check_flag("trace", trace)
    check_data("eval_data", eval_data, named=True)
