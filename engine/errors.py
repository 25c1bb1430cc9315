"""Error types and control-flow exceptions of the engine.

Configuration errors are raised at construction time and name the bad value and what is
allowed. Each is a ``ConfigError`` (a ``ValueError``); where transformers raises another type for the
same mistake, the subclass named after that type is an instance of both, so ``except RuntimeError``
in a ported script still catches it. A handler's failure is never wrapped: it reaches the caller as
itself, with the handler and the event attached by ``note_handler``.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import warnings
from collections.abc import Iterable
from typing import Any


class TrainbusError(Exception):
    """Base class of every error trainbus raises on purpose."""


class ConfigError(TrainbusError, ValueError):
    """A bad value given at construction time (a size, a name, an impossible combination)."""


class ConfigRuntimeError(ConfigError, RuntimeError):
    """A ``ConfigError`` where transformers raises ``RuntimeError`` (both ``optimizers`` and its cls_and_kwargs)."""


class ConfigTypeError(ConfigError, TypeError):
    """A ``ConfigError`` where transformers raises ``TypeError`` (an argument of the wrong kind)."""


class ConfigNotImplementedError(ConfigError, NotImplementedError):
    """A ``ConfigError`` where transformers raises ``NotImplementedError`` (a combination it does not support)."""


class ConfigImportError(ConfigError, ImportError):
    """A ``ConfigError`` where transformers raises ``ImportError`` (a package the choice needs is missing)."""


class ConfigKeyError(ConfigError, KeyError):
    """A ``ConfigError`` where transformers raises ``KeyError`` (a metric name the evaluation does not return)."""

    def __str__(self) -> str:  # KeyError quotes its argument; the message reads as every other error's
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class ConfigAssertionError(ConfigError, AssertionError):
    """A ``ConfigError`` where transformers asserts (``EarlyStoppingCallback`` without ``metric_for_best_model``)."""


def note_handler(error: BaseException, handler: str, event: str) -> None:
    """Attach the failing handler and its event to ``error``, which then propagates as itself.

    Sets ``error.trainbus_handler`` / ``error.trainbus_event`` to the innermost handler (the one that
    raised; an outer dispatch keeps them) and adds a PEP 678 note per handler it passed through,
    innermost first, so the traceback reads ``raised by handler 'X' at event LOSS``.
    """
    if getattr(error, "trainbus_handler", None) is None:
        with contextlib.suppress(AttributeError):  # an exception type with __slots__: the note still says it
            error.trainbus_handler = handler  # type: ignore[attr-defined]
            error.trainbus_event = event  # type: ignore[attr-defined]
    note = f"raised by handler {handler!r} at event {event}"
    notes = getattr(error, "__notes__", None)
    if notes is not None and note in notes:
        return
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10: no add_note, but tools that know PEP 678 read __notes__
        with contextlib.suppress(AttributeError):
            error.__notes__ = [*(notes or []), note]  # type: ignore[attr-defined]


class _HandlerError(TrainbusError, RuntimeError):
    """Deprecated: the engine no longer raises it (see ``note_handler``); kept so old imports still work."""

    def __init__(self, handler: str, event: str, cause: BaseException) -> None:
        super().__init__(f"handler {handler!r} failed at event {event}: {type(cause).__name__}: {cause}")
        self.handler = handler
        self.event = event


_HandlerError.__name__ = _HandlerError.__qualname__ = "HandlerError"

HANDLER_ERROR_GONE = (
    "trainbus.engine.HandlerError is deprecated and never raised: a handler's exception reaches the caller as "
    "itself (catch its own type); the handler and the event are on it as trainbus_handler / trainbus_event "
    "and in a note"
)


def __getattr__(name: str) -> Any:  # PEP 562: warn on the deprecated name only
    if name == "HandlerError":
        warnings.warn(HANDLER_ERROR_GONE, DeprecationWarning, stacklevel=2)
        return _HandlerError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def check_flag(name: str, value: object, *, allow_none: bool = False) -> None:
    """Raise ConfigTypeError naming ``name`` unless ``value`` is True or False (or None when allowed)."""
    if isinstance(value, bool) or (value is None and allow_none):
        return
    allowed = "True, False or None" if allow_none else "True or False"
    raise ConfigTypeError(f"{name} must be {allowed}, got {value!r:.80} ({type(value).__name__})")


def check_callable(name: str, value: object, what: str, *, allow_none: bool = True) -> None:
    """Raise ConfigTypeError naming ``name`` unless ``value`` is callable (or None when allowed); ``what`` says how."""
    if callable(value) or (value is None and allow_none):
        return
    none = " or None" if allow_none else ""
    raise ConfigTypeError(f"{name} must be {what}{none}, got {value!r:.80} ({type(value).__name__})")


def check_path(name: str, value: object) -> None:
    """Raise ConfigTypeError naming ``name`` unless ``value`` is a non-empty path (a str or an os.PathLike)."""
    if isinstance(value, str | os.PathLike) and os.fspath(value) != "":
        return
    raise ConfigTypeError(f"{name} must be a path (a non-empty str or pathlib.Path), got {value!r:.80} "
                          f"({type(value).__name__})")  # fmt: skip
