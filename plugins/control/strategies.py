"""The HF strategies for when logs, evaluations and checkpoints happen, and their check."""

from __future__ import annotations

import enum
from typing import Any

from trainbus.engine import ConfigError
from trainbus.engine.errors import suggest


class IntervalStrategy(str, enum.Enum):
    """When logging / evaluation happen (HF ``IntervalStrategy``); members compare equal to their strings."""

    NO = "no"
    STEPS = "steps"
    EPOCH = "epoch"

    def __str__(self) -> str:
        return self.value


class SaveStrategy(str, enum.Enum):
    """When checkpoints are written (HF ``SaveStrategy``): also ``"best"``, after a new best metric."""

    NO = "no"
    STEPS = "steps"
    EPOCH = "epoch"
    BEST = "best"

    def __str__(self) -> str:
        return self.value


def check_strategy(name: str, value: Any, kind: type[enum.Enum]) -> Any:
    """``kind(value)``, or a ConfigError naming ``name`` and the allowed strings."""
    allowed = [m.value for m in kind]  # type: ignore[attr-defined]
    raw = value.value if isinstance(value, enum.Enum) else value
    if raw not in allowed:
        raise ConfigError(f"{name} must be one of {allowed}, got {value!r}{suggest(str(raw), allowed)}")
    return kind(raw)
