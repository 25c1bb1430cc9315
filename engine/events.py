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

The handlers of an event run in phases (``priority=Priority.PRODUCER``: FIRST, PRODUCER, DEFAULT,
CONSUMER, LAST), inside a phase in the order ``before=`` / ``after=`` declare (handler or plugin names,
``"*"``), then in registration order. A handler that writes a payload field declares it
(``writes="metrics"``, or one key ``"metrics.eval_accuracy"``), one that reads it ``reads="metrics"``
(a plugin may declare both per method: ``reads = {"eval_end": "metrics"}``), and every writer runs
before every other reader of what it writes, in any order the plugins were listed in. An order that
cannot hold (a cycle, a reader in an earlier phase than its writer) is a ConfigError naming both
handlers when the second registers. ``engine.describe()`` lists each event's handlers in call order.
For example, TrainLogger reads ``metrics`` at EVAL_END in DEFAULT after ``"*"``: a metric added by a
PRODUCER or DEFAULT handler is logged (log_history, sinks) whatever the plugin order; a handler in
CONSUMER or LAST that declares ``writes="metrics"`` is refused, naming TrainLogger's handler.
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

#: every event by index (the bus's slot) and by name: the loop's, then events of your own
_BY_INDEX: dict[int, EventType[Any]] = {}
_BY_NAME: dict[str, EventType[Any]] = {}
_BUILT_IN: set[EventType[Any]] = set()  # Event.ALL, once defined


class EventType(Generic[P]):
    """One event: a name and the payload class its handlers receive. Compare by identity.

    The loop's events are ``Event.X``. An event of your own is an ``EventType(name, PayloadClass)``
    made once, at module level: ``name`` an identifier no other event has (``event_by_name`` and the
    string form ``engine.on("SPIKE", fn)`` find it), ``PayloadClass`` a dataclass subclass of
    ``Payload`` (its first field is the engine). The index, the bus's slot, is assigned (one passed is
    ignored). Making it again with the same name and payload class gives the same event; with another
    payload class, a new event that takes the name for string lookups (``engine.on("SPIKE", fn)``).

    - Fire it with ``engine.fire(EVENT, PayloadClass(engine, ...))`` (``ev.engine.fire`` in a handler),
      from a handler, a hook or your own code; its handlers run at once, in order, and ``fire``
      returns the payload, so a handler may fill it for the code that fired it. Only the loop fires
      ``Event.X``.
    - Attach handlers as for the loop's events: ``engine.on(EVENT, fn)``, ``Plugin.on(engine, EVENT,
      fn)``, with a filter (``EVENT(every=2)``, ``EVENT(when=...)``), a phase (``priority=Priority.CONSUMER``)
      and ``before=`` / ``after=`` names. A handler's exception reaches ``fire``'s caller as itself,
      noted with the handler and the event.
    - Filters count the event's occurrences in ``state.event_counts[name]``, which checkpoints hold, so
      ``every=N`` keeps its rhythm across a resume. ``engine.describe()`` lists the event's handlers
      after the loop's events. ``EventRecorder`` and ``check_trace`` see the loop's events only.

    A mistake fails when it is made, naming the remedy: a name the loop uses, a payload that is no
    class, a payload of another class given to ``fire``, firing one of the loop's events.

    Example::

        from dataclasses import dataclass

        import torch

        from trainbus.engine import Engine, Event, EventType, LossEvent, Payload, Plugin

        @dataclass
        class SpikeEvent(Payload):  # fires when a micro-batch's loss exceeds the detector's threshold
            loss: float

        SPIKE = EventType("SPIKE_EXAMPLE", SpikeEvent)  # once, at module level

        class SpikeDetector(Plugin):
            def __init__(self, threshold: float) -> None:
                self.threshold = threshold

            def attach(self, engine: Engine) -> None:
                self.on(engine, Event.LOSS, self.check)

            def check(self, ev: LossEvent) -> None:
                loss = float(ev.loss.detach())  # a host sync per micro-batch: fine here, costly on a GPU
                if loss > self.threshold:
                    ev.engine.fire(SPIKE, SpikeEvent(ev.engine, loss))

        model = torch.nn.Linear(2, 1)
        data = [(torch.randn(4, 2), 10 * torch.randn(4, 1)) for _ in range(6)]
        engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.01), train_data=data, max_epochs=2,
                        loss_fn=torch.nn.MSELoss(), plugins=[SpikeDetector(threshold=0.0)])
        seen = []
        engine.on(SPIKE(every=2), lambda ev: seen.append(("every 2nd", ev.loss)), name="alert")
        engine.on(SPIKE, lambda ev: seen.append(("each", ev.loss)), name="log", before="alert")
        engine.fit()
        assert engine.state.event_counts["SPIKE_EXAMPLE"] == 12 and len(seen) == 12 + 6
        assert engine.describe()["SPIKE_EXAMPLE"] == ["log", "alert"]
    """

    __slots__ = ("index", "name", "payload_type")

    def __new__(cls, name: str, payload_type: type[P], index: int | None = None) -> EventType[P]:
        existing = _BY_NAME.get(name)
        if existing is not None and existing not in _BUILT_IN and existing.payload_type is payload_type:
            return existing  # the same event again (made inline in on() and in fire()): one event, one slot
        return super().__new__(cls)

    def __init__(self, name: str, payload_type: type[P], index: int | None = None) -> None:
        if getattr(self, "name", None) is not None:
            return  # __new__ returned the event already made
        self.name = name
        self.payload_type = payload_type
        self.index = _register(self, index)

    def __repr__(self) -> str:
        return f"Event.{self.name}" if self in _BUILT_IN else f"EventType({self.name!r}, {self.payload_type.__name__})"

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


def _register(event: EventType[Any], index: int | None) -> int:
    """Check a new event and give it the next free index, the bus's slot (the loop's events take 0 .. 19 in order)."""
    name, payload_type = event.name, event.payload_type
    if not isinstance(name, str) or not name.isidentifier():
        raise ConfigError(f"an event's name must be an identifier such as 'SPIKE', got {name!r}")
    if not isinstance(payload_type, type):
        raise ConfigError(
            f"EventType({name!r}, ...) needs the payload's class, best a dataclass subclass of trainbus.engine.Payload "
            f"(its first field is the engine), got {payload_type!r}; e.g. @dataclass class {name.title()}Event"
            "(Payload): value: float"
        )
    if index is not None and (isinstance(index, bool) or not isinstance(index, int)):
        raise ConfigError(f"EventType({name!r}, {payload_type.__name__}, index): leave the index out, got {index!r}")
    if _BY_NAME.get(name) in _BUILT_IN:
        raise ConfigError(f"event name {name!r} is the loop's own Event.{name}; give your event another name")
    # the index is assigned, whatever was passed (an index is a slot, and a slot another module took is no error);
    # a second event of an existing name (a module imported twice, two libraries) takes the name for string lookups
    free = max(_BY_INDEX, default=-1) + 1
    _BY_INDEX[free] = event
    _BY_NAME[name] = event
    return free


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
_BUILT_IN.update(Event.ALL)
#: the events that close a block, and may therefore fire on a failure (see the module docstring)
END_EVENTS: frozenset[EventType[Any]] = frozenset({Event.EPOCH_END, Event.TRAIN_END, Event.EVAL_END, Event.PREDICT_END})


def is_built_in(event: EventType[Any]) -> bool:
    """Whether ``event`` is one of the loop's (``Event.ALL``), which only the loop fires."""
    return event in _BUILT_IN


def own_events() -> tuple[EventType[Any], ...]:
    """The events of your own defined in this process (``EventType(name, payload)``), in definition order."""
    return tuple(e for e in _BY_INDEX.values() if e not in _BUILT_IN and _BY_NAME.get(e.name) is e)


def event_of_index(index: int) -> EventType[Any] | None:
    """The event holding ``index`` (the slot the bus keeps its handlers in), None when free."""
    return _BY_INDEX.get(index)


def event_by_name(name: str) -> EventType[Any]:
    """Look an event up by name (case-insensitive); unknown names list the allowed ones."""
    found = _BY_NAME.get(name) or _BY_NAME.get(name.upper())
    if found is None:
        mine = f"; events of your own: {', '.join(e.name for e in own_events())}" if own_events() else ""
        raise ConfigError(
            f"unknown event {name!r}{suggest(name.upper(), _BY_NAME)}; the loop's events: {', '.join(Event.BY_NAME)}"
            f"{mine}. An event of your own is an EventType(name, PayloadClass) created before handlers name it"
        )
    return found


__all__ = [
    "END_EVENTS",
    "Event",
    "EventType",
    "FilteredEvent",
    "P",
    "event_by_name",
    "event_of_index",
    "is_built_in",
    "own_events",
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
