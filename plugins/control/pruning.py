"""TrialPruning: a hyperparameter-search trial reports each evaluation's objective and stops when pruned.

``hyperparameter_search`` (facade/search.py) attaches one per optuna trial; anything with optuna's
``report(value, step)`` and ``should_prune()`` works as the trial.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainbus.engine import ConfigError, EvalEndEvent, Event, Plugin, Priority
from trainbus.engine.errors import check_flag

from .best_model import eval_prefixes

__all__ = ["TrialPruning", "number"]


class TrialPruning(Plugin):
    """Reports the objective of each evaluation during training to a trial; stops the run when it is pruned.

    At EVAL_END (last priority, when every metric is in the payload) it computes
    ``compute_objective(metrics)`` and keeps it in ``objective``; with ``report`` it calls
    ``trial.report(objective, global_step)`` and, when ``trial.should_prune()``, sets ``pruned`` and
    ``control.should_training_stop``: the run ends cleanly (TRAIN_END fires, sinks close their files,
    callbacks see on_train_end) and the caller raises ``optuna.TrialPruned`` after ``train()``
    returns. With a dict of eval sets, the objective is computed once all sets have reported.
    Evaluations outside ``fit`` are ignored, as in HF. ``hyperparameter_search`` attaches it with
    ``pruning.attach(trainer)`` rather than ``add_plugin``, so that it is not in the trial's
    checkpoints and a Trainer without it can resume from them.

    Args:
        trial: the optuna trial (anything with ``report(value, step)`` and ``should_prune()``).
        compute_objective: metrics -> objective (a number; a list of numbers when ``report`` is False).
        report: report to the trial and prune (False for multi-objective studies, which optuna cannot prune).

    Example:
        >>> class Trial:
        ...     def report(self, value, step): print("report", value, step)
        ...     def should_prune(self): return False
        >>> pruning = TrialPruning(Trial(), lambda metrics: metrics["eval_loss"])
    """

    priority = Priority.LAST

    def __init__(self, trial: Any, compute_objective: Callable[[dict[str, Any]], Any], *, report: bool = True) -> None:
        if not callable(compute_objective):
            raise ConfigError(f"compute_objective must be a function, got {type(compute_objective).__name__}")
        check_flag("report", report)
        self.trial = trial
        self.compute_objective = compute_objective
        self.report = report
        self.objective: Any = None  # of the latest evaluation during training
        self.pruned = False
        self.pruned_at: int | None = None  # the global step at which the trial was pruned
        self._training = False
        self._metrics: dict[str, Any] = {}

    def attach(self, engine: Any) -> None:
        self.on(engine, Event.TRAIN_START, self.train_start, priority=Priority.FIRST)
        self.on(engine, Event.TRAIN_END, self.train_end, priority=Priority.LAST)
        self.on(engine, Event.EVAL_END, self.eval_end)

    def train_start(self, ev: Any) -> None:
        self._training, self._metrics = True, {}

    def train_end(self, ev: Any) -> None:
        self._training = False

    def eval_end(self, ev: EvalEndEvent) -> None:
        if not self._training:
            return
        prefixes = eval_prefixes(ev.engine.eval_data)
        if ev.prefix not in prefixes:
            return  # an evaluation on other data (a callback's), not the Trainer's eval set
        self._metrics.update(ev.metrics)
        if ev.prefix != prefixes[-1]:
            return  # more named eval sets of this evaluation to come
        metrics, self._metrics = self._metrics, {}
        self.objective = self.compute_objective(dict(metrics))
        if not self.report:
            return
        step = ev.engine.state.global_step
        self.trial.report(number(self.objective, "compute_objective"), step)
        if self.trial.should_prune():
            self.pruned, self.pruned_at = True, step
            ev.engine.control.should_training_stop = True


def number(value: Any, what: str) -> float:
    """``value`` as a float, or a ConfigError saying that ``what`` must return a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must return a number, got {value!r:.80}") from None
