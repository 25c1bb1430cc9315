"""Early stopping on an evaluation metric: ``EarlyStopping`` and its reference function.

After every evaluation inside ``fit`` the plugin compares the watched metric with the best seen
so far: an improvement must beat it by more than ``threshold`` (ties are not improvements, NaN
never is); after ``patience`` evaluations in a row without one it sets
``control.should_training_stop``. Its counter and best value are in ``state_dict``, so a resumed
run stops where the uninterrupted one would.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from trainbus.engine import Composition, ConfigError, EvalEndEvent, Priority
from trainbus.engine.errors import check_positive_int

from .best_model import MetricPlugin, MetricWatch, is_improvement

__all__ = ["EarlyStopping", "early_stop_index"]


def early_stop_index(
    values: Sequence[float], patience: int, threshold: float = 0.0, greater_is_better: bool = True
) -> int | None:
    """Reference: the index of the evaluation after which training stops, or None if it never does."""
    best: float | None = None
    waited = 0
    for i, value in enumerate(values):
        if is_improvement(value, best, greater_is_better, threshold):
            best, waited = value, 0
        else:
            waited += 1
            if waited >= patience:
                return i
    return None


class EarlyStopping(MetricPlugin):
    """Stops training when an eval metric stops improving (HF ``EarlyStoppingCallback``).

    Args:
        metric: the metric to watch, e.g. "loss" (-> ``eval_loss``), "accuracy", "eval_valid_f1".
        patience: evaluations without improvement before stopping (>= 1).
        threshold: how much better than the best a value must be to count as an improvement (>= 0).
        greater_is_better: None infers it from the name (loss-like names are lower-is-better).

    Example:
        >>> stopper = EarlyStopping("accuracy", patience=2)
        >>> stopper.key, stopper.greater_is_better
        ('eval_accuracy', True)
    """

    priority = Priority.CONSUMER

    def __init__(
        self, metric: str = "loss", patience: int = 1, threshold: float = 0.0, greater_is_better: bool | None = None
    ) -> None:
        check_positive_int("patience", patience)
        if not isinstance(threshold, int | float) or not threshold >= 0 or math.isinf(threshold):
            raise ConfigError(f"threshold must be a finite number >= 0, got {threshold!r}")
        self.watch = MetricWatch(metric, greater_is_better)
        self.patience = patience
        self.threshold = float(threshold)
        self.best: float | None = None
        self.waited = 0  # evaluations since the last improvement

    def observe(self, value: float, ev: EvalEndEvent) -> None:
        if is_improvement(value, self.best, self.greater_is_better, self.threshold):
            self.best, self.waited = value, 0
            return
        self.waited += 1
        if self.waited >= self.patience:
            ev.engine.control.should_training_stop = True

    def check_composition(self, composition: Composition) -> Iterable[str] | None:
        """Warn when nothing schedules an evaluation: with none, this plugin never stops anything."""
        if "evaluate" in composition.scheduled:
            return None
        return [
            f"nothing schedules an evaluation, so it never sees {self.key!r} and never stops the run; "
            "attach FlowControl(eval_strategy='steps' or 'epoch'), or a plugin whose schedules() has 'evaluate' "
            "(a plain handler setting control.should_evaluate is not seen: then ignore CompositionWarning)"
        ]

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "waited": self.waited}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]
        self.waited = int(state["waited"])
