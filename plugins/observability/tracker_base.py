"""The base of the experiment trackers (trackers.py): ``TrackerSink`` and what the trackers share.

A ``TrackerSink`` opens a run at TRAIN_START (or at an ``evaluate()``'s first record outside training),
writes every LOG record at ``state.global_step`` on the world main process, and closes the run at
TRAIN_END; its checkpointed state is the run's id. ``run_config`` is the configuration every tracker records.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import ConfigTypeError

if TYPE_CHECKING:
    from trainbus.engine import Engine, EvalEndEvent, LogEvent, State, TrainEndEvent, TrainStartEvent

logger = logging.getLogger("trainbus.plugins")

#: the final training metrics: one value per run, a summary rather than a curve (HF's single_value_scalars)
SUMMARY_KEYS = ("train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss", "total_flos")
_TRUE = ("1", "ON", "YES", "TRUE")


def run_config(config: Mapping[str, Any] | None, model: Any) -> dict[str, Any]:
    """What a tracker records as the run's configuration: ``config`` over the model's, as HF's callbacks do.

    Example:
        >>> run_config({"learning_rate": 0.1}, torch.nn.Linear(2, 1))
        {'learning_rate': 0.1, 'model/num_parameters': 3}
    """
    combined: dict[str, Any] = {}
    model_config = getattr(model, "config", None)
    if model_config is not None:
        combined.update(model_config if isinstance(model_config, dict) else model_config.to_dict())
    combined.update(config or {})
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, Mapping):
        combined["peft_config"] = {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in peft_config.items()}
    if isinstance(model, torch.nn.Module):
        combined["model/num_parameters"] = sum(p.numel() for p in model.parameters())
    return combined


def _number(value: Any) -> Any:
    """A one-element tensor as a Python number (a tracker stores numbers); anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def check_names(**names: Any) -> None:
    """A tracker's project / run names: each a non-empty str or None (ConfigTypeError naming the first that is not)."""
    for key, value in names.items():
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigTypeError(f"{key} must be a non-empty str or None, got {value!r:.80} ({type(value).__name__})")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "FALSE").upper() in _TRUE


def _import(module: str, install: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"report_to={module!r} needs the {module} package: pip install {install} ({exc})") from None


class TrackerSink(Plugin):
    """Shared behaviour: open the run on the main process, write LOG records, close at TRAIN_END.

    Subclasses implement ``open`` (returns the run's id), ``write`` and ``close``.

    Args:
        config: the run's hyperparameters (the facade passes ``args.to_dict()``).
    """

    priority = Priority.CONSUMER

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        if config is not None and not isinstance(config, Mapping):
            raise ConfigTypeError(f"config must be a dict of the run's hyperparameters or None, got {config!r:.80}")
        self.config = dict(config or {})
        self.run_id: str | None = None  # checkpointed: a resumed training continues this run
        self.is_open = False
        self._training = False

    # -- what a tracker does -------------------------------------------------------------------------
    def open(self, model: Any, state: State) -> str:
        """Start (or, with ``self.run_id`` set, resume) the run; return its id."""
        raise NotImplementedError

    def write(self, logs: dict[str, Any], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # -- events -----------------------------------------------------------------------------------------
    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_START, self.train_start)
        self.on(engine, Event.LOG, self.log)
        self.on(engine, Event.EVAL_END, self.eval_end, priority=Priority.LAST)
        # after the final train metrics; also when training fails (cleanup): the tracker's run is finished
        self.on(engine, Event.TRAIN_END, self.train_end, priority=Priority.LAST, cleanup=True)

    def detach(self, engine: Engine) -> None:
        self._finish()
        super().detach(engine)

    def train_start(self, ev: TrainStartEvent) -> None:
        self._training = True
        if ev.engine.state.is_world_process_zero:
            self._start(ev.engine)

    def log(self, ev: LogEvent) -> None:
        state = ev.engine.state
        if not ev.logs or not state.is_world_process_zero:
            return
        self._start(ev.engine)
        self.write({str(k): _number(v) for k, v in ev.logs.items()}, state.global_step)

    def eval_end(self, ev: EvalEndEvent) -> None:
        if not self._training:  # an evaluate() outside training: its record is written, close the run again
            self._finish()

    def train_end(self, ev: TrainEndEvent) -> None:
        self._training = False
        self._finish()

    def _start(self, engine: Engine) -> None:
        if not self.is_open:
            self.run_id = self.open(engine.model, engine.state)
            self.is_open = True

    def _finish(self) -> None:
        if self.is_open:
            self.is_open = False
            self.close()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.run_id is None else {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        run_id = state.get("run_id")
        if self.is_open and run_id != self.run_id:  # another run's state (auto_find_batch_size's restart): a new run
            self._finish()
        self.run_id = run_id


def _json_object_env(name: str) -> dict[str, Any]:
    text = os.environ.get(name)
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{name} must be a JSON object of tag names to values, got {text!r} ({exc})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object of tag names to values, got {text!r}")
    return value


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys (HF's flatten_dict for ``MLFLOW_FLATTEN_PARAMS``)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, name + "."))
        else:
            flat[name] = value
    return flat
