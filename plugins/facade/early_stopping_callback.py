"""transformers' ``EarlyStoppingCallback``, as an HF-style callback the ``CallbackAdapter`` drives."""

from __future__ import annotations

import logging
from typing import Any

from trainbus.engine.errors import check_positive_int

from .callbacks import TrainerCallback

logger = logging.getLogger("trainbus.plugins")


class EarlyStoppingCallback(TrainerCallback):
    """Stop when ``metric_for_best_model`` fails to improve for ``early_stopping_patience`` evaluations.

    HF's class of that name, same arguments and rule: an evaluation improves when it beats
    ``state.best_metric`` (kept by the best-metric plugin; updated after this callback runs) by more
    than ``early_stopping_threshold``. Its counter is checkpointed through ``state()``.

    Args:
        early_stopping_patience: evaluations without improvement before stopping.
        early_stopping_threshold: the improvement that counts.

    Example:
        >>> from trainbus.plugins.facade.early_stopping_callback import EarlyStoppingCallback
        >>> stopper = EarlyStoppingCallback(early_stopping_patience=2)
    """

    def __init__(self, early_stopping_patience: int = 1, early_stopping_threshold: float | None = 0.0) -> None:
        check_positive_int("early_stopping_patience", early_stopping_patience)
        self.early_stopping_patience = early_stopping_patience
        self.early_stopping_threshold = early_stopping_threshold or 0.0
        self.early_stopping_patience_counter = 0

    def check_metric_value(self, args: Any, state: Any, control: Any, metric_value: float) -> None:
        best = state.best_metric
        better = best is None or (
            (metric_value > best if args.greater_is_better else metric_value < best)
            and abs(metric_value - best) > self.early_stopping_threshold
        )
        self.early_stopping_patience_counter = 0 if better else self.early_stopping_patience_counter + 1

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        from trainbus.engine import ConfigError
        from trainbus.engine.errors import ConfigAssertionError

        if args.metric_for_best_model is None:
            raise ConfigAssertionError("EarlyStoppingCallback needs TrainingArguments.metric_for_best_model")
        if str(args.eval_strategy) == "no":
            raise ConfigError("EarlyStoppingCallback needs an eval_strategy of 'steps' or 'epoch', got 'no'")

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> Any:
        key = args.metric_for_best_model
        key = key if key.startswith("eval_") else f"eval_{key}"
        value = (metrics or {}).get(key)
        if value is None:
            logger.warning("early stopping needs %r, which the evaluation did not produce; not stopping", key)
            return
        self.check_metric_value(args, state, control, float(value))
        if self.early_stopping_patience_counter >= self.early_stopping_patience:
            control.should_training_stop = True

    def state(self) -> dict[str, Any]:
        return {
            "args": {
                "early_stopping_patience": self.early_stopping_patience,
                "early_stopping_threshold": self.early_stopping_threshold,
            },
            "attributes": {"early_stopping_patience_counter": self.early_stopping_patience_counter},
        }
