"""The assembly side of an Engine: hook wrappers, plugins, and their checkpointed state.

``Engine`` inherits this; keeping it apart leaves ``loop.py`` about the loop. Hooks are composed
from a base ``Hooks`` and an ordered list of wrappers, so removing one wrapper keeps the others.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from trainbus.hooks import Hooks
from trainbus.hooks import to_device as default_to_device

from .errors import ConfigError, suggest
from .plugin import Plugin
from .state import State

HookWrapper = Callable[[Callable[..., Any]], Callable[..., Any]]


class Assembly:
    """Hook composition and plugin management (mixed into ``Engine``)."""

    _base_hooks: Hooks
    _wrappers: list[tuple[object, str, HookWrapper]]
    _device: torch.device
    _move_batches: bool
    hooks: Hooks
    plugins: list[Plugin]
    state: State

    # -- hooks ---------------------------------------------------------------------------------
    def set_hook(self, name: str, fn: Callable[..., Any]) -> None:
        """Replace the base step function ``name``; wrappers from plugins stay around it."""
        self._check_hook_name(name)
        self._base_hooks = replace(self._base_hooks, **{name: fn})
        self._compose_hooks()

    def wrap_hook(self, name: str, wrapper: HookWrapper) -> object:
        """Wrap hook ``name``: ``wrapper(inner) -> outer``. Later wrappers sit outside earlier ones.

        Returns a token for ``unwrap_hook``. Removing a middle wrapper keeps the others intact.
        """
        self._check_hook_name(name)
        token = object()
        self._wrappers.append((token, name, wrapper))
        self._compose_hooks()
        return token

    def unwrap_hook(self, token: object) -> None:
        self._wrappers = [w for w in self._wrappers if w[0] is not token]
        self._compose_hooks()

    def _check_hook_name(self, name: str) -> None:
        if name not in Hooks.names():
            raise ConfigError(f"unknown hook {name!r}{suggest(name, Hooks.names())}; hooks: {', '.join(Hooks.names())}")

    def _compose_hooks(self) -> None:
        hooks = replace(self._base_hooks)  # always a new object: the loop re-reads hooks when it changes
        for _token, name, wrapper in self._wrappers:
            hooks = replace(hooks, **{name: wrapper(getattr(hooks, name))})
        self.hooks = hooks
        # batches from a DataLoader are CPU tensors: with the default hook and a CPU model,
        # moving them is a no-op we skip on the hot path
        self._move_batches = hooks.to_device is not default_to_device or self._device.type != "cpu"

    # -- plugins -------------------------------------------------------------------------------
    def add_plugin(self, plugin: Plugin) -> Plugin:
        """Attach ``plugin``; its name must be unique in this engine."""
        if not isinstance(plugin, Plugin):
            raise ConfigError(f"expected a trainbus Plugin, got {type(plugin).__name__}")
        if any(p.name == plugin.name for p in self.plugins):
            raise ConfigError(f"a plugin named {plugin.name!r} is already attached; give the new one another name")
        plugin.attach(self)  # type: ignore[arg-type]  # only Engine mixes this in
        self.plugins.append(plugin)
        return plugin

    def get_plugin(self, which: type[Plugin] | str) -> Plugin | None:
        """The first attached plugin of that class (or subclass) or name, else None."""
        for plugin in self.plugins:
            if (isinstance(which, str) and plugin.name == which) or (
                isinstance(which, type) and isinstance(plugin, which)
            ):
                return plugin
        return None

    def pop_plugin(self, which: Plugin | type[Plugin] | str) -> Plugin | None:
        """Detach and return a plugin given as instance, class or name; None when absent."""
        plugin = which if isinstance(which, Plugin) else self.get_plugin(which)
        if plugin is None or plugin not in self.plugins:
            return None
        plugin.detach(self)  # type: ignore[arg-type]
        self.plugins.remove(plugin)
        return plugin

    def remove_plugin(self, which: Plugin | type[Plugin] | str) -> None:
        self.pop_plugin(which)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The run's state and every plugin's state, keyed by plugin name."""
        return {"state": self.state.to_dict(), "plugins": {p.name: p.state_dict() for p in self.plugins}}

    def load_state_dict(self, data: Mapping[str, Any]) -> None:
        missing = [name for name in data.get("plugins", {}) if self.get_plugin(name) is None]
        if missing:
            attached = [p.name for p in self.plugins]
            raise ConfigError(f"state has plugins {missing} that this engine lacks; attached plugins: {attached}")
        self.state = State.from_dict(dict(data["state"]))
        for name, plugin_state in data.get("plugins", {}).items():
            plugin = self.get_plugin(name)
            assert plugin is not None
            plugin.load_state_dict(plugin_state)
