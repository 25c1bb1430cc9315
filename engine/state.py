"""State and Control, with the Hugging Face attribute names.

State is what a run has done (saved with every checkpoint, JSON round trip); Control is what
handlers ask the loop to do next (reset by the loop at documented points).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from .errors import ConfigError


@dataclass
class State:
    """Progress of a run. Field names follow ``transformers.TrainerState``.

    Example:
        >>> from trainbus.engine import State
        >>> s = State(global_step=3, epoch=0.5)
        >>> State.from_json(s.to_json()) == s
        True
    """

    epoch: float = 0.0  # fractional epoch progress, e.g. 1.5 = half way through the 2nd epoch
    global_step: int = 0  # optimizer steps (windows) completed, including AMP-skipped ones
    max_steps: int = 0
    num_train_epochs: int = 0
    steps_per_epoch: int | None = None  # None for data of unknown length
    logging_steps: int = 500
    eval_steps: int | None = None
    save_steps: int = 500
    train_batch_size: int | None = None
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_local_process_zero: bool = True
    is_world_process_zero: bool = True
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)
    # trainbus additions
    epochs_completed: int = 0
    epoch_step: int = 0  # optimizer steps done in the current epoch
    batches_in_epoch: int = 0  # micro-batches consumed in the current epoch (what a resume skips)
    optimizer_steps_taken: int = 0  # global_step minus vetoed / overflowed steps
    micro_steps: int = 0  # micro-batches trained on in the whole run
    event_counts: dict[str, int] = field(default_factory=dict)  # firings of the events outside a step
    run_id: str | None = None  # the run's identity: set when it starts, kept by its resumes (None: not started yet)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        """JSON text; non-finite floats are written as strings so the text is strict JSON."""
        return json.dumps(_encode(self.to_dict()), indent=2, sort_keys=True, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> State:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown State fields {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> State:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"state JSON is corrupt: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"state JSON must hold an object, got {type(data).__name__}")
        return cls.from_dict(_decode(data))

    def save_to_json(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def load_from_json(cls, path: str | Path) -> State:
        return cls.from_json(Path(path).read_text(encoding="utf-8"))


_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _encode(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")}
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _NONFINITE:
            return _NONFINITE[value["__float__"]]
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


@dataclass
class Control:
    """Requests from handlers to the loop. Field names follow ``transformers.TrainerControl``.

    The loop reads should_log / should_evaluate / should_save right after STEP_END and after
    EPOCH_END, acts on them in that order and resets them. should_epoch_stop is reset at each
    EPOCH_START; should_training_stop at TRAIN_START.
    """

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False
    #: True while any flag is set: the loop reads this one attribute after every step, not five.
    #: Not a field (so not in to_dict / ==); each instance keeps its own copy, set by __setattr__.
    requested: ClassVar[bool] = False

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in CONTROL_FLAGS:
            object.__setattr__(self, "requested", any(getattr(self, flag) for flag in CONTROL_FLAGS))

    def reset_side_effects(self) -> None:
        self.should_log = False
        self.should_evaluate = False
        self.should_save = False

    def to_dict(self) -> dict[str, bool]:
        return dataclasses.asdict(self)


#: the names of Control's flags (its fields), in declaration order
CONTROL_FLAGS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Control))
