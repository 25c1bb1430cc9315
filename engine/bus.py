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
``EventBus.describe()`` gives every event's handlers in the order they run. The phases, the
declarations and the sort live in ``ordering.py``; this module keeps the registrations and calls them.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .errors import ConfigError, note_handler
from .events import END_EVENTS, Event, EventType, FilteredEvent, P, event_by_name
from .filters import EventFilter
from .ordering import (
    EVERY,
    Order,
    Phase,
    Priority,
    Registration,
    Targets,
    field_names,
    ordered,
    phase_name,
    target_names,
)
from .signatures import check_handler

__all__ = [
    "EVERY", "Caller", "EventBus", "Handle", "Handler", "Order", "Phase", "Priority", "Registration", "Targets",
    "handler_name", "note_handler", "ordered", "phase_name",
]  # fmt: skip

logger = logging.getLogger("trainbus.engine")

Handler = Callable[[P], None]
#: ``caller(payload, n)``: runs an event's handlers in order for its ``n``-th occurrence
Caller = Callable[[Any, int], None]


class Handle:
    """Returned by ``on``; ``remove()`` unregisters the handler. Also a context manager."""

    __slots__ = ("_bus", "_record")

    def __init__(self, bus: EventBus, record: Registration) -> None:
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


def _event_and_filter(event: EventType[P] | FilteredEvent[P] | str) -> tuple[EventType[P], EventFilter | None]:
    """What ``on`` was given, as the event and its filter (None without one); an event name is looked up."""
    if isinstance(event, str):
        event = event_by_name(event)
    if isinstance(event, FilteredEvent):
        return event.event, event.filter
    if not isinstance(event, EventType):
        raise ConfigError(
            f"cannot register a handler for {event!r}: expected an Event (one of {', '.join(Event.BY_NAME)}) "
            "or an event of your own, EventType(name, PayloadClass)"
        )
    return event, None


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
        self._handlers: list[tuple[Registration, ...]] = [() for _ in Event.ALL]
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
        reads: Targets = (),
        writes: Targets = (),
    ) -> Handle:
        """Register ``handler`` for ``event`` (an Event, a filtered event, or an event name).

        ``priority`` is the phase (a ``Priority`` constant, or ``Priority.X.before(...)``, which
        carries constraints too); ``before`` / ``after`` name the handlers of this event it runs
        before / after: a handler name, a plugin name (all its handlers), ``"*"`` (every other
        handler of the phase), or a list of them. ``reads`` / ``writes`` name the payload fields it
        reads and writes (``"metrics"``, or one key ``"metrics.eval_loss"``): every writer of a field
        runs before every other handler that reads it. See the module docstring for the rule; a
        constraint that cannot hold raises ConfigError, naming both handlers, and registers nothing.

        ``cleanup=True`` (END events only) makes the handler run also when the block failed: on the
        END fired after EXCEPTION, and after an earlier handler of the same END raised; it then sees
        ``payload.error``. Restoring weights, closing files and releasing memory are cleanup; work that
        needs a finished block (metrics of a complete pass, loading the best model) is not.
        """
        event, flt = _event_and_filter(event)
        if not callable(handler):
            raise ConfigError(f"handler for {event.name} must be callable, got {handler!r}")
        check_handler(event, handler, name or handler_name(handler))  # once here, never per event
        order = priority if isinstance(priority, Order) else Order(priority)  # Order checks the int
        if cleanup and event not in END_EVENTS:
            ends = ", ".join(sorted(e.name for e in END_EVENTS))
            raise ConfigError(f"cleanup=True is for the events that close a block ({ends}), not {event.name}")
        record = Registration(
            event,
            handler,
            flt,
            order.phase,
            name or handler_name(handler),
            next(self._seq),
            cleanup,
            order.precedes + target_names(before, "before"),
            order.follows + target_names(after, "after"),
            field_names(reads, "reads", event),
            field_names(writes, "writes", event),
        )
        self._make_room(event)
        self._set_handlers(event.index, ordered(self._handlers[event.index] + (record,)))
        return Handle(self, record)

    def _make_room(self, event: EventType[Any]) -> None:
        """Grow the per-event tables to hold ``event`` (an event of your own, defined after this bus)."""
        missing = event.index + 1 - len(self._handlers)
        if missing > 0:  # in place: the loop holds ``callers``
            self._handlers.extend(() for _ in range(missing))
            self.callers.extend(None for _ in range(missing))

    def _remove(self, record: Registration) -> None:
        current = self._handlers[record.event.index]
        if record in current:  # dropping a handler drops its constraints: the rest still hold
            self._set_handlers(record.event.index, ordered(r for r in current if r is not record))

    def _set_handlers(self, index: int, records: tuple[Registration, ...]) -> None:
        self._handlers[index] = records
        self.callers[index] = self._caller(records)

    def _caller(self, records: tuple[Registration, ...]) -> Caller | None:
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
                    note_handler(exc, record.name, record.event.name)
                    raise

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
                    note_handler(exc, record.name, record.event.name)
                    raise

        return call_all

    def registrations(self) -> list[Registration]:
        """Every registration, events in loop order, each event's in the order they run."""
        return [record for records in self._handlers for record in records]

    def has_handlers(self, event: EventType[Any]) -> bool:
        return event.index < len(self._handlers) and bool(self._handlers[event.index])

    def handler_names(self, event: EventType[Any]) -> list[str]:
        """Names of the handlers of ``event`` in the order they run."""
        return [r.name for r in self._handlers[event.index]] if event.index < len(self._handlers) else []

    def describe(self) -> dict[str, list[str]]:
        """Every event that has handlers (the loop's in loop order, then events of your own) -> its
        handlers' names in the order they run."""
        return {records[0].event.name: [r.name for r in records] for records in self._handlers if records}

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

        A handler's exception reaches the caller as itself (same object, same type, so ``except
        MyError`` catches it), with the handler and the event attached by ``note_handler``: a PEP 678
        note and the attributes ``trainbus_handler`` / ``trainbus_event``. KeyboardInterrupt and other
        BaseExceptions pass through untouched.
        """
        n = self.count(event)
        if event.index < len(self.callers):  # else an event of your own nobody listens to
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
        only cleanup handlers run. Returns the failures (each noted by ``note_handler``, as raised),
        in order; the caller raises or notes them. A KeyboardInterrupt / SystemExit from a handler lets
        the cleanup handlers after it run, then is raised. Never used per step: these events close blocks.
        """
        errors: list[Exception] = []
        interrupt: BaseException | None = None  # a KeyboardInterrupt / SystemExit a handler raised
        has_error = hasattr(payload, "error") and event in END_EVENTS
        trace = self._trace
        for record in self._handlers[event.index]:
            if ((has_error and payload.error is not None) or interrupt is not None) and not record.cleanup:
                continue
            flt = record.filter
            if flt is not None and not flt(n, payload):
                continue
            if trace is not None:
                trace.append((record.event.name, record.name))
            try:
                record.fn(payload)
            except Exception as exc:
                note_handler(exc, record.name, record.event.name)
                errors.append(exc)
                if has_error and payload.error is None:
                    payload.error = exc
            except BaseException as exc:  # Ctrl-C in a handler: the cleanup handlers after it run, then it goes on
                note_handler(exc, record.name, record.event.name)
                if interrupt is None:
                    interrupt = exc
                    if has_error and payload.error is None:
                        payload.error = exc
        if interrupt is not None:
            raise interrupt
        return errors

    def enable_trace(self) -> list[tuple[str, str]]:
        """Record (event, handler) for every handler call from now on; returns the list."""
        trace: list[tuple[str, str]] = []
        self.trace = trace
        return trace
