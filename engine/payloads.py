"""The payloads of the events: what each event carries, when it fires, what a handler may change.

One dataclass per event (``events.py`` binds them: ``Event.LOSS`` carries a ``LossEvent``). Each
docstring says when the event fires, what has and has not happened yet, and which fields a handler
may replace; ``docs/events.md`` is generated from these docstrings (``python -m trainbus.engine.testing.describe``).
Payloads are built only when the event has handlers, so they cost nothing on a step nobody watches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from .view import EngineView  # the Engine as the modules below the loop see it (view.py)


@dataclass(eq=False, slots=True)
class Payload:
    """Base of every payload: the engine that fired the event."""

    engine: EngineView


@dataclass(eq=False, slots=True)
class TrainStartEvent(Payload):
    """Fires once per ``fit()``, before the first epoch (also on a resume, so ``once=1`` filters see one per call).

    Has happened: the plan (``state.max_steps``, ``steps_per_epoch``, ``num_train_epochs``), train mode,
    a first ``zero_grad``. Not yet: any batch. Optimizer plugins create the optimizer here; eval on
    start runs right after it.
    """


@dataclass(eq=False, slots=True)
class TrainEndEvent(Payload):
    """Fires once when ``fit()`` ends: the limit reached, a stop request, or a failure.

    Attributes:
        error: None after a normal end. When the run failed, the exception (which then reaches the
            caller), and only handlers registered with ``cleanup=True`` see the event.
    """

    error: BaseException | None = None


@dataclass(eq=False, slots=True)
class EpochStartEvent(Payload):
    """Fires at the start of every epoch, before its data iterator is created.

    A handler may replace ``engine.model`` / ``engine.optimizer`` here; the loop reads them after it.
    ``control.should_epoch_stop`` was just reset. A resume mid-epoch starts with this event for the
    interrupted epoch.

    Attributes:
        epoch: 0-based index of the epoch (``state.epochs_completed``).
    """

    epoch: int


@dataclass(eq=False, slots=True)
class EpochEndEvent(Payload):
    """Fires at the end of every epoch, before the epoch's side effects (LOG / EVAL / SAVE).

    Has happened: ``state.epochs_completed`` advanced when the epoch's data ran out (not when a
    stop request ended it early).

    Attributes:
        epoch: 0-based index of the epoch that ends.
        error: set when the run failed inside this epoch (then only cleanup handlers see it).
    """

    epoch: int
    error: BaseException | None = None


@dataclass(eq=False, slots=True)
class StepStartEvent(Payload):
    """Fires once per optimizer step (window), before its first micro-batch.

    ``engine.step_outputs`` was just cleared; ``state.global_step`` is still the previous step's.

    Attributes:
        batches: the window's micro-batches as the data loader gave them (fetched up front, so a
            plugin can count the window's items before the first backward).
    """

    batches: tuple[Any, ...]


@dataclass(eq=False, slots=True)
class BatchStartEvent(Payload):
    """Fires per micro-batch, before it moves to the device and the forward runs.

    Attributes:
        batch: the micro-batch; a handler may replace it (the loop uses ``payload.batch`` after).
        micro_index: its position in the window, 0-based.
        window_size: micro-batches in this window (the last window of an epoch may be shorter).
    """

    batch: Any
    micro_index: int
    window_size: int


@dataclass(eq=False, slots=True)
class LossEvent(Payload):
    """Fires per micro-batch after forward and ``compute_loss``, before backward.

    Attributes:
        batch: the micro-batch after ``to_device``.
        outputs: the model's outputs (dropped right after backward).
        loss: the scalar loss tensor; a handler may replace it (accumulation scales it here), and
            backward runs on ``payload.loss``.
        micro_index: position in the window, 0-based.
        window_size: micro-batches in this window.
    """

    batch: Any
    outputs: Any
    loss: torch.Tensor
    micro_index: int
    window_size: int


@dataclass(eq=False, slots=True)
class BackwardEndEvent(Payload):
    """Fires per micro-batch after backward: its gradients are accumulated (HF ``on_substep_end``).

    Attributes:
        loss: the loss backward ran on (as LOSS handlers left it).
        micro_index: position in the window, 0-based.
        window_size: micro-batches in this window.
    """

    loss: torch.Tensor
    micro_index: int
    window_size: int


@dataclass(eq=False, slots=True)
class BeforeOptimizerStepEvent(Payload):
    """Fires once per window after the last backward, before the optimizer step.

    The gradients are complete (AMP plugins unscale them first): clipping and NaN checks go here.
    Not yet: the step, and ``state.global_step`` still counts the steps before this one.

    Under a step function (``Engine(..., step=fn)``) it fires at every ``engine.step_optimizer(name, loss)``,
    after that loss's backward, once per optimizer the function steps. ``payload.optimizer`` is the name of the
    optimizer about to step (``Engine(model, {"d": ..., "g": ...})``), None for the loop's own step of
    ``engine.optimizer``; plugins given ``optimizer="g"`` act on theirs only. It is a class attribute here, a
    field of ``NamedBeforeOptimizerStepEvent`` (what ``step_optimizer`` fires), so the loop's own payload costs
    nothing more per step.

    Attributes:
        skip: a handler sets True to veto this optimizer step (the window still counts as a step).
    """

    skip: bool = False
    optimizer: ClassVar[str | None] = None


@dataclass(eq=False, slots=True)
class OptimizerStepEvent(Payload):
    """Fires only when the optimizer really stepped (not vetoed, no AMP overflow); schedulers step here.

    ``state.optimizer_steps_taken`` already counts it; ``state.global_step`` does not yet. Under a step
    function it fires once per optimizer that stepped, and ``optimizer_steps_taken`` counts the window once, at
    its first. ``payload.optimizer`` names the optimizer that stepped, None for the loop's own step of
    ``engine.optimizer`` (a class attribute here, a field of ``NamedOptimizerStepEvent``, what
    ``step_optimizer`` fires).
    """

    optimizer: ClassVar[str | None] = None


@dataclass(eq=False, slots=True)
class NamedBeforeOptimizerStepEvent(BeforeOptimizerStepEvent):
    """BEFORE_OPTIMIZER_STEP as ``engine.step_optimizer(name, loss)`` fires it: ``optimizer`` names the optimizer."""

    optimizer: str | None = None  # type: ignore[misc]  # the base's class attribute, a field here


@dataclass(eq=False, slots=True)
class NamedOptimizerStepEvent(OptimizerStepEvent):
    """OPTIMIZER_STEP as ``engine.step_optimizer(name, loss)`` fires it: ``optimizer`` names the optimizer."""

    optimizer: str | None = None  # type: ignore[misc]  # the base's class attribute, a field here


@dataclass(eq=False, slots=True)
class StepEndEvent(Payload):
    """Fires once per window after the step and ``zero_grad``: ``state.global_step`` has advanced.

    Flow plugins set ``control.should_log / should_evaluate / should_save`` here; the loop acts on
    them right after, in that order.

    Attributes:
        stepped: False when the optimizer step was vetoed or skipped.
    """

    stepped: bool


@dataclass(eq=False, slots=True)
class LogEvent(Payload):
    """Fires at a logging point (a side effect) and for every ``engine.log(...)``.

    Attributes:
        logs: the record, mutable: producers (priority PRODUCER) add values, sinks write them.
        window: True when the loop fired it at a logging point; False for ``engine.log(...)``.
    """

    logs: dict[str, float]
    window: bool


@dataclass(eq=False, slots=True)
class EvalStartEvent(Payload):
    """Fires when an evaluation starts: the model is in eval mode (restored afterwards).

    Attributes:
        dataloader: the eval batches (after the ``eval_data`` hook).
        prefix: the metric key prefix, "eval" or ``f"eval_{name}"`` for a dict of eval sets.
    """

    dataloader: Any
    prefix: str


@dataclass(eq=False, slots=True)
class EvalBatchEndEvent(Payload):
    """Fires per eval batch after ``prediction_step``, under ``torch.inference_mode``.

    Attributes:
        batch: the batch after ``to_device``.
        loss: the batch's loss, or None (no labels).
        logits: a tensor or a tuple of them, or None (prediction_loss_only).
        labels: a tensor or a tuple of them, or None.
        prefix: as at EVAL_START.
    """

    batch: Any
    loss: torch.Tensor | None
    logits: Any
    labels: Any
    prefix: str


@dataclass(eq=False, slots=True)
class EvalEndEvent(Payload):
    """Fires when an evaluation ends (also when it failed: then to cleanup handlers only).

    Attributes:
        metrics: mutable: metric plugins fill it and ``evaluate()`` returns it.
        prefix: as at EVAL_START.
        error: set when the pass failed (the metrics are then incomplete).
        reported: True when the evaluation's own code already logged the metrics and told the HF
            callbacks (a Trainer subclass's ``evaluate()``): loggers and reporters leave them alone;
            handlers that decide on them (best metric, early stopping, schedules) act as always.
    """

    metrics: dict[str, Any]
    prefix: str
    error: BaseException | None = None
    reported: bool = False


@dataclass(eq=False, slots=True)
class SaveEvent(Payload):
    """Fires when a checkpoint is due: the last side effect after a step or an epoch (after LOG and EVAL)."""


@dataclass(eq=False, slots=True)
class PredictStartEvent(Payload):
    """Fires when ``predict()`` starts (predict fires PREDICT_*, never EVAL_*).

    Attributes:
        dataloader: the batches to predict (after the ``eval_data`` hook).
    """

    dataloader: Any


@dataclass(eq=False, slots=True)
class PredictBatchEndEvent(Payload):
    """Fires per predict batch after ``prediction_step``, under ``torch.inference_mode``.

    Attributes:
        batch: the batch after ``to_device``.
        loss: the batch's loss, or None (no labels).
        logits: a tensor or a tuple of them, or None.
        labels: a tensor or a tuple of them, or None.
    """

    batch: Any
    loss: torch.Tensor | None
    logits: Any
    labels: Any


@dataclass(eq=False, slots=True)
class PredictEndEvent(Payload):
    """Fires when ``predict()`` ends (also when it failed: then to cleanup handlers only).

    Attributes:
        output: set by a collecting plugin; ``predict()`` returns it.
        metrics: metrics computed over the predictions, if a plugin computes any.
        error: set when the pass failed.
    """

    output: Any = None
    metrics: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None


@dataclass(eq=False, slots=True)
class ExceptionEvent(Payload):
    """Fires once when fit / evaluate / predict raises, before the ENDs still open fire with the error.

    A handler that raises here is logged and noted on the error, which still reaches the caller.

    Attributes:
        error: the exception; it reaches the caller unchanged after the ENDs.
        during: "fit", "evaluate" or "predict": the innermost call it passed through.
    """

    error: BaseException
    during: str
