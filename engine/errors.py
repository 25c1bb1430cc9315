"""Error types and control-flow exceptions of the engine.

Configuration errors are raised at construction time and name the bad value and what is
allowed. Each is a ``ConfigError`` (a ``ValueError``); where transformers raises another type for the
same mistake, the subclass named after that type is an instance of both, so ``except RuntimeError``
in a ported script still catches it. Handler failures are wrapped so the message names the handler and the event.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


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
