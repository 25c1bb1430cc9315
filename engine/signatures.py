"""Signature checks at registration: a handler or a hook that cannot take what the loop passes fails
when it is registered, naming the event or the hook and the call it must accept, not at its first call
inside fit() with a bare "<lambda>() takes 1 positional argument but 2 were given". The error is a
``ConfigTypeError``: a ConfigError, and a TypeError as Python's own would be.

``inspect.signature`` is asked once per registration (``on``, ``set_hook``, ``wrap_hook``), never per
step. A callable whose signature Python cannot tell (some builtins, C extensions) is not checked.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .errors import ConfigTypeError
from .events import EventType

#: how the loop calls each hook of ``trainbus.hooks.Hooks`` (positional arguments, in order)
HOOK_CALLS: dict[str, tuple[str, ...]] = {
    "to_device": ("batch", "device"),
    "forward": ("model", "batch"),
    "compute_loss": ("outputs", "batch"),
    "backward": ("loss",),
    "optimizer_step": ("optimizer",),
    "zero_grad": ("optimizer",),
    "prediction_step": ("model", "batch", "forward", "compute_loss", "label_names"),
    "epoch_iterator": ("data", "epoch", "skip_batches"),
    "eval_data": ("data",),
}


def hook_call(hook: str) -> str:
    """``forward(model, batch)``: the call the loop makes to ``hook``."""
    return f"{hook}({', '.join(HOOK_CALLS[hook])})"


def _refusal(fn: Callable[..., Any], args: int) -> str | None:
    """Why ``fn`` cannot be called with ``args`` positional arguments, or None (also when unknown)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read: a builtin, a C callable
        return None
    try:
        signature.bind(*range(args))
    except TypeError as exc:
        return f"{describe_callable(fn)}{signature}, which cannot take that call ({exc})"
    return None


def describe_callable(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a function (or the class of a callable object), for messages."""
    target = getattr(fn, "func", fn)  # functools.partial
    name = getattr(target, "__qualname__", None)
    if not isinstance(name, str):
        return repr(target)[:80]  # a callable object without a name: operator.methodcaller('step')
    module = getattr(target, "__module__", None)
    return f"{module}.{name}" if module and module != "builtins" else name


def check_handler(event: EventType[Any], fn: Callable[..., Any], name: str) -> None:
    """Raise ConfigTypeError when ``fn`` cannot be called as ``handler(payload)``."""
    refusal = _refusal(fn, 1)
    if refusal is not None:
        raise ConfigTypeError(
            f"handler {name!r} for event {event.name} is called as handler(payload), the payload a "
            f"{event.payload_type.__name__}; it is {refusal}. Take one argument: def handler(ev: "
            f"{event.payload_type.__name__}) -> None, a plugin's method def method(self, ev), or lambda ev: ..."
        )


def check_hook(hook: str, fn: Any, source: str) -> None:
    """Raise ConfigTypeError when ``fn`` cannot serve ``hook``; ``source`` says where it came from, as
    "the wrapper from MixedPrecision returned" or "set_hook / Hooks(...) gave"."""
    if not callable(fn):
        raise ConfigTypeError(f"hook {hook!r} must be a function callable as {hook_call(hook)}; {source} {fn!r:.80}")
    refusal = _refusal(fn, len(HOOK_CALLS[hook]))
    if refusal is not None:
        raise ConfigTypeError(f"hook {hook!r} is called as {hook_call(hook)}; {source} {refusal}")


def check_hooks(hooks: Any, source: str = "Hooks(...) gave") -> None:
    """Check every field of a ``trainbus.hooks.Hooks`` (what an Engine is given), as ``check_hook`` does."""
    for hook in HOOK_CALLS:
        check_hook(hook, getattr(hooks, hook), source)


def check_wrapper(hook: str, wrapper: Any, owner: str | None) -> None:
    """Raise ConfigTypeError when ``wrapper`` is not a function ``wrapper(inner) -> outer``."""
    who = f" (from {owner})" if owner else ""
    example = f"lambda inner: lambda {', '.join(HOOK_CALLS[hook])}: inner({', '.join(HOOK_CALLS[hook])})"
    if not callable(wrapper) or _refusal(wrapper, 1) is not None:
        raise ConfigTypeError(
            f"wrap_hook({hook!r}, wrapper){who}: the wrapper is called once as wrapper(inner), inner being the "
            f"{hook} below it, and returns the new {hook_call(hook)}; got {wrapper!r}. E.g. {example}"
        )


__all__ = [
    "HOOK_CALLS", "check_handler", "check_hook", "check_hooks", "check_wrapper", "describe_callable", "hook_call",
]  # fmt: skip
