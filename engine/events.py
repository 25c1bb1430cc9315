"""The typed events of the loop and their payloads.

Where each event fires (one optimizer step over a window of k micro-batches)::

    TRAIN_START  SIDE*                      SIDE = LOG | EVAL_START EVAL_BATCH_END* EVAL_END | SAVE
      EPOCH_START
        STEP_START                          payload.batches: the window, fetched up front
          for each micro-batch of the window:
            BATCH_START                     a handler may replace payload.batch
            [to_device, forward, compute_loss hooks]
            LOSS                            a handler may replace payload.loss
            [backward hook]
            BACKWARD_END
        BEFORE_OPTIMIZER_STEP               gradients complete; payload.skip = True vetoes the step
        [optimizer_step hook]               returns False when it skipped (AMP overflow)
        OPTIMIZER_STEP                      only when the optimizer really stepped
        STEP_END                            global_step advanced; flow plugins set Control flags
        SIDE*                               acted on in the order LOG, EVAL, SAVE, then flags reset
      EPOCH_END  SIDE*
    TRAIN_END
    evaluate(): EVAL_START EVAL_BATCH_END* EVAL_END (payload.metrics)
    predict():  PREDICT_START PREDICT_BATCH_END* PREDICT_END (payload.output)
    on failure: EXCEPTION, then every END still open, innermost first, with payload.error set;
                the exception then reaches the caller unchanged

An END event (EPOCH_END, TRAIN_END, EVAL_END, PREDICT_END) closes what its START opened. When fit,
evaluate or predict raises after a START began to fire, EXCEPTION fires once, then each END still
open fires with ``payload.error`` set, and only to handlers registered with ``cleanup=True`` (the
others assume a finished block: metrics of a complete pass, the end of a run worth reporting). An
END runs its cleanup handlers even when an earlier handler of that END failed. See ``lifecycle.py``.

An exception raised in a handler reaches the caller of fit / evaluate / predict as itself: the same
object, its type unchanged, so ``except MyError:`` catches it (nothing wraps it). It carries the
failing handler and its event: the attributes ``trainbus_handler`` (``"Plugin.method"`` or the name
given to ``on``) and ``trainbus_event`` (``"LOSS"``), and a note (PEP 678, shown in the traceback)
``raised by handler 'Plugin.method' at event LOSS``; a handler failing while the failure path closes
the run adds a note to the original exception instead of replacing it.

Each ``EventType`` carries its payload class, so ``engine.on(Event.LOSS, fn)`` type-checks ``fn``
against ``LossEvent``. Calling an event makes a filtered event: ``Event.STEP_END(every=100)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Generic, TypeVar

from .errors import ConfigError, suggest
from .filters import EventFilter
from .payloads import (
    BackwardEndEvent,
    BatchStartEvent,
    BeforeOptimizerStepEvent,
    EpochEndEvent,
    EpochStartEvent,
    EvalBatchEndEvent,
    EvalEndEvent,
    EvalStartEvent,
    ExceptionEvent,
    LogEvent,
    LossEvent,
    OptimizerStepEvent,
    Payload,
    PredictBatchEndEvent,
    PredictEndEvent,
    PredictStartEvent,
    SaveEvent,
    StepEndEvent,
    StepStartEvent,
    TrainEndEvent,
    TrainStartEvent,
)

P = TypeVar("P", bound="Payload")


class EventType(Generic[P]):
    """One event of the loop. Compare by identity; ``name`` is for messages and traces."""

    __slots__ = ("index", "name", "payload_type")

    def __init__(self, name: str, payload_type: type[P], index: int) -> None:
        self.name = name
        self.payload_type = payload_type
        self.index = index

    def __repr__(self) -> str:
        return f"Event.{self.name}"

    def __call__(
        self,
        *,
        every: int | None = None,
        once: int | None = None,
        before: int | None = None,
        after: int | None = None,
        when: Callable[[P], bool] | None = None,
    ) -> FilteredEvent[P]:
        """A filtered view of this event: fire the handler only on some occurrences.

        The occurrence number a filter sees: for STEP_START, BEFORE_OPTIMIZER_STEP and STEP_END the
        step number of the window (``global_step`` after it); for BATCH_START, LOSS, BACKWARD_END
        the micro-batch number in the run (``state.micro_steps``); for OPTIMIZER_STEP the optimizer
        steps taken; for every other event its firings in this engine (``state.event_counts``). All
        live in State, so ``every=100`` on STEP_END means steps 100, 200, ... also across a resume.
        """
        return FilteredEvent(self, EventFilter.make(every=every, once=once, before=before, after=after, when=when))

    def filtered(self, flt: EventFilter) -> FilteredEvent[P]:
        return FilteredEvent(self, flt)


class FilteredEvent(Generic[P]):
    """An event plus a filter; what ``Event.X(every=...)`` returns and ``engine.on`` accepts."""

    __slots__ = ("event", "filter")

    def __init__(self, event: EventType[P], flt: EventFilter) -> None:
        self.event = event
        self.filter = flt

    def __repr__(self) -> str:
        return f"{self.event!r}({self.filter.description})"

    def __or__(self, other: FilteredEvent[P]) -> FilteredEvent[P]:
        if other.event is not self.event:
            raise ConfigError(f"cannot combine filters of different events: {self.event.name} | {other.event.name}")
        return FilteredEvent(self.event, self.filter | other.filter)

    def __and__(self, other: FilteredEvent[P]) -> FilteredEvent[P]:
        if other.event is not self.event:
            raise ConfigError(f"cannot combine filters of different events: {self.event.name} & {other.event.name}")
        return FilteredEvent(self.event, self.filter & other.filter)


class Event:
    """The namespace of all events. ``Event.ALL`` lists them in loop order, EXCEPTION last."""

    TRAIN_START = EventType("TRAIN_START", TrainStartEvent, 0)
    EPOCH_START = EventType("EPOCH_START", EpochStartEvent, 1)
    STEP_START = EventType("STEP_START", StepStartEvent, 2)
    BATCH_START = EventType("BATCH_START", BatchStartEvent, 3)
    LOSS = EventType("LOSS", LossEvent, 4)
    BACKWARD_END = EventType("BACKWARD_END", BackwardEndEvent, 5)
    BEFORE_OPTIMIZER_STEP = EventType("BEFORE_OPTIMIZER_STEP", BeforeOptimizerStepEvent, 6)
    OPTIMIZER_STEP = EventType("OPTIMIZER_STEP", OptimizerStepEvent, 7)
    STEP_END = EventType("STEP_END", StepEndEvent, 8)
    LOG = EventType("LOG", LogEvent, 9)
    EVAL_START = EventType("EVAL_START", EvalStartEvent, 10)
    EVAL_BATCH_END = EventType("EVAL_BATCH_END", EvalBatchEndEvent, 11)
    EVAL_END = EventType("EVAL_END", EvalEndEvent, 12)
    SAVE = EventType("SAVE", SaveEvent, 13)
    EPOCH_END = EventType("EPOCH_END", EpochEndEvent, 14)
    TRAIN_END = EventType("TRAIN_END", TrainEndEvent, 15)
    PREDICT_START = EventType("PREDICT_START", PredictStartEvent, 16)
    PREDICT_BATCH_END = EventType("PREDICT_BATCH_END", PredictBatchEndEvent, 17)
    PREDICT_END = EventType("PREDICT_END", PredictEndEvent, 18)
    EXCEPTION = EventType("EXCEPTION", ExceptionEvent, 19)

    ALL: ClassVar[tuple[EventType[Any], ...]] = ()
    BY_NAME: ClassVar[dict[str, EventType[Any]]] = {}


Event.ALL = tuple(sorted((v for v in vars(Event).values() if isinstance(v, EventType)), key=lambda e: e.index))
Event.BY_NAME = {e.name: e for e in Event.ALL}
#: the events that close a block, and may therefore fire on a failure (see the module docstring)
END_EVENTS: frozenset[EventType[Any]] = frozenset({Event.EPOCH_END, Event.TRAIN_END, Event.EVAL_END, Event.PREDICT_END})


def event_by_name(name: str) -> EventType[Any]:
    """Look an event up by name (case-insensitive); unknown names list the allowed ones."""
    found = Event.BY_NAME.get(name.upper())
    if found is None:
        raise ConfigError(
            f"unknown event {name!r}{suggest(name.upper(), Event.BY_NAME)}; known events: {', '.join(Event.BY_NAME)}"
        )
    return found


__all__ = [
    "END_EVENTS",
    "Event",
    "EventType",
    "FilteredEvent",
    "P",
    "event_by_name",
    "BackwardEndEvent",
    "BatchStartEvent",
    "BeforeOptimizerStepEvent",
    "EpochEndEvent",
    "EpochStartEvent",
    "EvalBatchEndEvent",
    "EvalEndEvent",
    "EvalStartEvent",
    "ExceptionEvent",
    "LogEvent",
    "LossEvent",
    "OptimizerStepEvent",
    "Payload",
    "PredictBatchEndEvent",
    "PredictEndEvent",
    "PredictStartEvent",
    "SaveEvent",
    "StepEndEvent",
    "StepStartEvent",
    "TrainEndEvent",
    "TrainStartEvent",
]
