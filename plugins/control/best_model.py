"""Tracking the best evaluation: ``BestMetric`` and the helpers that name and compare metrics.

HF rules kept: ``metric_for_best_model="loss"`` means ``eval_loss``; with a dict of eval sets the
name includes the set (``"valid_loss"`` -> ``eval_valid_loss``) and only that set decides;
``greater_is_better`` defaults from the name (loss-like names are better when lower). Added: a
NaN is never the best, and a missing metric is an error that lists the keys there are.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from trainbus.engine import ConfigError, Engine, EvalEndEvent, Event, Plugin, Priority
from trainbus.engine.errors import ConfigKeyError, check_flag, suggest

__all__ = [
    "BestMetric",
    "MetricWatch",
    "check_metric_key",
    "eval_prefixes",
    "expected_keys",
    "greater_is_better_for",
    "is_improvement",
    "resolve_metric_key",
]

#: last name parts of metrics that are better when lower
LOWER_IS_BETTER = frozenset(
    {"loss", "error", "err", "perplexity", "ppl", "mse", "mae", "rmse", "wer", "cer", "runtime"}
)


def resolve_metric_key(name: str, prefix: str = "eval") -> str:
    """The metrics key for ``name``: ``"loss"`` -> ``"eval_loss"``; names already prefixed stay."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"metric name must be a non-empty string, got {name!r}")
    return name if name.startswith(f"{prefix}_") else f"{prefix}_{name}"


def greater_is_better_for(name: str) -> bool:
    """False for loss-like names (``*loss``, ``*_error``, ``*_perplexity``, ``*_wer``, ...), else True."""
    lowered = name.lower()
    return not (lowered.endswith("loss") or lowered.rsplit("_", 1)[-1] in LOWER_IS_BETTER)


def is_improvement(value: float, best: float | None, greater_is_better: bool, threshold: float = 0.0) -> bool:
    """Whether ``value`` beats ``best`` by more than ``threshold``. Ties never do; NaN never does."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return False
    if best is None or math.isnan(best):
        return True
    gain = value - best if greater_is_better else best - value
    return gain > threshold


def eval_prefixes(eval_data: Any, prefix: str = "eval") -> list[str]:
    """The metric prefixes ``Engine.evaluate(eval_data)`` uses: ``eval`` or ``eval_{name}`` per named set."""
    if isinstance(eval_data, Mapping):
        return [f"{prefix}_{name}" for name in eval_data]
    return [prefix]


def expected_keys(
    eval_data: Any, metric_names: Iterable[str] = (), *, prefix: str = "eval", with_loss: bool = True
) -> list[str]:
    """The metric keys an evaluation will produce, for validating ``metric_for_best_model`` up front.

    ``metric_names`` are the unprefixed names compute_metrics / IgniteMetrics give (e.g. "accuracy").
    """
    names = (["loss"] if with_loss else []) + ["runtime", "samples_per_second", "steps_per_second", *metric_names]
    # the prefixing rule of EvalCollector: names already carrying the prefix keep it
    return [n if n.startswith(f"{p}_") else f"{p}_{n}" for p in eval_prefixes(eval_data, prefix) for n in names]


def check_metric_key(name: str, available: Iterable[str], prefix: str = "eval") -> str:
    """Resolve ``name`` and check it is among ``available`` keys; the error lists them."""
    key = resolve_metric_key(name, prefix)
    keys = sorted(available)
    if key not in keys:
        raise ConfigKeyError(
            f"metric_for_best_model {name!r} (key {key!r}) is not among the evaluation metrics"
            f"{suggest(key, keys)}; available keys: {', '.join(keys) or '(none)'}"
        )
    return key


class MetricWatch:
    """Finds one metric in EVAL_END payloads, also when several named eval sets report separately.

    An EVAL_END whose prefix owns the key must contain it (else a ConfigError listing the keys);
    EVAL_ENDs of other named sets are ignored. Only evaluations inside ``fit`` count, as in HF.
    """

    def __init__(self, metric: str, greater_is_better: bool | None = None) -> None:
        self.key = resolve_metric_key(metric)
        check_flag("greater_is_better", greater_is_better, allow_none=True)
        self.greater_is_better = greater_is_better_for(self.key) if greater_is_better is None else greater_is_better
        self.training = False

    def attach(self, plugin: Plugin, engine: Engine) -> None:
        plugin.on(engine, Event.TRAIN_START, self._train_start, priority=Priority.FIRST)
        plugin.on(engine, Event.TRAIN_END, self._train_end, priority=Priority.LAST)

    def _train_start(self, ev: Any) -> None:
        self.training = True

    def _train_end(self, ev: Any) -> None:
        self.training = False

    def value(self, ev: EvalEndEvent) -> float | None:
        """The watched metric of this EVAL_END as a float, or None when it belongs to another set."""
        if not self.training:
            return None
        key = self.key
        if key in ev.metrics:
            value = ev.metrics[key]
            try:
                return float(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"metric {key!r} is {value!r:.80}, not a number; pick a numeric metric") from exc
        owner = self._owner(ev)
        if owner is None or owner == ev.prefix:
            sets = eval_prefixes(ev.engine.eval_data)
            raise ConfigKeyError(
                f"metric {key!r} is not among the evaluation metrics{suggest(key, ev.metrics)}; "
                f"keys of the {ev.prefix!r} evaluation: {', '.join(sorted(ev.metrics))}"
                + (f"; eval sets: {', '.join(sets)}" if len(sets) > 1 else "")
            )
        return None

    def _owner(self, ev: EvalEndEvent) -> str | None:
        """The longest known eval prefix the key starts with (this event's or a named set's)."""
        candidates = (
            {ev.prefix, *eval_prefixes(ev.engine.eval_data)} if ev.engine.eval_data is not None else {ev.prefix}
        )
        owners = [p for p in candidates if self.key.startswith(f"{p}_")]
        return max(owners, key=len) if owners else None


class MetricPlugin(Plugin):
    """Base of the plugins that act on one eval metric at EVAL_END (best tracking, early stopping).

    Subclasses set ``self.watch`` and implement ``observe(value, ev)``, called when an
    evaluation produced the watched metric.
    """

    watch: MetricWatch

    @property
    def key(self) -> str:
        return self.watch.key

    @property
    def greater_is_better(self) -> bool:
        return self.watch.greater_is_better

    def attach(self, engine: Engine) -> None:
        self.watch.attach(self, engine)
        self.on(engine, Event.EVAL_END, self.eval_end)

    def eval_end(self, ev: EvalEndEvent) -> None:
        value = self.watch.value(ev)
        if value is not None:
            self.observe(value, ev)

    def observe(self, value: float, ev: EvalEndEvent) -> None:
        raise NotImplementedError


class BestMetric(MetricPlugin):
    """Keeps ``state.best_metric`` and ``state.best_global_step`` (HF ``metric_for_best_model``).

    Runs at EVAL_END after the metric producers, before sinks and early stopping read the state.
    ``improved`` tells whether the latest evaluation set a new best; with ``save_on_best`` it also
    sets ``control.should_save`` then (HF ``save_strategy="best"``).

    Args:
        metric_for_best_model: e.g. "loss", "accuracy", "eval_valid_f1" (prefix added when missing).
        greater_is_better: None infers it from the name (loss-like names are lower-is-better).
        save_on_best: request a checkpoint when a new best is reached.

    Example:
        >>> BestMetric("valid_loss").key, BestMetric("valid_loss").greater_is_better
        ('eval_valid_loss', False)
    """

    priority = Priority.CONSUMER.before("*")  # the best metric is kept before the consumers read it

    def __init__(
        self, metric_for_best_model: str = "loss", greater_is_better: bool | None = None, save_on_best: bool = False
    ) -> None:
        self.watch = MetricWatch(metric_for_best_model, greater_is_better)
        check_flag("save_on_best", save_on_best)
        self.save_on_best = save_on_best
        self.improved = False

    def observe(self, value: float, ev: EvalEndEvent) -> None:
        state = ev.engine.state
        self.improved = is_improvement(value, state.best_metric, self.greater_is_better)
        if self.improved:
            state.best_metric = value
            state.best_global_step = state.global_step
            if self.save_on_best:
                ev.engine.control.should_save = True
