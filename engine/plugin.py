"""The plugin base: a named object that registers handlers and wraps hooks, with state.

A plugin's ``attach(engine)`` registers what it needs through ``self.on`` and ``self.wrap_hook``;
the engine calls ``detach`` on removal, which undoes exactly those registrations. Its
``state_dict`` is saved with every checkpoint under ``name``, which must be unique in an engine.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

import torch

from .bus import Handle, Order, Priority, Targets
from .errors import ConfigError
from .events import EventType, FilteredEvent, P

if TYPE_CHECKING:
    from .view import EngineView


class Plugin:
    """Base class of features. Subclasses override ``attach`` and, when stateful, the state methods.

    Class attributes a subclass may set:

    - ``priority``: the phase of its handlers (``Priority.DEFAULT``), or a phase with constraints
      all of them keep, e.g. ``Priority.FIRST.before("HalfPrecisionEval")``.
    - ``not_resumed``: names of attributes that differ after a resume on purpose (a start time, a
      path, a cache), e.g. ``not_resumed = ("started_at",)``. The testing kit's
      ``check_resume_equivalence`` compares every other public plain-data attribute (numbers,
      strings, tensors, containers of them) of a resumed run with the uninterrupted one, so a
      counter that ``state_dict()`` forgets is found; an attribute listed here is not compared.
      A test may instead pass ``ignore_attributes=["Plugin.attribute"]`` to the check. Anything the
      run's result depends on belongs in ``state_dict()`` / ``load_state_dict()`` instead.
    - ``reads`` / ``writes``: per handler method, the payload fields it reads and writes, e.g.
      ``reads = {"eval_end": "metrics"}``: the same as ``reads=`` / ``writes=`` given to ``on``.
      A handler that writes a field runs before every other handler that reads it, in any plugin
      order; a reader placed in an earlier phase than a writer is a ConfigError naming both.

    Example:
        >>> from trainbus.engine import Plugin, Event
        >>> class CountSteps(Plugin):
        ...     def __init__(self):
        ...         self.steps = 0
        ...     def attach(self, engine):
        ...         self.on(engine, Event.STEP_END, self.step_end)
        ...     def step_end(self, ev):
        ...         self.steps += 1
        ...     def state_dict(self):
        ...         return {"steps": self.steps}
        ...     def load_state_dict(self, state):
        ...         self.steps = state["steps"]
    """

    #: default phase of this plugin's handlers (see ``Priority``), or a phase with constraints that
    #: all of them keep, e.g. ``Priority.FIRST.before("HalfPrecisionEval")``
    priority: int | Order = Priority.DEFAULT
    #: attributes that differ after a resume on purpose (a start time, a path, a cache): the testing
    #: kit's ``check_resume_equivalence`` compares every other plain-data attribute with the uninterrupted run
    not_resumed: ClassVar[tuple[str, ...]] = ()
    #: per handler method name, the payload fields it reads / writes (``{"eval_end": "metrics"}``), as if
    #: ``reads=`` / ``writes=`` were given to ``on``: writers of a field run before its readers
    reads: ClassVar[Mapping[str, Targets]] = {}
    writes: ClassVar[Mapping[str, Targets]] = {}

    @property
    def name(self) -> str:
        """Unique key of this plugin in an engine and in checkpoints; defaults to the class name."""
        return str(self.__dict__.get("_plugin_name") or type(self).__name__)

    @name.setter
    def name(self, value: str) -> None:
        self.__dict__["_plugin_name"] = value

    def attach(self, engine: Any) -> None:
        """Register handlers and hook wrappers on ``engine`` (an ``Engine``). Default: nothing.

        Typed ``Any`` here, below the loop, so that a subclass may annotate ``engine: Engine``."""

    def detach(self, engine: Any) -> None:
        """Undo every registration made through ``on`` and ``wrap_hook``."""
        for handle in self.__dict__.pop("_plugin_handles", []):
            handle.remove()
        for token in self.__dict__.pop("_plugin_wraps", []):
            engine.unwrap_hook(token)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state (tensors are allowed: checkpoints put them in safetensors)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    # -- composition (checked when fit() starts) ------------------------------------------------
    def schedules(self) -> Collection[str]:
        """What this plugin requests of the run through Control: some of "log", "evaluate", "save", "stop".

        Other plugins' ``check_composition`` read the union (``Composition.scheduled``): an EarlyStopping
        with nothing that schedules "evaluate" would never stop anything. Default: nothing.
        """
        return ()

    def check_composition(self, composition: Composition) -> Iterable[str] | None:
        """What this plugin lacks in ``composition`` to do anything; each line becomes a warning.

        Called by fit() before TRAIN_START (and by ``engine.check_composition()``). Return nothing when
        the plugin can work; raise ConfigError for a composition that must not run. Default: nothing.
        """
        return None

    # -- helpers for attach ------------------------------------------------------------------
    def on(
        self,
        engine: EngineView,
        event: EventType[P] | FilteredEvent[P],
        handler: Callable[[P], None],
        *,
        priority: int | Order | None = None,
        cleanup: bool = False,
        before: Targets = (),
        after: Targets = (),
        reads: Targets = (),
        writes: Targets = (),
    ) -> Handle:
        """Register ``handler`` and remember it for ``detach``; named ``<plugin>.<method>``.

        ``priority`` defaults to the plugin's ``priority``. ``before`` / ``after`` name the handlers
        it runs before / after inside its phase (handler or plugin names, ``"*"``; see ``EventBus.on``);
        others may name this one ``"<plugin>.<method>"``, or the plugin's name for all its handlers.

        ``cleanup=True`` (END events only): the handler also runs when the block failed, with
        ``payload.error`` set, e.g. to put back weights an evaluation swapped in. ``reads`` / ``writes``:
        the payload fields the handler reads / writes (see ``EventBus.on``), added to what the class
        declares for this method in ``reads`` / ``writes``.
        """
        label = getattr(handler, "__name__", type(handler).__name__)
        handle: Handle = engine.on(
            event,
            handler,
            priority=self.priority if priority is None else priority,
            name=f"{self.name}.{label}",
            cleanup=cleanup,
            before=before,
            after=after,
            reads=_fields(reads) + _fields(type(self).reads.get(label, ())),
            writes=_fields(writes) + _fields(type(self).writes.get(label, ())),
        )
        self.__dict__.setdefault("_plugin_handles", []).append(handle)
        return handle

    def wrap_hook(
        self,
        engine: EngineView,
        hook: str,
        wrapper: Callable[[Callable[..., Any]], Callable[..., Any]],
        *,
        innermost: bool = False,
    ) -> object:
        """Wrap one of ``engine.hooks`` (see ``Engine.wrap_hook``), named by this plugin in
        ``engine.describe_hooks()``; undone by ``detach``. A plugin attached later wraps outside."""
        token = engine.wrap_hook(hook, wrapper, owner=self.name, innermost=innermost)
        self.__dict__.setdefault("_plugin_wraps", []).append(token)
        return token


def _fields(targets: Targets) -> tuple[str, ...]:
    return (targets,) if isinstance(targets, str) else tuple(targets)


#: what ``Plugin.schedules()`` may name: the Control requests a plugin makes
SCHEDULES = frozenset({"log", "evaluate", "save", "stop"})
PluginT = TypeVar("PluginT", bound=Plugin)


class CompositionWarning(UserWarning):
    """A plugin would do nothing in this engine (found when fit() starts); the message names what is missing."""


@dataclass(frozen=True)
class Composition:
    """What fit() starts with, as ``Plugin.check_composition`` sees it.

    Attributes:
        plugins: the attached plugins, in attach order.
        handlers: event name -> its handlers' names in call order (``engine.describe()``).
        scheduled: the Control requests the plugins make (union of ``Plugin.schedules()``).
        has_eval_data: whether the engine has ``eval_data`` (evaluate() without data needs it).
    """

    plugins: tuple[Plugin, ...]
    handlers: Mapping[str, tuple[str, ...]]
    scheduled: frozenset[str]
    has_eval_data: bool

    @overload
    def get(self, which: type[PluginT]) -> PluginT | None: ...
    @overload
    def get(self, which: str) -> Plugin | None: ...
    def get(self, which: type[Plugin] | str) -> Plugin | None:
        """The first attached plugin of that class (or subclass) or of that name; None when absent."""
        if isinstance(which, str):
            return next((p for p in self.plugins if p.name == which), None)
        return next((p for p in self.plugins if isinstance(p, which)), None)

    def handles(self, event: EventType[Any] | str) -> bool:
        """Whether any handler is registered for ``event`` (an Event or its name)."""
        return bool(self.handlers.get(event if isinstance(event, str) else event.name))


#: what a checkpoint holds (plugins/checkpoints/codec.py writes these without pickle)
STATE_VALUES = "tensors, numbers, strings, None, lists, tuples, dicts, numpy arrays and torch dtypes"
_LEAVES = (bool, int, float, str, type(None), torch.Tensor, torch.dtype)


def check_state(value: Any, path: str = "") -> None:
    """Raise ConfigError naming the path of the first value a checkpoint cannot hold.

    The rules are the checkpoint codec's (``trainbus.plugins.checkpoints.codec.split_tensors``; a
    test keeps the two in agreement): the engine imports only torch and the standard library, so it
    cannot call the codec itself, and this walk costs no copy of a tensor. Numpy values are
    recognised without importing numpy: booleans, integers and floats are allowed, as in the codec.
    """
    if isinstance(value, _LEAVES):
        return
    if isinstance(value, Mapping):
        for i, (key, item) in enumerate(value.items()):
            if not isinstance(key, str):
                check_state(key, f"{path}/#{i}")
            check_state(item, f"{path}/{key}")
        return
    if isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_state(item, f"{path}/{i}")
        return
    kind = getattr(getattr(value, "dtype", None), "kind", None)
    if type(value).__module__ == "numpy" and isinstance(kind, str):
        if kind in "biuf":
            return
        raise ConfigError(
            f"cannot checkpoint a numpy array of dtype {value.dtype} at {path!r}; allowed: {STATE_VALUES}"
        )
    raise ConfigError(
        f"cannot checkpoint a value of type {type(value).__name__} at {path!r}: only {STATE_VALUES} are saved "
        "(no pickle)"
    )
