"""EvalCollector: evaluation and prediction results as HF users know them (the types are in predictions.py).

The engine runs the eval loop (``Engine.evaluate`` / ``predict``: inference mode, eval mode and
back); ``EvalCollector`` listens to it. Per batch it adds the loss to a sum that stays on the
device and keeps the logits / labels (optionally inputs) as they are; every
``eval_accumulation_steps`` batches it moves what it holds to the CPU. At the end it pads the
ragged batches with -100 into one array, gathers across processes, calls ``compute_metrics``
and fills ``{prefix}_loss``, ``{prefix}_runtime``, ``{prefix}_samples_per_second``,
``{prefix}_steps_per_second`` and the prefixed metrics. One host sync per evaluation, none per batch.

Two HF options change that: ``batch_eval_metrics`` calls ``compute_metrics(EvalPrediction,
compute_result=...)`` on every batch's device tensors instead (only the last call, with
``compute_result=True``, returns the metrics; evaluation keeps no predictions), and
``concat_batches=False`` (HF ``eval_do_concat_batches``) keeps the predictions as a list of
per-batch arrays instead of one padded array.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import numpy as np
import torch

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
from trainbus.engine.errors import check_flag, check_positive_int
from trainbus.hooks import batch_size_of

from .eval_pass import EvalPass, inputs_of, takes_compute_result
from .predictions import (
    EvalLoopOutput,
    EvalPrediction,
    MetricsFn,
    PredictionOutput,
    PreprocessFn,
    batch_rows,
    hf_prediction_step,
    loader_rows,
    metric_number,
    prefix_metrics,
)
from .tensors import (
    ShardLayout,
    gather_padded,
    nested_concat,
    nested_pad_concat,
    pad_concat,
    select_rows,
    to_host,
    to_numpy,
    world_size,
)

__all__ = [
    "EvalCollector",
    "EvalLoopOutput",
    "EvalPrediction",
    "PredictionOutput",
    "hf_prediction_step",
    "metric_number",
    "nested_concat",
    "pad_concat",
    "prefix_metrics",
]


class EvalCollector(Plugin):
    """Collects losses, predictions and labels over the eval / predict loop and computes the metrics.

    Args:
        compute_metrics: ``fn(EvalPrediction) -> dict`` of numbers; keys get the ``{prefix}_`` prefix.
        preprocess_logits_for_metrics: ``fn(logits, labels) -> logits`` applied per batch, on the device.
        eval_accumulation_steps: move what is collected to the CPU every n batches (None: at the end).
        prediction_loss_only: keep only the loss (no predictions, no compute_metrics).
        include_inputs: pass the inputs (``batch[input_name]`` / ``batch[0]``) to compute_metrics.
        include_losses: pass the per-sample batch losses to compute_metrics (HF ``include_for_metrics=["loss"]``).
        input_name: key of the inputs in dict batches.
        padding_index: fill value of ragged dimensions.
        batch_eval_metrics: call ``compute_metrics(EvalPrediction, compute_result=bool)`` per batch
            with that batch's device tensors (its ``inputs`` is the whole batch, as in HF); the last
            batch's call gets ``compute_result=True`` and returns the metrics. Evaluation then keeps
            no predictions (``predict`` still does).
        concat_batches: False keeps predictions / labels / inputs / losses as lists of per-batch
            arrays (HF ``eval_do_concat_batches=False``), for batches whose shapes do not pad together.

    ``engine.evaluate()`` returns the metrics; ``engine.predict(data)`` returns a ``PredictionOutput``
    with ``test_`` metrics. ``last`` holds the ``EvalLoopOutput`` of the latest pass.

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(2, 3)
        >>> data = [(torch.randn(4, 2), torch.tensor([0, 1, 2, 0])), (torch.randn(3, 2), torch.tensor([1, 1, 2]))]
        >>> acc = lambda p: {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}
        >>> engine = Engine(model, loss_fn=torch.nn.CrossEntropyLoss(), plugins=[EvalCollector(acc)])
        >>> sorted(engine.evaluate(data))[:2]
        ['eval_accuracy', 'eval_loss']
        >>> engine.predict(data).predictions.shape
        (7, 3)
    """

    priority = Priority.PRODUCER
    #: the metrics it fills at EVAL_END / PREDICT_END run before every handler reading them (TrainLogger's)
    writes: ClassVar[Mapping[str, str]] = {"eval_end": "metrics", "predict_end": "metrics"}

    def __init__(
        self,
        compute_metrics: MetricsFn | None = None,
        preprocess_logits_for_metrics: PreprocessFn | None = None,
        eval_accumulation_steps: int | None = None,
        prediction_loss_only: bool = False,
        include_inputs: bool = False,
        include_losses: bool = False,
        input_name: str = "input_ids",
        padding_index: int = -100,
        batch_eval_metrics: bool = False,
        concat_batches: bool = True,
    ) -> None:
        for name, fn in (
            ("compute_metrics", compute_metrics),
            ("preprocess_logits_for_metrics", preprocess_logits_for_metrics),
        ):
            if fn is not None and not callable(fn):
                raise ConfigError(f"{name} must be a function or None, got {type(fn).__name__}")
        check_positive_int("eval_accumulation_steps", eval_accumulation_steps, allow_none=True)
        if batch_eval_metrics and compute_metrics is not None and not takes_compute_result(compute_metrics):
            raise ConfigError(
                "batch_eval_metrics=True calls compute_metrics(eval_prediction, compute_result=...) on every batch; "
                f"{getattr(compute_metrics, '__name__', compute_metrics)!r} takes no compute_result argument: add "
                "one (True after the last batch: return the metrics then) or set batch_eval_metrics=False"
            )
        for flag, value in (("prediction_loss_only", prediction_loss_only), ("include_inputs", include_inputs),
                            ("include_losses", include_losses), ("batch_eval_metrics", batch_eval_metrics),
                            ("concat_batches", concat_batches)):  # fmt: skip
            check_flag(flag, value)
        self.batch_eval_metrics = batch_eval_metrics
        self.concat_batches = concat_batches
        self.compute_metrics = compute_metrics
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.eval_accumulation_steps = eval_accumulation_steps
        self.prediction_loss_only = prediction_loss_only
        self.include_inputs = include_inputs
        self.include_losses = include_losses
        self.input_name = input_name
        self.padding_index = padding_index
        self.last: EvalLoopOutput | None = None
        self._pass: EvalPass | None = None

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.EVAL_START, self.eval_start)
        self.on(engine, Event.EVAL_BATCH_END, self.eval_batch_end)
        self.on(engine, Event.EVAL_END, self.eval_end)
        self.on(engine, Event.PREDICT_START, self.predict_start)
        self.on(engine, Event.PREDICT_BATCH_END, self.predict_batch_end)
        self.on(engine, Event.PREDICT_END, self.predict_end)
        self.wrap_hook(engine, "prediction_step", self._trim_padding)

    # -- handlers ----------------------------------------------------------------------------------
    def eval_start(self, ev: EvalStartEvent) -> None:
        self._start(ev.dataloader, ev.prefix)

    def eval_batch_end(self, ev: EvalBatchEndEvent) -> None:
        self._collect(ev.batch, ev.loss, ev.logits, ev.labels)

    def eval_end(self, ev: EvalEndEvent) -> None:
        if ev.reported:  # the evaluation's own loops took their results (finish_pass); nothing is left to add
            self._pass = None
            return
        ev.metrics.update(self._finish(ev.engine).metrics)

    # -- a loop inside an open evaluation (a Trainer subclass's evaluate() calling evaluation_loop) --------
    def start_pass(self, dataloader: Any, prefix: str) -> None:
        """Collect the batches that follow (EVAL_BATCH_END) as one loop with metric prefix ``prefix``."""
        self._start(dataloader, prefix)

    def finish_pass(self, engine: Engine) -> EvalLoopOutput:
        """That loop's predictions, labels and ``{prefix}_*`` metrics, without waiting for EVAL_END."""
        return self._finish(engine)

    def predict_start(self, ev: PredictStartEvent) -> None:
        self._start(ev.dataloader, "test", keep_outputs=True)

    def predict_batch_end(self, ev: PredictBatchEndEvent) -> None:
        self._collect(ev.batch, ev.loss, ev.logits, ev.labels)

    def predict_end(self, ev: PredictEndEvent) -> None:
        out = self._finish(ev.engine)
        ev.metrics.update(out.metrics)
        ev.output = PredictionOutput(out.predictions, out.label_ids, ev.metrics)

    # -- the pass ----------------------------------------------------------------------------------
    def _start(self, dataloader: Any, prefix: str, keep_outputs: bool = False) -> None:
        if data_length(dataloader) == 0:
            raise ConfigError(f"the {prefix!r} dataset is empty (length 0): evaluation needs at least one batch")
        keep = keep_outputs or not (self.batch_eval_metrics and self.compute_metrics is not None)
        layout, rows = ShardLayout.of(dataloader), loader_rows(dataloader)
        self._pass = EvalPass(prefix, time.perf_counter(), layout, keep_outputs=keep, rows=rows)

    def _trim_padding(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap ``prediction_step`` to run only the real samples of a batch padded by a DistributedSampler.

        A batch mean loss over repeated samples cannot be undone afterwards, so they are cut before
        the forward pass. A batch with no real sample still runs (collectives stay in step) and
        its outputs are cut to zero rows.
        """

        def prediction_step(model: torch.nn.Module, batch: Any, *args: Any) -> tuple[Any, Any, Any]:
            run = self._pass
            if run is None or run.layout is None:
                return inner(model, batch, *args)  # type: ignore[no-any-return]
            size = batch_size_of(batch)
            keep = run.layout.real_count(run.samples, size)
            if keep == size:
                return inner(model, batch, *args)  # type: ignore[no-any-return]
            if keep == 0:
                loss, logits, labels = inner(model, batch, *args)
                return loss, select_rows(logits, slice(0, 0)), select_rows(labels, slice(0, 0))
            return inner(model, select_rows(batch, slice(0, keep)), *args)  # type: ignore[no-any-return]

        return prediction_step

    def _collect(self, batch: Any, loss: Any, logits: Any, labels: Any) -> None:
        run = self._pass
        assert run is not None, "EVAL_BATCH_END without EVAL_START"
        size = batch_size_of(batch)  # the batch as the loader gave it (before any trimming)
        if size == 0:
            size = batch_size_of(labels if labels is not None else logits)
        real = size if run.layout is None else run.layout.real_count(run.samples, size)
        distributed = world_size() > 1
        parts: dict[str, Any] = {}
        if loss is not None:
            loss = loss.detach()
            loss = loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss
            if distributed or self.include_losses:
                parts["losses"] = loss.reshape(()).expand(real)  # HF: loss.repeat(batch_size)
            if not distributed:  # mean losses weighted by the rows they stand for = the loss of the whole set (HF)
                rows = batch_rows(*run.rows, run.loss_count, size)
                run.loss_sum = loss * rows if run.loss_sum is None else run.loss_sum + loss * rows
                run.loss_count += rows
        if not self.prediction_loss_only:
            if logits is not None and self.preprocess_logits_for_metrics is not None:
                logits = self.preprocess_logits_for_metrics(logits, labels)
            parts["predictions"] = logits
            parts["label_ids"] = labels
            if self.include_inputs:
                parts["inputs"] = inputs_of(batch, self.input_name)
        parts = {k: v for k, v in parts.items() if v is not None}
        if run.layout is not None:
            parts = select_rows(parts, slice(0, real))  # no-op when prediction_step already trimmed
        positions = None
        if distributed:
            parts = gather_padded(parts, self.padding_index)
            if run.layout is not None:
                positions = run.layout.gathered_positions(run.samples, size)
                run.positions.append(positions)
        if self.batch_eval_metrics and self.compute_metrics is not None:
            self._batch_metrics(run, batch, parts, positions)
            if not run.keep_outputs:
                parts = {k: v for k, v in parts.items() if k == "losses"}  # the loss still needs them
        for name, value in parts.items():
            run.device.setdefault(name, []).append(value)
        run.batches += 1
        run.samples += size
        if self.eval_accumulation_steps and run.batches % self.eval_accumulation_steps == 0:
            self._move_to_host(run)

    def _batch_metrics(self, run: EvalPass, batch: Any, parts: dict[str, Any], positions: torch.Tensor | None) -> None:
        """Pass the previous batch to compute_metrics and hold this one (the last gets compute_result=True)."""
        predictions, label_ids = parts.get("predictions"), parts.get("label_ids")
        if predictions is None or label_ids is None:
            return
        losses = parts.get("losses") if self.include_losses else None
        if positions is not None:  # drop the rows a DistributedSampler repeated and the gather's padding
            real = torch.nonzero(positions < run.layout.dataset_size).reshape(-1)  # type: ignore[union-attr]
            predictions, label_ids, losses = select_rows((predictions, label_ids, losses), real)
        prediction = EvalPrediction(predictions, label_ids, batch if self.include_inputs else None, losses)
        if run.pending is not None:
            self._compute_metrics(run.pending, False)
        run.pending = prediction

    def _compute_metrics(self, prediction: EvalPrediction, compute_result: bool) -> Any:
        metrics_fn: Callable[..., Any] = self.compute_metrics  # type: ignore[assignment]
        return metrics_fn(prediction, compute_result=compute_result)

    def _move_to_host(self, run: EvalPass) -> None:
        for name, chunks in run.device.items():
            if not chunks:
                continue
            if self.concat_batches:
                run.host.setdefault(name, []).append(to_host(nested_pad_concat(chunks, self.padding_index)))
            else:
                run.host.setdefault(name, []).extend(to_host(chunk) for chunk in chunks)
        run.device = {}

    def _finish(self, engine: Engine) -> EvalLoopOutput:
        run = self._pass
        assert run is not None, "EVAL_END without EVAL_START"
        self._pass = None
        if run.batches == 0:
            raise ConfigError(f"the {run.prefix!r} dataset yielded no batches: evaluation needs at least one")
        self._move_to_host(run)
        arrays: dict[str, Any]
        if self.concat_batches:
            arrays = {name: nested_pad_concat(chunks, self.padding_index) for name, chunks in run.host.items()}
        else:
            arrays = {name: list(chunks) for name, chunks in run.host.items()}
        num_samples = run.samples * world_size()
        if run.positions:  # drop the sampler's repeated samples and restore the dataset order
            arrays, num_samples = self._dataset_order(arrays, run)
        arrays = to_numpy(arrays)
        prefix = run.prefix
        metrics: dict[str, Any] = {}
        if run.loss_sum is not None:
            metrics[f"{prefix}_loss"] = float((run.loss_sum / run.loss_count).item())  # the pass's one host sync
        elif "losses" in arrays:  # distributed: per-sample losses, padding duplicates dropped
            losses = arrays["losses"]
            metrics[f"{prefix}_loss"] = float(np.mean(losses if self.concat_batches else np.concatenate(losses)))
        predictions, label_ids = arrays.get("predictions"), arrays.get("label_ids")
        if run.pending is not None:  # batch_eval_metrics: the last batch's call returns the metrics
            metrics.update(prefix_metrics(self._compute_metrics(run.pending, True), prefix))
        elif self.compute_metrics is not None and predictions is not None and label_ids is not None:
            prediction = EvalPrediction(
                predictions,
                label_ids,
                arrays.get("inputs") if self.include_inputs else None,
                arrays.get("losses") if self.include_losses else None,
            )
            metrics.update(prefix_metrics(self.compute_metrics(prediction), prefix))
        runtime = time.perf_counter() - run.started
        metrics[f"{prefix}_runtime"] = round(runtime, 4)
        metrics[f"{prefix}_samples_per_second"] = round(num_samples / runtime, 3) if runtime > 0 else math.inf
        metrics[f"{prefix}_steps_per_second"] = round(run.batches / runtime, 3) if runtime > 0 else math.inf
        self.last = EvalLoopOutput(predictions, label_ids, metrics, num_samples)
        return self.last

    def _dataset_order(self, arrays: dict[str, Any], run: EvalPass) -> tuple[dict[str, Any], int]:
        """The gathered rows without padding duplicates, in data-set order; and how many there are.

        Per-batch lists (``concat_batches=False``) are ordered within each batch: a gathered batch
        holds a contiguous range of data-set positions, so the batches stay in order.
        """
        size = run.layout.dataset_size  # type: ignore[union-attr]

        def order(positions: torch.Tensor) -> torch.Tensor:
            real = torch.nonzero(positions < size).reshape(-1)
            return real[torch.argsort(positions[real])]

        if self.concat_batches:
            rows = order(torch.cat(run.positions))
            return {name: select_rows(value, rows) for name, value in arrays.items()}, int(rows.numel())
        orders = [order(positions) for positions in run.positions]
        ordered = {
            name: [select_rows(chunk, rows) for chunk, rows in zip(chunks, orders, strict=True)]
            for name, chunks in arrays.items()
        }
        return ordered, sum(int(rows.numel()) for rows in orders)
