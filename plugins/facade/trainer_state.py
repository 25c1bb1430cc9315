"""``trainer.state``: the engine's State that is also a transformers ``TrainerState``.

transformers' callbacks, scripts and subclasses read ``trainer.state`` as a ``TrainerState``
(``isinstance``, its fields, ``save_to_json`` / ``load_from_json``). The engine's ``State`` has every
field ``TrainerState`` has, plus its own (``epochs_completed``, ``batches_in_epoch``, ...). The
Trainer's state is a dataclass inheriting both, made when a state is set (``checkpoint_methods``:
the Trainer's ``state`` setter converts the engine's State, keeping the very field values).

transformers is optional and heavy to import (about 2 s for its trainer modules): the state is a
``TrainerState`` when the process has imported transformers (a script using transformers' models,
tokenizers or callbacks has); without it, the same class without that base.

``save_to_json`` writes what transformers' writes, its fields only (``checkpoints/history.split_state``);
``trainer_state.json`` in a checkpoint is the same, the engine's own fields going to
``trainbus_state.json``.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

from trainbus.engine import State

from ..checkpoints.history import HF_STATE_FIELDS, split_state


def _as_seen_by_transformers(cls: type) -> type:
    """``dataclasses.fields`` / ``asdict`` of the class give transformers' fields only, as of a ``TrainerState``
    (transformers' tests compare ``asdict(trainer.state)`` of two runs); the engine's own fields stay attributes,
    in ``__init__``, ``==``, ``to_dict`` and checkpoints."""
    cls.__dataclass_fields__ = {  # type: ignore[attr-defined]
        name: f for name, f in cls.__dataclass_fields__.items() if name in HF_STATE_FIELDS  # type: ignore[attr-defined]
    }
    return cls


@_as_seen_by_transformers
@dataclasses.dataclass(eq=True)
class TrainerStateFields(State):
    """The engine's State whose ``save_to_json`` writes transformers' ``trainer_state.json`` (its fields only)."""

    def to_dict(self) -> dict[str, Any]:
        """Every field, the engine's too (``engine.state_dict()``)."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(State)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        return cls(**State.from_dict(data).to_dict())

    def save_to_json(self, json_path: str | Path) -> None:
        Path(json_path).write_text(split_state(self)[0], encoding="utf-8")


_WITH_HF: list[type] = []  # the class with transformers' TrainerState as a base, once made


def state_class() -> type[TrainerStateFields]:
    """``TrainerStateFields``, also a transformers ``TrainerState`` when the process has imported transformers."""
    if _WITH_HF:
        return _WITH_HF[0]
    if "transformers" not in sys.modules:
        return TrainerStateFields
    try:
        from transformers.trainer_callback import TrainerState as HFTrainerState
    except ImportError:
        return TrainerStateFields
    namespace = {"__module__": __name__, "__qualname__": "TrainerState"}
    made = dataclasses.dataclass(eq=True)(type("TrainerState", (TrainerStateFields, HFTrainerState), namespace))
    made = _as_seen_by_transformers(made)
    _WITH_HF.append(made)
    return made  # type: ignore[no-any-return]


def as_trainer_state(state: Any) -> TrainerStateFields:
    """``state`` itself when it is of the Trainer's state class, else one holding the very same field values."""
    cls = state_class()
    if type(state) is cls:
        return state  # type: ignore[return-value]
    # a transformers TrainerState assigned by a script (load_from_json) lacks the engine's own fields: their defaults
    own = {f.name: getattr(state, f.name) for f in dataclasses.fields(State) if hasattr(state, f.name)}
    return cls(**own)
