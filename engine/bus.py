"""The event bus: registration, ordering, filters, removable handles, dispatch, trace.

Ordering is declared, never offset. A handler runs in a phase, one of the ``Priority`` constants
(FIRST, PRODUCER, DEFAULT, CONSUMER, LAST: earlier phases run first), and may say which handlers
of its event it runs ``before`` or ``after``: a handler name (``"TrainLogger.record"``), a plugin
name meaning all of that plugin's handlers (``"Checkpointing"``), or ``"*"``, every other handler
of its phase (except those that say ``"*"`` the same way or name it explicitly). Inside a phase the
handlers run in a topological order of those constraints; among the handlers whose constraints are
met, the earliest registered runs next (no constraint: registration order). A constraint naming a
handler not registered (yet) is kept and applies when that handler appears, so plugins may attach in
any order; one that cannot hold (a cycle, or a later phase before an earlier one) raises ConfigError
at the registration that breaks it, naming the handlers, and that registration does not happen.
``EventBus.describe()`` gives every event's handlers in the order they run.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, NoReturn

from .errors import ConfigError, HandlerError, TrainbusError
from .events import END_EVENTS, Event, EventType, P, event_by_name
from .filters import EventFilter, FilteredEvent

logger = logging.getLogger("trainbus.engine")

Handler = Callable[[P], None]
#: ``caller(payload, n)``: runs an event's handlers in order for its ``n``-th occurrence
Caller = Callable[[Any, int], None]


#: what ``before=`` / ``after=`` take: a handler or plugin name, ``"*"``, or a sequence of them
Targets = str | Sequence[str]
#: ``before="*"`` / ``after="*"``: every other handler of the same phase
EVERY = "*"


def _targets(targets: Targets, what: str) -> tuple[str, ...]:
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    for target in names:
        if not isinstance(target, str) or not target:
            raise ConfigError(f"{what}= takes handler or plugin names (or '*'), got {targets!r}")
    return names


class Order:
    """A phase with the handlers to run before and after inside it; made by ``Priority.X.before(...)``.

    What a ``priority=`` argument or a plugin's ``priority`` class attribute may hold besides a
    bare phase, so one declaration carries both, e.g. ``priority = Priority.CONSUMER.after("Checkpointing")``.

    Example:
        >>> order = Priority.FIRST.before("HalfPrecisionEval").after("ScheduleFreeModes")
        >>> order.phase, order.precedes, order.follows
        (1000, ('HalfPrecisionEval',), ('ScheduleFreeModes',))
    """

    __slots__ = ("follows", "phase", "precedes")

    def __init__(self, phase: int, precedes: Targets = (), follows: Targets = ()) -> None:
        if isinstance(phase, bool) or not isinstance(phase, int):
            raise ConfigError(f"priority must be a phase (an int, see Priority), got {phase!r}")
        self.phase = int(phase)
        self.precedes = _targets(precedes, "before")
        self.follows = _targets(follows, "after")

    def before(self, *targets: str) -> Order:
        """This order, also running before ``targets`` (handler or plugin names, or ``"*"``)."""
        return Order(self.phase, self.precedes + _targets(targets, "before"), self.follows)

    def after(self, *targets: str) -> Order:
        """This order, also running after ``targets`` (handler or plugin names, or ``"*"``)."""
        return Order(self.phase, self.precedes, self.follows + _targets(targets, "after"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Order):
            return NotImplemented
        return (self.phase, self.precedes, self.follows) == (other.phase, other.precedes, other.follows)

    def __hash__(self) -> int:
        return hash((self.phase, self.precedes, self.follows))

    def __repr__(self) -> str:
        text = phase_name(self.phase)
        for method, names in (("before", self.precedes), ("after", self.follows)):
            if names:
                text += f".{method}({', '.join(map(repr, names))})"
        return text


class Phase(int):
    """A named phase: an int (higher runs first) that can also say ``.before(...)`` / ``.after(...)``."""

    label: str

    def __new__(cls, value: int, label: str) -> Phase:
        phase = super().__new__(cls, value)
        phase.label = label
        return phase

    def __getnewargs__(self) -> tuple[int, str]:  # type: ignore[override]  # copy and pickle keep the label
        return int(self), self.label

    def before(self, *targets: str) -> Order:
        """Run in this phase, before ``targets`` (handler or plugin names, or ``"*"``)."""
        return Order(self).before(*targets)

    def after(self, *targets: str) -> Order:
        """Run in this phase, after ``targets`` (handler or plugin names, or ``"*"``)."""
        return Order(self).after(*targets)

    def __repr__(self) -> str:
        return f"Priority.{self.label}"


class Priority:
    """The phases, in the order they run. Producers fill a payload before consumers read it.

    Inside a phase, say the order with ``before=`` / ``after=`` (or ``Priority.X.before(...)``);
    an int between the phases still works but names nothing, so the built-in plugins use none.
    """

    FIRST = Phase(1000, "FIRST")  # state keepers that others read (e.g. AMP unscale before clipping)
    PRODUCER = Phase(100, "PRODUCER")  # handlers that add to a payload (loss/lr into logs, metrics into eval results)
    DEFAULT = Phase(0, "DEFAULT")
    CONSUMER = Phase(-100, "CONSUMER")  # handlers that read a finished payload (sinks, early stopping, checkpoint)
    LAST = Phase(-1000, "LAST")


_PHASES = {int(p): p.label for p in vars(Priority).values() if isinstance(p, Phase)}


def phase_name(priority: int) -> str:
    """``Priority.CONSUMER`` for -100, the number for a priority that is no named phase."""
    return f"Priority.{_PHASES[priority]}" if priority in _PHASES else str(priority)


class _Record:
    __slots__ = ("after", "before", "cleanup", "event", "filter", "fn", "name", "priority", "seq")

    def __init__(
        self,
        event: EventType[Any],
        fn: Callable[[Any], None],
        flt: EventFilter | None,
        priority: int,
        name: str,
        seq: int,
        cleanup: bool = False,
        before: tuple[str, ...] = (),
        after: tuple[str, ...] = (),
    ) -> None:
        self.event = event
        self.fn = fn
        self.filter = flt
        self.priority = priority
        self.name = name
        self.seq = seq
        self.cleanup = cleanup
        self.before = before
        self.after = after

    def names(self, target: str) -> bool:
        """Whether ``target`` (a handler name, or a plugin name for its ``<plugin>.<method>`` handlers) is this."""
        name = self.name
        return name == target or (name.startswith(target) and name[len(target) : len(target) + 1] == ".")


class Handle:
    """Returned by ``on``; ``remove()`` unregisters the handler. Also a context manager."""

    __slots__ = ("_bus", "_record")

    def __init__(self, bus: EventBus, record: _Record) -> None:
        self._bus = bus
        self._record = record

    @property
    def name(self) -> str:
        return self._record.name

    @property
    def active(self) -> bool:
        return self._record in self._bus._handlers[self._record.event.index]

    def remove(self) -> None:
        """Unregister; calling it again does nothing."""
        self._bus._remove(self._record)

    def __enter__(self) -> Handle:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()


def handler_name(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(type(fn), "__qualname__", repr(fn)))


class EventBus:
    """Holds handlers per event and dispatches payloads to them.

    Example:
        >>> from trainbus.engine import EventBus, Event
        >>> bus = EventBus()
        >>> seen = []
        >>> handle = bus.on(Event.STEP_END(every=2), lambda ev: seen.append(bus.counts["STEP_END"]))
        >>> for _ in range(5):
        ...     bus.fire(Event.STEP_END, None)
        >>> seen
        [2, 4]
    """

    def __init__(self) -> None:
        self._handlers: list[tuple[_Record, ...]] = [() for _ in Event.ALL]
        #: per event index: None without handlers, else the caller that runs them (see ``_caller``).
        #: The list is updated in place, so the loop may hold it and still see every change.
        self.callers: list[Caller | None] = [None for _ in Event.ALL]
        self._seq = itertools.count()
        self.counts: dict[str, int] = {}
        self._trace: list[tuple[str, str]] | None = None

    @property
    def trace(self) -> list[tuple[str, str]] | None:
        """(event, handler) of every handler call while tracing is on; None when off."""
        return self._trace

    @trace.setter
    def trace(self, trace: list[tuple[str, str]] | None) -> None:
        self._trace = trace
        for index, records in enumerate(self._handlers):
            self._set_handlers(index, records)  # a lone handler is called directly only when untraced

    # -- registration -------------------------------------------------------------------------
    def on(
        self,
        event: EventType[P] | FilteredEvent[P] | str,
        handler: Callable[[P], None],
        *,
        priority: int | Order = Priority.DEFAULT,
        name: str | None = None,
        cleanup: bool = False,
        before: Targets = (),
        after: Targets = (),
    ) -> Handle:
        """Register ``handler`` for ``event`` (an Event, a filtered event, or an event name).

        ``priority`` is the phase (a ``Priority`` constant, or ``Priority.X.before(...)``, which
        carries constraints too); ``before`` / ``after`` name the handlers of this event it runs
        before / after: a handler name, a plugin name (all its handlers), ``"*"`` (every other
        handler of the phase), or a list of them. See the module docstring for the rule; a
        constraint that cannot hold raises ConfigError and registers nothing.

        ``cleanup=True`` (END events only) makes the handler run also when the block failed: on the
        END fired after EXCEPTION, and after an earlier handler of the same END raised; it then sees
        ``payload.error``. Restoring weights, closing files and releasing memory are cleanup; work that
        needs a finished block (metrics of a complete pass, loading the best model) is not.
        """
        flt: EventFilter | None = None
        if isinstance(event, str):
            event = event_by_name(event)
        if isinstance(event, FilteredEvent):
            flt = event.filter
            event = event.event
        if not isinstance(event, EventType):
            raise ConfigError(
                f"cannot register a handler for {event!r}: expected an Event (one of {', '.join(Event.BY_NAME)})"
            )
        if not callable(handler):
            raise ConfigError(f"handler for {event.name} must be callable, got {handler!r}")
        order = priority if isinstance(priority, Order) else Order(priority)  # Order checks the int
        if cleanup and event not in END_EVENTS:
            ends = ", ".join(sorted(e.name for e in END_EVENTS))
            raise ConfigError(f"cleanup=True is for the events that close a block ({ends}), not {event.name}")
        record = _Record(
            event,
            handler,
            flt,
            order.phase,
            name or handler_name(handler),
            next(self._seq),
            cleanup,
            order.precedes + _targets(before, "before"),
            order.follows + _targets(after, "after"),
        )
        self._set_handlers(event.index, ordered(self._handlers[event.index] + (record,)))
        return Handle(self, record)

    def _remove(self, record: _Record) -> None:
        current = self._handlers[record.event.index]
        if record in current:  # dropping a handler drops its constraints: the rest still hold
            self._set_handlers(record.event.index, ordered(r for r in current if r is not record))

    def _set_handlers(self, index: int, records: tuple[_Record, ...]) -> None:
        self._handlers[index] = records
        self.callers[index] = self._caller(records)

    def _caller(self, records: tuple[_Record, ...]) -> Caller | None:
        """The function that runs ``records`` for one occurrence, built once per change of handlers.

        One handler without a filter, not traced, is what nearly every hot event has (LOSS with
        accumulation, OPTIMIZER_STEP with a scheduler); its caller is just the guarded call, with no
        loop, filter or trace check: a few opcodes per micro-batch instead of thirty.
        """
        if not records:
            return None
        if len(records) == 1 and records[0].filter is None and self._trace is None:
            record = records[0]
            fn = record.fn

            def call_one(payload: Any, n: int) -> None:
                try:
                    fn(payload)
                except Exception as exc:
                    _reraise(record, exc)

            return call_one

        def call_all(payload: Any, n: int) -> None:
            trace = self._trace
            for record in records:
                flt = record.filter
                if flt is not None and not flt(n, payload):
                    continue
                if trace is not None:
                    trace.append((record.event.name, record.name))
                    logger.debug("%s -> %s", record.event.name, record.name)
                try:
                    record.fn(payload)
                except Exception as exc:
                    _reraise(record, exc)

        return call_all

    def has_handlers(self, event: EventType[Any]) -> bool:
        return bool(self._handlers[event.index])

    def handler_names(self, event: EventType[Any]) -> list[str]:
        """Names of the handlers of ``event`` in the order they run."""
        return [r.name for r in self._handlers[event.index]]

    def describe(self) -> dict[str, list[str]]:
        """Every event that has handlers (in loop order) -> its handlers' names in the order they run."""
        return {event.name: [r.name for r in records] for event, records in zip(Event.ALL, self._handlers) if records}

    # -- dispatch -----------------------------------------------------------------------------
    def count(self, event: EventType[Any]) -> int:
        """Advance and return the occurrence number of ``event`` (what filters see)."""
        counts = self.counts
        name = event.name
        n = counts[name] + 1 if name in counts else 1
        counts[name] = n
        return n

    def fire(self, event: EventType[P], payload: P) -> None:
        """Count one occurrence of ``event`` and run its handlers in order.

        A handler's exception is re-raised as HandlerError naming the handler and the event.
        trainbus's own errors (ConfigError, ...) keep their type and get a note naming the handler;
        KeyboardInterrupt and other BaseExceptions pass through unchanged.
        """
        n = self.count(event)
        self.dispatch(event, payload, n)

    def dispatch(self, event: EventType[P], payload: P, n: int) -> None:
        """Run the handlers of an occurrence already counted (the loop counts even with no handler)."""
        caller = self.callers[event.index]
        if caller is not None:
            caller(payload, n)

    def dispatch_each(self, event: EventType[Any], payload: Any, n: int) -> list[Exception]:
        """Run the handlers of an END or EXCEPTION occurrence, each one even when another failed.

        For an END payload: while ``payload.error`` is None every handler runs; once it is set (the
        block failed before, or a handler here just raised, whose error becomes ``payload.error``)
        only cleanup handlers run. Returns the failures (wrapped as ``_reraise`` would raise them),
        in order; the caller raises or notes them. Never used per step: these events close blocks.
        """
        errors: list[Exception] = []
        has_error = hasattr(payload, "error") and event in END_EVENTS
        trace = self._trace
        for record in self._handlers[event.index]:
            if has_error and payload.error is not None and not record.cleanup:
                continue
            flt = record.filter
            if flt is not None and not flt(n, payload):
                continue
            if trace is not None:
                trace.append((record.event.name, record.name))
            try:
                record.fn(payload)
            except Exception as exc:
                wrapped = wrap_error(record, exc)
                errors.append(wrapped)
                if has_error and payload.error is None:
                    payload.error = wrapped
        return errors

    def enable_trace(self) -> list[tuple[str, str]]:
        """Record (event, handler) for every handler call from now on; returns the list."""
        trace: list[tuple[str, str]] = []
        self.trace = trace
        return trace


def ordered(records: Iterable[_Record]) -> tuple[_Record, ...]:
    """``records`` in the order they run: phases first to last, inside a phase a topological order
    of the before / after constraints that picks the earliest registered of the ready handlers.

    Runs on registration and removal only (the callers it feeds are rebuilt then), never per event.
    Raises ConfigError when a constraint cannot hold: a cycle, or a handler asked to run before one
    of an earlier phase (or after one of a later phase).
    """
    by_seq = sorted(records, key=lambda r: r.seq)
    if not any(r.before or r.after for r in by_seq):
        return tuple(sorted(by_seq, key=lambda r: -r.priority))  # stable: registration order in a phase
    edges: dict[_Record, dict[_Record, str]] = {r: {} for r in by_seq}  # first -> then -> why
    wild: list[tuple[_Record, _Record, str]] = []
    for record in by_seq:
        for direction, targets in (("before", record.before), ("after", record.after)):
            for target in targets:
                why = f"{record.name!r} says {direction}={target!r}"
                for other in by_seq:
                    if other is record:
                        continue
                    first, then = (record, other) if direction == "before" else (other, record)
                    if target == EVERY:
                        if other.priority == record.priority and EVERY not in getattr(other, direction):
                            wild.append((first, then, why))
                    elif other.names(target):
                        _add_edge(edges, first, then, why)
    for first, then, why in wild:  # "*" yields to an explicit constraint between the same two handlers
        if first not in edges[then]:
            edges[first].setdefault(then, why)
    waiting = {r: 0 for r in by_seq}
    for first in by_seq:
        for then in edges[first]:
            waiting[then] += 1
    result: list[_Record] = []
    for phase in sorted({r.priority for r in by_seq}, reverse=True):
        members = [r for r in by_seq if r.priority == phase]
        ready = [(r.seq, r) for r in members if not waiting[r]]
        heapq.heapify(ready)
        placed = 0
        while ready:
            _, record = heapq.heappop(ready)
            result.append(record)
            placed += 1
            for then in edges[record]:
                waiting[then] -= 1
                if not waiting[then]:
                    heapq.heappush(ready, (then.seq, then))
        if placed < len(members):
            _raise_cycle(edges, [r for r in members if waiting[r]])
    return tuple(result)


def _add_edge(edges: dict[_Record, dict[_Record, str]], first: _Record, then: _Record, why: str) -> None:
    if first.priority > then.priority:
        return  # an earlier phase: holds already
    if first.priority < then.priority:
        raise ConfigError(
            f"handler order at {first.event.name} cannot hold: {why}, but {first.name!r} runs in "
            f"{phase_name(first.priority)}, after {then.name!r} in {phase_name(then.priority)}; "
            "move one of them to another phase or drop the constraint"
        )
    edges[first].setdefault(then, why)


def _raise_cycle(edges: dict[_Record, dict[_Record, str]], stuck: list[_Record]) -> NoReturn:
    """Raise ConfigError naming one cycle among ``stuck`` (handlers that never became ready)."""
    inside = set(stuck)
    path = [stuck[0]]
    seen = {stuck[0]: 0}
    while True:  # every stuck handler waits on a stuck one: walking back must close a loop
        previous = next(r for r in stuck if path[-1] in edges[r] and r in inside)
        if previous in seen:
            cycle = path[seen[previous] :][::-1]
            break
        seen[previous] = len(path)
        path.append(previous)
    steps = [f"{a.name!r} before {b.name!r} ({edges[a][b]})" for a, b in zip(cycle, cycle[1:] + cycle[:1])]
    raise ConfigError(f"handler order at {cycle[0].event.name} has a cycle: " + "; ".join(steps))


def wrap_error(record: _Record, exc: Exception) -> Exception:
    """A failing handler's exception as it is raised: a HandlerError naming the handler and the event.

    trainbus's own errors (ConfigError, ...) already say what is wrong and what is allowed; they
    keep their type, so callers can catch ConfigError, with a note saying where they came from. A
    HandlerError from a nested dispatch passes unchanged.
    """
    if isinstance(exc, HandlerError):
        return exc
    if isinstance(exc, TrainbusError):
        if hasattr(exc, "add_note"):
            exc.add_note(f"raised by handler {record.name!r} at event {record.event.name}")
        return exc
    wrapped = HandlerError(record.name, record.event.name, exc)
    wrapped.__cause__ = exc
    return wrapped


def _reraise(record: _Record, exc: Exception) -> NoReturn:
    """Raise ``wrap_error(record, exc)``: the hot path's error guard (see ``wrap_error``)."""
    wrapped = wrap_error(record, exc)
    if wrapped is exc:
        raise exc
    raise wrapped from exc
