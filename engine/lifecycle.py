"""Blocks that always close: fit, its epochs, evaluate and predict fire their END even when they fail.

``Engine`` inherits this. Each block pushes its END on ``_open_ends`` before its START fires and
pops it when the END fires normally; what is left on the stack when an exception passes through is
exactly what is still open. The failure path lives here and in one ``try`` per call of fit /
evaluate / predict (and none per step), so the hot loop pays nothing for it:

1. ``EXCEPTION`` fires once per failure, at the innermost call it passes through (an evaluation
   inside fit fires it, fit sees it was announced and does not fire it again);
2. each END still open fires, innermost first, with ``payload.error`` set, to cleanup handlers only
   (see ``EventBus.on(cleanup=True)``);
3. the exception is re-raised unchanged. A handler that fails during 1 or 2 does not hide it: its
   error is logged and added to the original as a note, and the remaining handlers still run.

An END that fires normally runs its cleanup handlers even when an earlier handler of it failed; the
first failure then propagates from the END (and is announced by EXCEPTION like any other failure).
A KeyboardInterrupt (Ctrl-C) or SystemExit raised by a handler while ENDs close after a failure does
not stop the closing: the ENDs outside still fire to their cleanup handlers, then it is raised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .bus import EventBus
from .events import Event, EventType, ExceptionEvent, Payload

logger = logging.getLogger("trainbus.engine")
EXCEPTION = Event.EXCEPTION

#: an END still open: its event, and how to build its payload (the error is set on failure)
OpenEnd = tuple[EventType[Any], Callable[[], Payload]]


class Lifecycle:
    """The open-END stack and the failure path (mixed into ``Engine``)."""

    bus: EventBus
    _open_ends: list[OpenEnd]
    #: the failure EXCEPTION was last fired for, so outer blocks do not announce it again
    _announced: BaseException | None

    def _open(self, event: EventType[Any], make: Callable[[], Payload]) -> int:
        """Push a block's END before its START fires; returns the depth to close back to."""
        depth = len(self._open_ends)
        self._open_ends.append((event, make))
        return depth

    def _close(self, depth: int) -> Any:
        """Fire the END of the block opened at ``depth`` (normal path); returns its payload.

        The END is popped before it fires, so a failure inside it is not closed a second time.
        """
        event, make = self._open_ends.pop()
        assert len(self._open_ends) == depth, "blocks closed out of order"
        if depth == 0:
            self._announced = None  # the outermost block finished: nothing to remember
        bus = self.bus
        n = bus.count(event)
        payload = make()
        if bus.has_handlers(event):
            errors = bus.dispatch_each(event, payload, n)
            if errors:
                _note_others(errors[0], errors[1:], f"while {event.name} ran")
                raise errors[0]
        return payload

    def _fail(self, error: BaseException, depth: int, during: str) -> None:
        """The failure path of a block opened at ``depth``: EXCEPTION once, then the ENDs still open.

        The caller re-raises ``error``; nothing here raises an Exception.
        """
        bus = self.bus
        interrupts: list[BaseException] = []  # a Ctrl-C in a handler here: every END still closes, then it is raised
        if error is not self._announced:
            self._announced = error
            n = bus.count(EXCEPTION)
            if bus.has_handlers(EXCEPTION):
                payload = ExceptionEvent(self, error, during)  # type: ignore[arg-type]  # only Engine mixes this in
                _note_others(error, _each(bus, EXCEPTION, payload, n, interrupts), "while EXCEPTION ran")
        while len(self._open_ends) > depth:
            event, make = self._open_ends.pop()
            n = bus.count(event)
            if bus.has_handlers(event):
                end = make()
                end.error = error  # type: ignore[attr-defined]  # every END payload has it
                others = _each(bus, event, end, n, interrupts)
                _note_others(error, others, f"while {event.name} closed after the failure")
        if depth == 0:
            self._announced = None
        if interrupts:
            raise interrupts[0]  # the caller's error is its __context__


def _each(
    bus: EventBus, event: EventType[Any], payload: Any, n: int, interrupts: list[BaseException]
) -> list[Exception]:
    """``bus.dispatch_each``; a KeyboardInterrupt / SystemExit it lets through is kept in ``interrupts``, not raised,
    so that the ENDs outside this one still close (the output_dir lock is released in TRAIN_END's cleanup)."""
    try:
        return bus.dispatch_each(event, payload, n)
    except BaseException as interrupt:
        if isinstance(interrupt, Exception):  # dispatch_each returns handler failures: this is its own
            raise
        interrupts.append(interrupt)
        return []


def _note_others(error: BaseException, others: list[Exception], when: str) -> None:
    """Log handler failures that happened while closing, and note them on ``error``, which propagates."""
    for other in others:
        logger.error("a handler failed %s (%s is raised): %s", when, type(error).__name__, other, exc_info=other)
        if hasattr(error, "add_note"):
            error.add_note(f"also, {when}: {type(other).__name__}: {other}")
