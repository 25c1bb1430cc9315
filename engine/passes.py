"""The passes without training: ``evaluate()`` and ``predict()`` (mixed into ``Engine``).

Each runs the model in eval mode under ``torch.inference_mode`` through the ``prediction_step`` hook
and fires START, a BATCH_END per batch, and END, whose payload carries the result (the metrics that
EVAL_END handlers fill, the output a PREDICT_END handler sets). Like fit, each closes on failure:
EXCEPTION, then its END with ``payload.error`` (``lifecycle.py``). The engine computes no metric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from trainbus.hooks import Hooks

from .errors import ConfigError, ConfigTypeError
from .events import (
    EvalBatchEndEvent,
    EvalEndEvent,
    EvalStartEvent,
    Event,
    EventType,
    P,
    PredictBatchEndEvent,
    PredictEndEvent,
    PredictStartEvent,
)
from .inputs import check_data
from .lifecycle import Lifecycle

if TYPE_CHECKING:
    from .view import EngineView


class Passes(Lifecycle):
    """evaluate() and predict() (mixed into ``Engine``, which provides the attributes below)."""

    hooks: Hooks
    model: torch.nn.Module
    eval_data: Iterable[Any] | Mapping[str, Iterable[Any]] | None
    label_names: tuple[str, ...]

    @property
    def device(self) -> torch.device:
        raise NotImplementedError  # Engine's property

    def _fire(self, event: EventType[P], make: Callable[[], P]) -> P | None:
        raise NotImplementedError  # Engine's

    def evaluate(self, data: Any = None, *, prefix: str = "eval") -> dict[str, Any]:
        """Run the eval loop; returns the metrics that EVAL_END handlers put in the payload.

        ``data`` (default ``eval_data``) may be a dict of named sets: each runs with prefix
        ``{prefix}_{name}`` and the results are merged.
        """
        name = "eval_data" if data is None else "evaluate()'s data"
        data = self.eval_data if data is None else data
        if data is None:
            raise ConfigError("evaluate() needs data: pass eval_data to the Engine or data to evaluate()")
        check_data(name, data, named=True)
        if not isinstance(prefix, str):
            raise ConfigTypeError(f"evaluate()'s prefix must be a str (metric names start with it), got {prefix!r:.80}")
        if isinstance(data, Mapping):
            metrics: dict[str, Any] = {}
            for name, subset in data.items():
                metrics.update(self._evaluate_one(subset, f"{prefix}_{name}"))
            return metrics
        return self._evaluate_one(data, prefix)

    def _evaluate_one(self, data: Iterable[Any], prefix: str) -> dict[str, Any]:
        engine = cast("EngineView", self)
        hooks, model = self.hooks, self.model
        data = hooks.eval_data(data)
        was_training = model.training
        model.eval()
        depth = self._open(Event.EVAL_END, lambda: EvalEndEvent(engine, {}, prefix))
        try:
            self._fire(Event.EVAL_START, lambda: EvalStartEvent(engine, data, prefix))
            with torch.inference_mode():
                for batch in data:
                    batch = hooks.to_device(batch, self.device)
                    loss, logits, labels = hooks.prediction_step(
                        model, batch, hooks.forward, hooks.compute_loss, self.label_names
                    )
                    self._fire(
                        Event.EVAL_BATCH_END, lambda: EvalBatchEndEvent(engine, batch, loss, logits, labels, prefix)
                    )
            end: EvalEndEvent = self._close(depth)
        except BaseException as error:
            self._fail(error, depth, "evaluate")
            raise
        finally:
            model.train(was_training)
        return end.metrics

    def predict(self, data: Iterable[Any]) -> Any:
        """Run the prediction loop; returns what PREDICT_END handlers put in ``payload.output``."""
        check_data("predict()'s data", data)
        engine = cast("EngineView", self)
        hooks, model = self.hooks, self.model
        data = hooks.eval_data(data)
        was_training = model.training
        model.eval()
        depth = self._open(Event.PREDICT_END, lambda: PredictEndEvent(engine))
        try:
            self._fire(Event.PREDICT_START, lambda: PredictStartEvent(engine, data))
            with torch.inference_mode():
                for batch in data:
                    batch = hooks.to_device(batch, self.device)
                    loss, logits, labels = hooks.prediction_step(
                        model, batch, hooks.forward, hooks.compute_loss, self.label_names
                    )
                    self._fire(
                        Event.PREDICT_BATCH_END, lambda: PredictBatchEndEvent(engine, batch, loss, logits, labels)
                    )
            end: PredictEndEvent = self._close(depth)
        except BaseException as error:
            self._fail(error, depth, "predict")
            raise
        finally:
            model.train(was_training)
        return end.output
