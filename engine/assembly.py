"""The assembly side of an Engine: hook wrappers, plugins, and their checkpointed state.

``Engine`` inherits this; keeping it apart leaves ``loop.py`` about the loop. Hooks are composed
from a base ``Hooks`` and an ordered list of wrappers, so removing one wrapper keeps the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar, overload

import torch

from trainbus.hooks import Hooks
from trainbus.hooks import to_device as default_to_device

from .bus import EventBus
from .composition import check_composition, check_order_targets
from .errors import ConfigError, suggest
from .events import EventType, P, event_by_name, is_built_in
from .plugin import Plugin, check_state
from .signatures import check_hook, check_wrapper, describe_callable
from .state import State

HookWrapper = Callable[[Callable[..., Any]], Callable[..., Any]]
PluginT = TypeVar("PluginT", bound=Plugin)
D = TypeVar("D")
_REQUIRED: Any = object()  # get_plugin's default when none is given: an unknown name raises
_DEFAULT_HOOKS = Hooks()


class _Wrapping:
    """The token ``wrap_hook`` returns: who wrapped, and whether the wrapper sits innermost."""

    __slots__ = ("innermost", "owner")

    def __init__(self, owner: str, innermost: bool) -> None:
        self.owner = owner
        self.innermost = innermost

    def __repr__(self) -> str:
        return f"<hook wrapper from {self.owner}{', innermost' if self.innermost else ''}>"


class UnknownPluginError(ConfigError, LookupError):
    """``get_plugin(name)`` found no plugin of that name; the message suggests the close ones."""


class Assembly:
    """Hook composition and plugin management (mixed into ``Engine``)."""

    _base_hooks: Hooks
    _wrappers: list[tuple[object, str, HookWrapper]]
    _device: torch.device
    _move_batches: bool
    bus: EventBus
    hooks: Hooks
    plugins: list[Plugin]
    state: State

    # -- hooks ---------------------------------------------------------------------------------
    def set_hook(self, name: str, fn: Callable[..., Any]) -> None:
        """Replace the base step function ``name``; wrappers from plugins stay around it.

        ``fn`` must take the call the loop makes (``forward(model, batch)``, see ``HOOK_CALLS``):
        checked now, so a wrong signature fails here naming the hook, not inside fit()."""
        self._check_hook_name(name)
        previous = self._base_hooks
        self._base_hooks = replace(self._base_hooks, **{name: fn})
        try:
            self._compose_hooks()
        except ConfigError:
            self._base_hooks = previous
            raise

    def wrap_hook(
        self, name: str, wrapper: HookWrapper, *, owner: str | None = None, innermost: bool = False
    ) -> object:
        """Wrap hook ``name``: ``wrapper(inner) -> outer``. Later wrappers sit outside earlier ones.

        So a wrapper added after the plugins attached (``Engine(plugins=...)`` then
        ``engine.wrap_hook``) is the outermost: it runs before and after theirs, outside MixedPrecision's
        autocast. ``innermost=True`` puts it right around the base function instead, inside every
        other wrapper (several innermost ones: later outside earlier). ``owner`` names it in
        ``describe_hooks()`` (a plugin's ``wrap_hook`` passes its name). The wrapper and the function
        it returns are checked now against the call the loop makes; a mismatch raises ConfigError
        naming the hook and the wrapper, and nothing is wrapped.

        Returns a token for ``unwrap_hook``. Removing a middle wrapper keeps the others intact.
        """
        self._check_hook_name(name)
        check_wrapper(name, wrapper, owner)
        token = _Wrapping(owner or describe_callable(wrapper), innermost)
        self._wrappers.append((token, name, wrapper))
        try:
            self._compose_hooks()
        except ConfigError:
            self.unwrap_hook(token)
            raise
        return token

    def unwrap_hook(self, token: object) -> None:
        self._wrappers = [w for w in self._wrappers if w[0] is not token]
        self._compose_hooks()

    def describe_hooks(self) -> dict[str, list[str]]:
        """Every hook -> its base function, then the wrappers around it from the innermost out
        (named by their plugin, or the owner given to ``wrap_hook``)."""
        layers = {name: [describe_callable(getattr(self._base_hooks, name))] for name in Hooks.names()}
        for token, name, _wrapper in self._wrapping_order():
            layers[name].append(token.owner if isinstance(token, _Wrapping) else "wrapper")
        return layers

    def _check_hook_name(self, name: str) -> None:
        if name not in Hooks.names():
            raise ConfigError(f"unknown hook {name!r}{suggest(name, Hooks.names())}; hooks: {', '.join(Hooks.names())}")

    def _wrapping_order(self) -> list[tuple[object, str, HookWrapper]]:
        """The wrappers from the innermost out: ``innermost=True`` ones first, each group in registration order."""
        inner = [w for w in self._wrappers if getattr(w[0], "innermost", False)]
        return inner + [w for w in self._wrappers if not getattr(w[0], "innermost", False)]

    def _compose_hooks(self) -> None:
        hooks = replace(self._base_hooks)  # always a new object: the loop re-reads hooks when it changes
        for name in Hooks.names():
            fn = getattr(hooks, name)
            if fn is not getattr(_DEFAULT_HOOKS, name):
                check_hook(name, fn, "set_hook / Hooks(...) gave")
        for token, name, wrapper in self._wrapping_order():
            outer = wrapper(getattr(hooks, name))
            owner = token.owner if isinstance(token, _Wrapping) else describe_callable(wrapper)
            check_hook(name, outer, f"the wrapper from {owner} returned")
            hooks = replace(hooks, **{name: outer})
        self.hooks = hooks
        # batches from a DataLoader are CPU tensors: with the default hook and a CPU model,
        # moving them is a no-op we skip on the hot path
        self._move_batches = hooks.to_device is not default_to_device or self._device.type != "cpu"

    # -- events of your own ---------------------------------------------------------------------
    def fire(self, event: EventType[P] | str, payload: P) -> P:
        """Fire an event of your own (``EventType(name, PayloadClass)``) and return its payload.

        Its handlers run now, in their order (phases, ``before`` / ``after``), those with a filter on
        the occurrences it selects (counted in ``state.event_counts``, so also across a resume); a
        handler's exception reaches the caller as for the loop's events. Call it from a handler or a
        hook. The loop's own events (``Event.X``) are fired by the loop only.

        Example:
            >>> from dataclasses import dataclass
            >>> from trainbus.engine import Engine, EventType, Payload
            >>> @dataclass
            ... class SpikeEvent(Payload):
            ...     value: float
            >>> SPIKE = EventType("DOC_SPIKE", SpikeEvent)
            >>> engine = Engine(torch.nn.Linear(1, 1))
            >>> _ = engine.on(SPIKE(every=2), lambda ev: print("spike", ev.value))
            >>> for value in (1.0, 2.0, 3.0, 4.0):
            ...     _ = engine.fire(SPIKE, SpikeEvent(engine, value))
            spike 2.0
            spike 4.0
        """
        if isinstance(event, str):
            event = event_by_name(event)
        if not isinstance(event, EventType):
            raise ConfigError(f"fire() takes an event of your own, EventType(name, PayloadClass), got {event!r}")
        if is_built_in(event):
            raise ConfigError(
                f"Event.{event.name} is the loop's own event, fired by the loop only; define an event of your own "
                "with EventType(name, PayloadClass) and fire that"
            )
        if not isinstance(payload, event.payload_type):
            raise ConfigError(
                f"event {event.name} carries a {event.payload_type.__name__}, got {type(payload).__name__}; "
                f"fire({event.name}, {event.payload_type.__name__}(engine, ...))"
            )
        self.bus.fire(event, payload)
        return payload

    # -- plugins -------------------------------------------------------------------------------
    def add_plugin(self, plugin: PluginT) -> PluginT:
        """Attach ``plugin``; its name must be unique in this engine.

        The plugin's contract is checked now rather than at the first checkpoint, hours later: its
        ``state_dict()`` must be something a checkpoint can hold (``check_state``: the checkpoint
        codec's rules). A plugin that fails the check is detached again before the error is raised.
        """
        if not isinstance(plugin, Plugin):
            raise ConfigError(f"expected a trainbus Plugin, got {type(plugin).__name__}")
        if any(p.name == plugin.name for p in self.plugins):
            raise ConfigError(f"a plugin named {plugin.name!r} is already attached; give the new one another name")
        try:
            plugin.attach(self)  # type: ignore[arg-type]  # only Engine mixes this in
        except Exception:  # e.g. a handler order that cannot hold: undo the registrations made so far
            Plugin.detach(plugin, self)  # type: ignore[arg-type]  # the base's: the plugin never finished attaching
            raise
        try:
            check_state(plugin.state_dict(), f"plugins/{plugin.name}")
        except Exception as exc:
            plugin.detach(self)  # type: ignore[arg-type]
            raise ConfigError(
                f"plugin {plugin.name!r} breaks the plugin contract, found when it was attached rather than at "
                f"the first checkpoint: {exc}"
            ) from exc
        self.plugins.append(plugin)
        return plugin

    @overload
    def get_plugin(self, which: type[PluginT]) -> PluginT | None: ...
    @overload
    def get_plugin(self, which: str) -> Plugin: ...
    @overload
    def get_plugin(self, which: str, default: D) -> Plugin | D: ...
    def get_plugin(self, which: type[Plugin] | str, default: Any = _REQUIRED) -> Any:
        """The first attached plugin of that class (or subclass), or the plugin of that name.

        A class that no attached plugin is an instance of gives None (asking whether an optional
        feature is there). A name is a key the caller spelled: an unknown one raises
        ``UnknownPluginError`` suggesting the close names, unless a ``default`` is given
        (``get_plugin("MemoryMetrics", None)`` asks whether that plugin is attached).
        """
        if isinstance(which, type):
            return next((p for p in self.plugins if isinstance(p, which)), None)
        for plugin in self.plugins:
            if plugin.name == which:
                return plugin
        if default is not _REQUIRED:
            return default
        attached = [p.name for p in self.plugins]
        raise UnknownPluginError(
            f"no plugin named {which!r} is attached{suggest(str(which), attached)}; attached plugins: {attached} "
            "(pass a default, get_plugin(name, None), to ask whether one is attached)"
        )

    def pop_plugin(self, which: Plugin | type[Plugin] | str) -> Plugin | None:
        """Detach and return a plugin given as instance, class or name; None when absent."""
        if isinstance(which, Plugin):
            plugin: Plugin | None = which
        else:
            plugin = self.get_plugin(which, None) if isinstance(which, str) else self.get_plugin(which)
        if plugin is None or plugin not in self.plugins:
            return None
        plugin.detach(self)  # type: ignore[arg-type]
        self.plugins.remove(plugin)
        return plugin

    def remove_plugin(self, which: Plugin | type[Plugin] | str) -> None:
        self.pop_plugin(which)

    def describe(self) -> dict[str, list[str]]:
        """Every event that has handlers, in loop order -> its handlers' names in the order they run.

        Handlers are named ``<plugin>.<method>`` (or the ``name`` given to ``on``); the names are
        what ``before=`` / ``after=`` take.
        """
        return self.bus.describe()

    def check_composition(self) -> None:
        """What fit() checks before TRAIN_START (``composition.py``): a ``before=`` / ``after=`` naming
        nothing is a ConfigError suggesting the close names; a plugin that would do nothing (its
        ``check_composition``) gets a ``CompositionWarning`` naming what is missing."""
        check_order_targets(self.bus, self.plugins)
        check_composition(self)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run's state and every plugin's state, keyed by plugin name."""
        return {"state": self.state.to_dict(), "plugins": {p.name: p.state_dict() for p in self.plugins}}

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        missing = [name for name in data.get("plugins", {}) if self.get_plugin(name, None) is None]
        if missing:
            attached = [p.name for p in self.plugins]
            raise ConfigError(f"state has plugins {missing} that this engine lacks; attached plugins: {attached}")
        self.state = State.from_dict(dict(data["state"]))
        for name, plugin_state in data.get("plugins", {}).items():
            self.get_plugin(name).load_state_dict(plugin_state)
