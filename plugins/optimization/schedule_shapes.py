"""The closed forms of HF's learning-rate schedules: multipliers of the initial rate at an optimizer step.

Each is the multiplier ``transformers.get_scheduler``'s ``LambdaLR`` applies at optimizer step ``step``;
``schedulers.create_scheduler`` binds their keyword arguments by scheduler name.
"""

from __future__ import annotations

import math


# -- closed forms: multipliers of the initial learning rate at optimizer step ``step`` ------------------
def _warmup(step: int, warmup: int) -> float:
    return step / max(1, warmup)


def constant_factor(step: int) -> float:
    return 1.0


def constant_with_warmup_factor(step: int, *, num_warmup_steps: int) -> float:
    return _warmup(step, num_warmup_steps) if step < num_warmup_steps else 1.0


def linear_factor(step: int, *, num_warmup_steps: int, num_training_steps: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return max(0.0, (num_training_steps - step) / max(1, num_training_steps - num_warmup_steps))


def cosine_factor(
    step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: float = 0.5, min_lr_rate: float = 0.0
) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate)


def cosine_warmup_with_min_lr_factor(
    step: int,
    *,
    num_warmup_steps: int,
    num_training_steps: int,
    num_cycles: float = 0.5,
    min_lr_rate: float = 0.0,
    warmup_lr_rate: float | None = None,
) -> float:
    """HF's ``cosine_warmup_with_min_lr``: the warmup reaches 1 on its last step (from ``warmup_lr_rate``
    when given, else from 1 / warmup) and the cosine already moves on the first step after it."""
    if step < num_warmup_steps:
        if warmup_lr_rate is None:
            return (step + 1) / max(1, num_warmup_steps)
        return warmup_lr_rate + (1.0 - warmup_lr_rate) * step / max(1, num_warmup_steps - 1)
    progress = (step - num_warmup_steps + 1) / max(1, num_training_steps - num_warmup_steps)
    factor = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return max(0.0, factor * (1.0 - min_lr_rate) + min_lr_rate)


def cosine_with_restarts_factor(
    step: int, *, num_warmup_steps: int, num_training_steps: int, num_cycles: int = 1
) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    if progress >= 1.0:
        return 0.0
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * ((num_cycles * progress) % 1.0))))


def polynomial_factor(
    step: int, *, num_warmup_steps: int, num_training_steps: int, lr_end: float, power: float, lr_init: float
) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    if step > num_training_steps:
        return lr_end / lr_init
    remaining = 1 - (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
    return float(((lr_init - lr_end) * remaining**power + lr_end) / lr_init)


def inverse_sqrt_factor(step: int, *, num_warmup_steps: int, timescale: int) -> float:
    if step < num_warmup_steps:
        return _warmup(step, num_warmup_steps)
    return 1.0 / math.sqrt((step + timescale - num_warmup_steps) / timescale)


def _shape(kind: str, progress: float, num_cycles: float, rising: bool) -> float:
    if kind == "linear":
        return progress if rising else 1.0 - progress
    if kind == "cosine":
        if rising:
            return 0.5 * (1.0 - math.cos(math.pi * progress))
        return 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
    return 1.0 - math.sqrt(1.0 - progress) if rising else 1.0 - math.sqrt(progress)  # "1-sqrt"


def warmup_stable_decay_factor(
    step: int,
    *,
    num_warmup_steps: int,
    num_stable_steps: int,
    num_decay_steps: int,
    warmup_type: str = "linear",
    decay_type: str = "cosine",
    min_lr_ratio: float = 0.0,
    num_cycles: float = 0.5,
) -> float:
    if step < num_warmup_steps:
        factor = _shape(warmup_type, step / max(1, num_warmup_steps), num_cycles, rising=True)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    if step < num_warmup_steps + num_stable_steps:
        return 1.0
    if step < num_warmup_steps + num_stable_steps + num_decay_steps:
        progress = (step - num_warmup_steps - num_stable_steps) / max(1, num_decay_steps)
        factor = _shape(decay_type, progress, num_cycles, rising=False)
        return max(0.0, factor * (1.0 - min_lr_ratio) + min_lr_ratio)
    return min_lr_ratio
