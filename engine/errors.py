"""Error types and control-flow exceptions of the engine.

Configuration errors are raised at construction time and name the bad value and what is
allowed. Handler failures are wrapped so the message names the handler and the event.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class TrainbusError(Exception):
    """Base class of every error trainbus raises on purpose."""


class ConfigError(TrainbusError, ValueError):
    """A bad value given at construction time (a size, a name, an impossible combination)."""


class HandlerError(TrainbusError, RuntimeError):
    """A handler raised while an event was dispatched.

    Attributes:
        handler: the handler's name (``plugin.method`` or the function's qualified name).
        event: the event's name.
    """

    def __init__(self, handler: str, event: str, cause: BaseException) -> None:
        super().__init__(f"handler {handler!r} failed at event {event}: {type(cause).__name__}: {cause}")
        self.handler = handler
        self.event = event


def suggest(name: str, allowed: Iterable[str]) -> str:
    """Return ``"; did you mean 'x'?"`` when ``name`` is close to one of ``allowed``, else ``""``."""
    close = difflib.get_close_matches(name, list(allowed), n=3, cutoff=0.6)
    if not close:
        return ""
    return "; did you mean " + " or ".join(repr(c) for c in close) + "?"


def check_positive_int(name: str, value: object, *, allow_none: bool = False, minimum: int = 1) -> None:
    """Raise ConfigError naming ``name`` unless ``value`` is an int >= ``minimum``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
