"""Checks of a composition when fit() starts: order declarations that name nothing, plugins that would do nothing.

Both run once per fit(), before TRAIN_START, over what is attached then (a constraint naming a
handler not registered *yet* is fine at registration: plugins attach in any order).

1. Every ``before=`` / ``after=`` name must name something: a handler or plugin of this engine, a
   plugin class defined in the process, a name exported (``__all__``) by a package an attached
   plugin comes from (an optional peer not imported yet: EMA names ``"HalfPrecisionEval"``, which
   ``trainbus.plugins`` exports lazily), or a name registered with ``ordering.register_order_names``.
   Anything else is a typo that would silently order nothing: a ConfigError naming the handler, the
   event and the close names.
2. Each plugin's ``check_composition(composition)`` sees the plugins, the handlers and what the
   plugins schedule (``Plugin.schedules()``: log / evaluate / save / stop requests), and returns
   what is missing for it to do anything (EarlyStopping with no evaluation scheduled); each problem
   is a ``CompositionWarning`` naming the plugin. A plugin may raise ConfigError instead.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from .bus import EventBus
from .errors import ConfigError, suggest
from .ordering import EVERY, REGISTERED_NAMES, Registration
from .plugin import SCHEDULES, Composition, CompositionWarning, Plugin

__all__ = ["CompositionWarning", "check_composition", "check_order_targets"]


def _subclasses(cls: type[Plugin]) -> Iterator[type[Plugin]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _peer_names(plugins: Sequence[Plugin]) -> set[str]:
    """Names exported by the (already imported) packages the attached plugins' classes come from."""
    names: set[str] = set()
    for module in {type(plugin).__module__ for plugin in plugins}:
        parts = module.split(".")
        for end in range(1, len(parts) + 1):
            names.update(getattr(sys.modules.get(".".join(parts[:end])), "__all__", ()))
    return names


def _resolves(target: str, records: Sequence[Registration], names: set[str], classes: dict[str, type]) -> bool:
    if target in names or target in classes or target in REGISTERED_NAMES:
        return True
    if any(record.names(target) for record in records):
        return True
    owner, dot, method = target.partition(".")
    if not dot:
        return False
    return owner in REGISTERED_NAMES or (owner in classes and hasattr(classes[owner], method))


def check_order_targets(bus: EventBus, plugins: Sequence[Plugin]) -> None:
    """Raise ConfigError for the first ``before=`` / ``after=`` that names nothing (see the module docstring)."""
    records = bus.registrations()
    names = {r.name for r in records} | {p.name for p in plugins} | {type(p).__name__ for p in plugins}
    classes: dict[str, type] = {}
    for record in records:
        for direction, targets in (("before", record.before), ("after", record.after)):
            for target in targets:
                if target == EVERY:
                    continue
                if not classes:  # only built when a declaration names something: most engines have none
                    classes = {cls.__name__: cls for cls in _subclasses(Plugin)} or {"Plugin": Plugin}
                    names |= _peer_names(plugins)
                if _resolves(target, records, names, classes):
                    continue
                attached = sorted({p.name for p in plugins})
                raise ConfigError(
                    f"handler {record.name!r} at event {record.event.name} says {direction}={target!r}, which names "
                    f"no handler or plugin of this engine{suggest(target, names | set(classes))}; attached plugins: "
                    f"{attached}. Name a handler ('Plugin.method', as engine.describe() lists them), a plugin, "
                    "or '*'"
                )


def check_composition(engine: Any) -> None:
    """Ask every attached plugin what it lacks (``Plugin.check_composition``); warn for each answer."""
    plugins: Sequence[Plugin] = engine.plugins
    scheduled: set[str] = set()
    for plugin in plugins:
        requests = set(plugin.schedules())
        if unknown := requests - SCHEDULES:
            name = sorted(unknown)[0]
            raise ConfigError(
                f"plugin {plugin.name!r} schedules {name!r}{suggest(name, SCHEDULES)}; "
                f"schedules() returns some of {sorted(SCHEDULES)}"
            )
        scheduled |= requests
    composition = Composition(
        tuple(plugins),
        {name: tuple(handlers) for name, handlers in engine.describe().items()},
        frozenset(scheduled),
        engine.has_eval_data,  # not eval_data: a facade would build its loaders before HF does
    )
    for plugin in plugins:
        for problem in plugin.check_composition(composition) or ():
            warnings.warn(f"{plugin.name}: {problem}", CompositionWarning, stacklevel=3)
