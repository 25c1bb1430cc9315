"""pytorch-ignite metrics over the eval loop: ``IgniteMetrics``.

Each ignite ``Metric`` is reset at EVAL_START, updated at every EVAL_BATCH_END and computed at
EVAL_END into ``{prefix}_{name}`` (the keys ``compute_metrics`` results get, so both can feed
``metric_for_best_model``). The same runs over ``predict`` with the ``test`` prefix.

Across processes ignite reduces the metric state itself (``idist`` all-reduce in ``compute``);
this plugin makes the result exact by dropping, per batch and without communication, the samples
a ``DistributedSampler`` repeated to pad the shards (see ``eval_tensors.ShardLayout``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any, ClassVar, TypeAlias

import torch
from ignite.exceptions import NotComputableError
from ignite.metrics import Metric

from trainbus.engine import (
    ConfigError,
    Engine,
    EvalBatchEndEvent,
    EvalEndEvent,
    EvalStartEvent,
    Event,
    Plugin,
    PredictBatchEndEvent,
    PredictEndEvent,
    PredictStartEvent,
    Priority,
    data_length,
)
from trainbus.hooks import batch_size_of

from .tensors import ShardLayout, select_rows

__all__ = ["IgniteMetrics", "default_output_transform", "metric_values"]

BatchEvent: TypeAlias = EvalBatchEndEvent | PredictBatchEndEvent


def default_output_transform(ev: BatchEvent) -> tuple[Any, Any]:
    """``(y_pred, y)`` = ``(logits, labels)`` of the batch, the input most ignite metrics take."""
    if ev.labels is None:
        raise ValueError("IgniteMetrics needs labels in the eval batches (the batch had none)")
    return ev.logits, ev.labels


def metric_values(key: str, value: Any) -> dict[str, Any]:
    """Flatten what ``Metric.compute()`` returned into metric entries.

    Scalars (numbers, one-element tensors) become floats; other tensors (a confusion matrix,
    per-class precision) become nested lists; a dict result gives ``{key}_{sub}`` entries.
    """
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for sub, item in value.items():
            out.update(metric_values(f"{key}_{sub}", item))
        return out
    if isinstance(value, torch.Tensor):
        return {key: float(value.item()) if value.numel() == 1 else value.detach().cpu().tolist()}
    if isinstance(value, bool | int | float):
        return {key: float(value)}
    return {key: value}


class IgniteMetrics(Plugin):
    """Runs pytorch-ignite metrics over evaluation and prediction.

    Args:
        metrics: name -> ignite ``Metric`` (Accuracy, Precision, Recall, Fbeta, Loss,
            TopKCategoricalAccuracy, ConfusionMatrix, or any other). Each metric's own
            ``output_transform`` is applied after the plugin's.
        output_transform: ``fn(batch_event) -> output`` given to the metrics; default ``(logits, labels)``.

    Example:
        >>> import torch
        >>> from ignite.metrics import Accuracy
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(2, 3)
        >>> data = [(torch.randn(4, 2), torch.tensor([0, 1, 2, 0]))]
        >>> plugin = IgniteMetrics({"accuracy": Accuracy()})
        >>> engine = Engine(model, loss_fn=torch.nn.CrossEntropyLoss(), plugins=[plugin])
        >>> list(engine.evaluate(data))
        ['eval_accuracy']
    """

    priority = Priority.PRODUCER
    #: the metrics go into the payloads' ``metrics``: readers of it (TrainLogger) run after, in any plugin order
    writes: ClassVar[Mapping[str, str]] = {"eval_end": "metrics", "predict_end": "metrics"}

    def __init__(
        self, metrics: Mapping[str, Metric], output_transform: Callable[[BatchEvent], Any] | None = None
    ) -> None:
        if not isinstance(metrics, Mapping) or not metrics:
            raise ConfigError(f"metrics must be a non-empty dict of name -> ignite Metric, got {metrics!r:.80}")
        for name, metric in metrics.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"metric names must be non-empty strings, got {name!r}")
            if not isinstance(metric, Metric):
                raise ConfigError(
                    f"metric {name!r} is a {type(metric).__name__}, not an ignite.metrics.Metric "
                    "(e.g. ignite.metrics.Accuracy())"
                )
        if output_transform is not None and not callable(output_transform):
            raise ConfigError(f"output_transform must be a function, got {type(output_transform).__name__}")
        self.metrics = dict(metrics)
        self.output_transform = output_transform or default_output_transform
        self._layout: ShardLayout | None = None
        self._seen = 0  # local samples seen in this pass (the shard offset)

    def keys(self, prefix: str = "eval") -> list[str]:
        """The metric keys an evaluation with ``prefix`` will produce (dict-valued metrics add sub-keys)."""
        return [f"{prefix}_{name}" for name in self.metrics]

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.EVAL_START, self.start)
        self.on(engine, Event.EVAL_BATCH_END, self.update)
        self.on(engine, Event.EVAL_END, self.eval_end)
        self.on(engine, Event.PREDICT_START, self.start)
        self.on(engine, Event.PREDICT_BATCH_END, self.update)
        self.on(engine, Event.PREDICT_END, self.predict_end)

    def start(self, ev: EvalStartEvent | PredictStartEvent) -> None:
        if data_length(ev.dataloader) == 0:
            prefix = ev.prefix if isinstance(ev, EvalStartEvent) else "test"
            raise ConfigError(f"the {prefix!r} dataset is empty (length 0): metrics need at least one batch")
        for metric in self.metrics.values():
            metric.reset()
        self._layout = ShardLayout.of(ev.dataloader)
        self._seen = 0

    def update(self, ev: BatchEvent) -> None:
        size = batch_size_of(ev.batch)
        offset, self._seen = self._seen, self._seen + size
        if self._layout is not None:
            keep = self._layout.real_count(offset, size)
            if keep == 0:
                return
            if keep < size:  # the tail of the last batch repeats samples of other shards: drop it
                rows = slice(0, keep)
                ev = dataclasses.replace(
                    ev,
                    batch=select_rows(ev.batch, rows),
                    logits=select_rows(ev.logits, rows),
                    labels=select_rows(ev.labels, rows),
                )
        # ignite's own iteration_completed applies each metric's output_transform and key mapping
        carrier = SimpleNamespace(state=SimpleNamespace(output=self.output_transform(ev)))
        for metric in self.metrics.values():
            metric.iteration_completed(carrier)  # type: ignore[arg-type]

    def compute(self, prefix: str) -> dict[str, Any]:
        """``{prefix}_{name}`` -> value for every metric (collective under torch.distributed)."""
        out: dict[str, Any] = {}
        for name, metric in self.metrics.items():
            try:
                value = metric.compute()
            except NotComputableError as exc:
                raise ConfigError(f"metric {name!r} saw no samples in the {prefix!r} pass: {exc}") from exc
            out.update(metric_values(f"{prefix}_{name}", value))
        return out

    def eval_end(self, ev: EvalEndEvent) -> None:
        ev.metrics.update(self.compute(ev.prefix))

    def predict_end(self, ev: PredictEndEvent) -> None:
        ev.metrics.update(self.compute("test"))
