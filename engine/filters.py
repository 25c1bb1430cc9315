"""Event filters: fire a handler only on some occurrences of an event.

A filter sees an occurrence number ``n`` (from 1): the step number for the events of a step, the
micro-batch number for micro-batch events, the firings of the event otherwise (see
``EventType.__call__``); all are kept in State, so they survive a checkpoint.
Filters combine: ``a | b`` fires when either does, ``a & b`` when both do;
``Event.STEP_END(every=100) | Event.STEP_END(once=1)`` registers one handler for both. A filter knows
no event: ``FilteredEvent`` (an event with its filter) lives in ``events.py``, above this module.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ConfigError, check_positive_int


class EventFilter:
    """A predicate over (occurrence number, payload). Build with ``EventFilter.make`` or combine with | and &."""

    __slots__ = ("_fn", "description")

    def __init__(self, fn: Callable[[int, Any], bool], description: str) -> None:
        self._fn = fn
        self.description = description

    def __call__(self, count: int, payload: Any) -> bool:
        return self._fn(count, payload)

    def __repr__(self) -> str:
        return f"EventFilter({self.description})"

    def __or__(self, other: EventFilter) -> EventFilter:
        a, b = self._fn, other._fn
        return EventFilter(lambda n, p: a(n, p) or b(n, p), f"({self.description}) | ({other.description})")

    def __and__(self, other: EventFilter) -> EventFilter:
        a, b = self._fn, other._fn
        return EventFilter(lambda n, p: a(n, p) and b(n, p), f"({self.description}) & ({other.description})")

    @staticmethod
    def make(
        *,
        every: int | None = None,
        once: int | None = None,
        before: int | None = None,
        after: int | None = None,
        when: Callable[[Any], bool] | None = None,
    ) -> EventFilter:
        """Build a filter; several arguments combine with AND. At least one is required.

        every=N: occurrences N, 2N, ...; once=N: occurrence N only; before=N: occurrences < N;
        after=N: occurrences > N; when=predicate(payload).
        """
        check_positive_int("every", every, allow_none=True)
        check_positive_int("once", once, allow_none=True)
        check_positive_int("before", before, allow_none=True, minimum=0)
        check_positive_int("after", after, allow_none=True, minimum=0)
        if when is not None and not callable(when):
            raise ConfigError(f"when must be a callable taking the payload, got {when!r}")
        parts: list[EventFilter] = []
        if every is not None:
            e = every
            parts.append(EventFilter(lambda n, _p: n % e == 0, f"every={e}"))
        if once is not None:
            o = once
            parts.append(EventFilter(lambda n, _p: n == o, f"once={o}"))
        if before is not None:
            b = before
            parts.append(EventFilter(lambda n, _p: n < b, f"before={b}"))
        if after is not None:
            a = after
            parts.append(EventFilter(lambda n, _p: n > a, f"after={a}"))
        if when is not None:
            w = when
            parts.append(EventFilter(lambda _n, p: bool(w(p)), f"when={getattr(w, '__name__', repr(w))}"))
        if not parts:
            raise ConfigError("an event filter needs at least one of every, once, before, after, when")
        result = parts[0]
        for part in parts[1:]:
            result = result & part
        return result
