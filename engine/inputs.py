"""Checks of what an Engine is given that torch would otherwise refuse late or with its own words."""

from __future__ import annotations

from typing import Any

import torch

from .errors import ConfigError

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
