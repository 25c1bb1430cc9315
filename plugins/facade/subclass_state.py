"""What a Trainer subclass keeps on ``self``, checkpointed (``checkpoints/attribute_state.py``): its attributes.

transformers checkpoints the model, optimizer, scheduler, RNG and trainer state, so a subclass that keeps
state of its own (a distillation ``compute_loss``'s moving-average teacher or step counter, a multi-task
subclass's learned loss weights, an adversarial ``training_step``'s noise generator) resumes as if that
state were new. Which attributes are the subclass's is observed, not read from its source: a script's
subclass gets a ``__setattr__`` (installed when the class is made, ``TrainerScriptState``) that notes
each name the script's own code assigns (``self.name = ...``, ``setattr(self, ...)``, before or after
``super().__init__``), and never one that transformers', TRL's or trainbus's code assigns. ``AttributeState``
saves those that changed and restores them on resume.
"""

from __future__ import annotations

import sys
from typing import Any

from ..checkpoints.attribute_state import AttributeState

__all__ = ["SubclassState", "TrainerScriptState", "record_script_assignments", "script_classes", "subclass_state"]

#: packages whose Trainer subclasses are not the script's (their state is theirs to keep)
_LIBRARIES = ("transformers", "trl", "trainbus", "peft", "accelerate", "torch", "builtins")
#: the instance attribute holding the names the script's code assigned (in assignment order)
_ASSIGNED = "_trainbus_script_attributes"


class SubclassState(AttributeState):
    """``AttributeState`` over a Trainer subclass's own attributes (its name in checkpoints)."""


def _is_library(module: str) -> bool:
    return module.split(".")[0] in _LIBRARIES


def script_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s hierarchy that the script defines (not transformers', TRL's, trainbus's...)."""
    return [k for k in cls.__mro__ if not _is_library(k.__module__)]


def library_names(cls: type) -> set[str]:
    """The names the library classes of ``cls``'s hierarchy declare (``model``, ``optimizer``, ``args``...)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if _is_library(klass.__module__):
            names |= set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
    return names


def record_script_assignments(cls: type) -> None:
    """Give a script's Trainer subclass a ``__setattr__`` that notes the names its own code assigns.

    Only script classes get it (a plain Trainer's attribute writes stay as they are); a class defining its own
    ``__setattr__`` is wrapped too, and a subclass of an already recording class keeps the one it inherits.
    """
    if _is_library(cls.__module__) or getattr(cls.__setattr__, "_records_script", False):
        return
    inner: Any = cls.__setattr__

    def __setattr__(self: Any, name: str, value: Any) -> None:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if not _is_library(caller):  # the script's code (a setattr() call has no frame of its own)
            self.__dict__.setdefault(_ASSIGNED, {})[name] = None
        inner(self, name, value)

    __setattr__._records_script = True  # type: ignore[attr-defined]
    cls.__setattr__ = __setattr__  # type: ignore[method-assign,assignment]


class TrainerScriptState:
    """A mixin of ``Trainer``: every subclass a script makes records what its code assigns on ``self``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        record_script_assignments(cls)


def subclass_state(trainer: Any) -> SubclassState | None:
    """The plugin for ``trainer``'s script classes (None for transformers' own Trainer classes and trainbus's).

    Names the base Trainer declares (``model``, ``optimizer``, ``args``...) are the base's: the checkpoint has them.
    The names are read at each save, so an attribute the script first assigns mid-run is kept too.
    """
    if not script_classes(type(trainer)):
        return None
    declared = library_names(type(trainer))

    def names() -> list[str]:
        return [n for n in trainer.__dict__.get(_ASSIGNED, ()) if n not in declared]

    return SubclassState(trainer, names, type(trainer).__name__)
