"""The ranges torch's optimizers check when they are made, checked when the arguments are given.

torch's Adam/AdamW/SGD refuse a negative learning rate, epsilon or weight decay and a beta outside
[0, 1) (``Invalid beta parameter at index 0``) only when the optimizer is built, at ``train()``; and a
string learning rate goes as far as the first step. ``TrainingArguments`` and ``OptimizerSetup`` check
the same ranges at construction, with their own argument names. Betas and epsilon are checked for every
optimizer name, also those that do not read them (SGD): a beta outside [0, 1) or a negative epsilon is
never a value any optimizer takes, so it is a mistake wherever it is written.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

import torch

from trainbus.engine import ConfigError
from trainbus.engine.errors import ConfigTypeError

#: what each hyperparameter allows: (lowest, lowest included, above this is refused, words)
RANGES: dict[str, tuple[float, bool, float, str]] = {
    "learning_rate": (0.0, True, math.inf, ">= 0"),
    "lr": (0.0, True, math.inf, ">= 0"),
    "weight_decay": (0.0, True, math.inf, ">= 0"),
    "adam_beta1": (0.0, True, 1.0, "in [0, 1)"),
    "adam_beta2": (0.0, True, 1.0, "in [0, 1)"),
    "adam_epsilon": (0.0, True, math.inf, ">= 0"),
}


def check_hyperparameter(name: str, value: Any, *, owner: str = "") -> None:
    """Raise unless ``value`` is a finite real number in ``RANGES[name]`` (a bool or a string is a TypeError)."""
    low, low_included, high, words = RANGES[name]
    where = f"{owner}: " if owner else ""
    if isinstance(value, torch.Tensor) and value.numel() == 1:  # torch takes a tensor learning rate too
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        shown = f"{value!r} ({type(value).__name__})"
        raise ConfigTypeError(f"{where}{name} must be a number {words}, got {shown}")
    number = float(value)
    inside = (number >= low if low_included else number > low) and number < high
    if math.isnan(number) or not inside:
        raise ConfigError(f"{where}{name} must be {words}, got {value!r}")


def check_optimizer_hyperparameters(values: Mapping[str, Any], *, owner: str = "") -> None:
    """Each of ``values`` (named as in ``RANGES``) in its range."""
    for name, value in values.items():
        check_hyperparameter(name, value, owner=owner)


__all__ = ["RANGES", "check_hyperparameter", "check_optimizer_hyperparameters"]
