"""What a Trainer subclass keeps on ``self``, checkpointed (``checkpoints/attribute_state.py``): its attributes.

transformers checkpoints the model, optimizer, scheduler, RNG and trainer state, so a subclass that keeps
state of its own (a distillation ``compute_loss``'s moving-average teacher or step counter, a multi-task
subclass's learned loss weights, an adversarial ``training_step``'s noise generator) resumes as if that
state were new. The attributes a subclass's own code assigns (``self.name = ...``, ``self.name += ...``,
``setattr(self, "name", ...)`` in the script's classes, not transformers' or trainbus's) are read from
its source; ``AttributeState`` saves those that changed and restores them on resume.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import warnings
from typing import Any

from ..checkpoints.attribute_state import AttributeState

__all__ = ["SubclassState", "assigned_attributes", "subclass_state"]

#: packages whose Trainer subclasses are not the script's (their state is theirs to keep)
_LIBRARIES = ("transformers", "trl", "trainbus", "peft", "builtins")


class SubclassState(AttributeState):
    """``AttributeState`` over a Trainer subclass's own attributes (its name in checkpoints)."""


def script_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s hierarchy that the script defines (not transformers', TRL's, trainbus's...)."""
    return [k for k in cls.__mro__ if k.__module__.split(".")[0] not in _LIBRARIES]


def library_names(cls: type) -> set[str]:
    """The names the library classes of ``cls``'s hierarchy declare (``model``, ``optimizer``, ``args``...)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] in _LIBRARIES:
            names |= set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
    return names


def assigned_attributes(klass: type) -> list[str] | None:
    """The attribute names ``klass``'s methods assign on ``self``; None when a method's source cannot be read.

    Each method is read on its own (a class made with ``type(...)`` has no source, its functions do).
    """
    names: list[str] = []
    for member in vars(klass).values():
        for function in _functions(member):
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
            except OSError:
                return None
            except (TypeError, SyntaxError):  # a lambda's line: it assigns nothing on self
                continue
            names += _assigned(tree)
    return list(dict.fromkeys(names))


def _functions(member: Any) -> list[Any]:
    if isinstance(member, staticmethod | classmethod):
        member = member.__func__
    if isinstance(member, property):
        return [f for f in (member.fget, member.fset, member.fdel) if inspect.isfunction(f)]
    return [member] if inspect.isfunction(member) else []


def _assigned(tree: ast.AST) -> list[str]:
    names: list[str] = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef) or not function.args.args:
            continue
        me = function.args.args[0].arg
        for node in ast.walk(function):
            for target in _targets(node):
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == me:
                    names.append(target.attr)
            if _is_setattr_on(node, me):
                names.append(node.args[1].value)  # type: ignore[attr-defined]
    return names


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found: list[ast.expr] = []
        for target in node.targets:
            found += target.elts if isinstance(target, ast.Tuple | ast.List) else [target]
        return found
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return [node.target]
    return []


def _is_setattr_on(node: ast.AST, me: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "setattr"
        and len(node.args) >= 2
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id == me
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    )


def subclass_state(trainer: Any) -> SubclassState | None:
    """The plugin for ``trainer``'s script classes (None for transformers' own Trainer classes and trainbus's).

    Names the base Trainer declares (``model``, ``optimizer``, ``args``...) are the base's: the checkpoint has them.
    A class whose source cannot be read is named in a warning: what it keeps on ``self`` is not checkpointed.
    """
    classes = script_classes(type(trainer))
    if not classes:
        return None
    declared = library_names(type(trainer))
    names: list[str] = []
    for klass in classes:
        found = assigned_attributes(klass)
        if found is None:
            warnings.warn(
                f"the source of {klass.__qualname__}'s methods cannot be read, so the state it keeps on self is not "
                "checkpointed: a resume may differ from the uninterrupted run",
                stacklevel=4,
            )
            continue
        names += [n for n in found if n not in declared]
    if not names:
        return None
    kept = list(dict.fromkeys(names))
    return SubclassState(trainer, lambda: kept, type(trainer).__name__)
