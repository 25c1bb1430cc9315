"""``AttributeState``: the state an object keeps in attributes of its own, in checkpoints and back on resume.

A Trainer subclass keeps state on ``self`` that no plugin knows: a teacher updated as the student's
moving average, learned task weights outside the model, a noise generator, a step counter driving a
schedule. Left out of checkpoints, a resume starts them over and the run is no longer the uninterrupted
one. This plugin saves, for each named attribute:

* a random generator (torch, numpy, ``random.Random``): its state, always;
* a tensor, or a module's parameters and buffers: when the optimizer trains one of them, or they changed
  since the run started (each tensor's version counter and storage: in-place writes), so a frozen teacher
  costs the checkpoint nothing; the model's own modules are the model's checkpoint, not this one's;
* a number, string, None, or a list / tuple / dict of those: when it changed since the run started (a
  dict or list is filled in place on restore: a ``defaultdict`` stays one);
* an object with ``state_dict`` / ``load_state_dict`` (an EMA helper, a second optimizer): its state;
* another object: the generators found in it (``data/generators.py``).

A restored attribute is saved at every later checkpoint. What a checkpoint cannot hold (a set, a list
of tensors, a deque, an iterator's position) is named in a warning once, at the first save: it will not
be restored.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from trainbus.engine import ConfigError, Engine, Event, Plugin, Priority

from ..data.generators import KINDS, find_generators, generator_state, restore_generators, set_generator_state
from .codec import split_tensors

__all__ = ["AttributeState"]

_PLAIN = (int, float, str, bool, type(None))


def _is_plain(value: Any, depth: int = 4) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if depth == 0:
        return False
    if isinstance(value, list | tuple):
        return all(_is_plain(v, depth - 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_plain(v, depth - 1) for k, v in value.items())
    return False


def _tensors_mark(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """What changes when a tensor is written in place (its version) or given new storage."""
    return [(t.data_ptr(), t._version) for t in tensors]


class AttributeState(Plugin):
    """Checkpoint ``owner``'s attributes ``names()`` (asked at each save: an attribute may appear mid-run).

    Args:
        owner: the object whose attributes are saved (a Trainer subclass instance).
        names: the attribute names to consider, asked at each save and load.
        label: how messages name the owner (``"Distillation"``).
    """

    def __init__(self, owner: Any, names: Callable[[], Iterable[str]], label: str) -> None:
        self.owner = owner
        self.names = names
        self.label = label
        self._baseline: dict[str, Any] = {}
        self._restored: set[str] = set()
        self._warned: set[str] = set()

    def attach(self, engine: Engine) -> None:
        self._engine = engine
        self.on(engine, Event.TRAIN_START, self._start, priority=Priority.FIRST)

    def _start(self, ev: Any) -> None:
        for name, value in self._present():
            if name not in self._baseline:
                self._baseline[name] = self._mark(value)

    def _present(self) -> list[tuple[str, Any]]:
        attributes = getattr(self.owner, "__dict__", {})
        return [(name, attributes[name]) for name in dict.fromkeys(self.names()) if name in attributes]

    def _model_tensors(self) -> set[int]:
        model = getattr(self._engine, "model", None)
        return {id(t) for t in model.state_dict(keep_vars=True).values()} if model is not None else set()

    def _trained(self) -> set[int]:
        """The tensors the engine's optimizer steps (a fused step writes them without a version count)."""
        optimizer = getattr(self._engine, "optimizer", None)
        groups = getattr(optimizer, "param_groups", [])
        return {id(p) for group in groups for p in group.get("params", [])}

    def _mark(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return _tensors_mark([value])
        if isinstance(value, torch.nn.Module):
            return _tensors_mark(value.state_dict(keep_vars=True).values())
        return copy.deepcopy(value) if _is_plain(value) else None

    def _changed(self, name: str, value: Any, trained: set[int] = frozenset()) -> bool:  # type: ignore[assignment]
        if name in self._restored or name not in self._baseline or self._baseline[name] != self._mark(value):
            return True
        tensors = value.state_dict(keep_vars=True).values() if isinstance(value, torch.nn.Module) else [value]
        return isinstance(value, torch.Tensor | torch.nn.Module) and any(id(t) in trained for t in tensors)

    # -- save ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        saved: dict[str, Any] = {}
        attached = hasattr(self, "_engine")
        model, trained = (self._model_tensors(), self._trained()) if attached else (set(), set())
        for name, value in self._present():
            entry = self._entry(name, value, model, trained)
            if entry is not None:
                saved[name] = entry
        return {"attributes": saved}

    def _entry(self, name: str, value: Any, model: set[int], trained: set[int]) -> dict[str, Any] | None:
        engine = getattr(self, "_engine", None)
        if engine is not None and any(value is getattr(engine, n, None) for n in ("optimizer", "lr_scheduler")):
            return None  # the engine's own: checkpointed as such
        if isinstance(value, KINDS):
            return {"kind": "generator", "value": generator_state(value)}
        if isinstance(value, torch.Tensor):
            if id(value) in model or not self._changed(name, value, trained):
                return None
            return {"kind": "tensor", "value": value.detach()}
        if isinstance(value, torch.nn.Module):
            tensors = value.state_dict(keep_vars=True)
            if any(id(t) in model for t in tensors.values()) or not self._changed(name, value, trained):
                return None  # a part of the model, or as built
            return {"kind": "module", "value": {k: t.detach() for k, t in tensors.items()}}
        if _is_plain(value):
            return {"kind": "value", "value": value} if self._changed(name, value) else None
        if callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            return self._stateful(name, value)
        generators = find_generators({name: value})
        if generators:
            return {"kind": "generators", "value": {path: generator_state(g) for path, g in generators.items()}}
        if (
            isinstance(value, list | tuple | dict | set | frozenset | Iterator)
            or type(value).__module__ == "collections"
        ):
            self._warn(name, value)  # a container of other things, or an iterator's position
        return None

    def _stateful(self, name: str, value: Any) -> dict[str, Any] | None:
        state = value.state_dict()
        try:
            split_tensors(state, name)
        except ConfigError:
            self._warn(name, value)
            return None
        return {"kind": "state_dict", "value": state}

    def _warn(self, name: str, value: Any) -> None:
        if name not in self._warned:
            self._warned.add(name)
            warnings.warn(
                f"{self.label}.{name} (a {type(value).__name__}) is state a checkpoint cannot hold (tensors, numbers, "
                "strings, lists and dicts of them, generators, modules, objects with state_dict): it will not be "
                "restored on resume, so a resumed run may differ from the uninterrupted one. Keep it as one of those "
                "kinds to have it checkpointed",
                stacklevel=3,
            )

    # -- load ----------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        model = getattr(getattr(self, "_engine", None), "model", None)
        parameter = next(model.parameters(), None) if model is not None else None
        return parameter.device if parameter is not None else torch.device("cpu")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        attributes = state.get("attributes", {})
        for name, entry in attributes.items():
            self._restore(name, entry["kind"], entry["value"])
            self._restored.add(name)

    def _restore(self, name: str, kind: str, value: Any) -> None:
        current = getattr(self.owner, name, None)
        if kind == "value":
            _set_value(self.owner, name, current, value)
        elif kind == "generator":
            if isinstance(current, KINDS):
                set_generator_state(current, value)
            else:
                restore_generators({"owner": self.owner}, {f"owner.{name}": value})
        elif kind == "tensor":
            if isinstance(current, torch.Tensor) and current.shape == value.shape:
                with torch.no_grad():
                    current.copy_(value)
            else:  # made or replaced during the run (a perturbation kept from step to step)
                setattr(self.owner, name, value.to(self._device()))
        elif (kind == "module" and isinstance(current, torch.nn.Module)) or (
            kind == "state_dict" and current is not None
        ):
            current.load_state_dict(value)
        elif kind == "generators" and current is not None:
            restore_generators({name: current}, value)
        else:
            raise ConfigError(
                f"the checkpoint holds {self.label}.{name} as a {kind}, but this {self.label} has "
                f"{type(current).__name__} there: build it as the run that wrote the checkpoint did"
            )


def _set_value(owner: Any, name: str, current: Any, value: Any) -> None:
    """Set a plain value; a dict or list already there is filled in place (a ``defaultdict`` stays one)."""
    if isinstance(current, dict) and isinstance(value, dict):
        current.clear()
        current.update(value)
    elif isinstance(current, list) and isinstance(value, list):
        current[:] = value
    else:
        setattr(owner, name, value)
