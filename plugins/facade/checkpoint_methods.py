"""transformers' checkpoint methods on trainbus's Trainer, called where transformers' Trainer calls them.

The Checkpointing and LoadBestModelAtEnd plugins write and read the checkpoints (safetensors and JSON,
atomic, verified); the Trainer offers them three hooks, so a subclass's override runs at transformers'
point with transformers' arguments, its ``super()`` doing trainbus's work:

- ``around_checkpoint_save(write)``: a checkpoint is due: ``_save_checkpoint(model, trial)`` runs, its
  ``super()`` writes the checkpoint (``write``). Inside, the model part goes through
  ``save_model(checkpoint_folder, _internal_call=True)`` -> ``_save(checkpoint_folder)`` when a subclass
  overrides either (``model_folder.checkpoint_extras``): the folder is the checkpoint's temporary one,
  ``checkpoint-N.tmp-PID``, so what the override writes is listed in the manifest and published with it.
- ``around_checkpoint_weights(path, apply)``: a resume has read and verified the checkpoint:
  ``_load_from_checkpoint(path)`` runs, its ``super()`` applying the verified weights (``apply``).
- ``around_best_model(load)``: the end of a run with load_best_model_at_end and a best checkpoint:
  ``_load_best_model()`` runs, its ``super()`` loading the verified best weights.

trainbus's own loads end in ``_issue_warnings_after_load(result)``, with what ``load_state_dict``
returned. ``trainer.state`` is a transformers ``TrainerState`` (``trainer_state.py``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainbus.engine import ConfigError, Engine

from ..checkpoints.checkpoint import Checkpointing
from ..checkpoints.load_best import LoadBestModelAtEnd, load_checkpoint_weights
from ..checkpoints.model_part import active_part
from .saving import save_into_checkpoint, save_to_folder
from .trainer_state import as_trainer_state

logger = logging.getLogger("trainbus.checkpoint")


class TrainerCheckpointing:
    """The Trainer's checkpoint methods (a mixin: ``self`` is the Trainer, an Engine)."""

    _checkpoint_write: Callable[[], None] | None = None
    _pending_weights: tuple[str, Callable[[], Any]] | None = None
    _pending_best: Callable[[], Any] | None = None

    # -- trainer.state: transformers' TrainerState ------------------------------------------------
    @property
    def state(self) -> Any:
        return self._state  # type: ignore[attr-defined]

    @state.setter
    def state(self, value: Any) -> None:
        Engine.state.fset(self, as_trainer_state(value))  # type: ignore[attr-defined]

    # -- saving -------------------------------------------------------------------------------------
    def around_checkpoint_save(self, write: Callable[[], None]) -> None:
        """The Checkpointing plugin's hook: ``_save_checkpoint`` runs, its ``super()`` calling ``write``."""
        self._checkpoint_write = write
        try:
            self._save_checkpoint(self.model_wrapped, getattr(self, "_trial", None))  # type: ignore[attr-defined]
        finally:
            unused, self._checkpoint_write = self._checkpoint_write, None
        if unused is not None:
            logger.warning(
                "%s._save_checkpoint did not call super()._save_checkpoint: trainbus wrote no checkpoint at step %d",
                type(self).__name__, self.state.global_step,
            )  # fmt: skip

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Write the checkpoint of this step (transformers' ``_save_checkpoint``): the Checkpointing plugin's."""
        write, self._checkpoint_write = self._checkpoint_write, None
        record_callback_states(self)
        direct = write is None
        if write is None:  # a direct call, not the plugin's save: write one now, as the plugin would
            self.store_flos()  # type: ignore[attr-defined]  # the plugin's SAVE stores them first (transformers' order)
            plugin = _checkpointing(self)
            write = lambda: plugin.write(self)  # noqa: E731
        write()
        if direct or self.overrides("_save_checkpoint"):  # type: ignore[attr-defined]
            # a direct call, or an override's code after super(), reads or adds to checkpoint-N: it is on disk
            # when _save_checkpoint returns (save_async writes the plugin's own saves in the background)
            _checkpointing(self).wait_for_writes(self, f"{type(self).__name__}._save_checkpoint")  # type: ignore[arg-type]

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """The model, its config and processing files and the training arguments in ``output_dir``.

        Into a checkpoint being written (``save_model(checkpoint_folder, _internal_call=True)``): trainbus's
        own weights, or ``state_dict`` where one is given; into any other folder: the final model.
        """
        directory = output_dir if output_dir is not None else self.args.output_dir  # type: ignore[attr-defined]
        part = active_part(directory)
        if part is not None:
            save_into_checkpoint(self, part, state_dict)
        else:
            save_to_folder(self, directory, state_dict)

    # -- loading ------------------------------------------------------------------------------------
    def around_checkpoint_weights(self, path: Path, apply: Callable[[], Any]) -> None:
        """The resume's hook: ``_load_from_checkpoint(path)`` runs, its ``super()`` applying the verified weights."""
        self._pending_weights = (os.path.abspath(path), apply)
        try:
            self._load_from_checkpoint(str(path))
        finally:
            self._pending_weights = None
        warn_changed_arguments(self.args, Path(path))  # type: ignore[attr-defined]

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Load a checkpoint's weights into ``model`` (the Trainer's by default), verified against its manifest."""
        pending, target = self._pending_weights, self._target(model)
        if pending is not None and pending[0] == os.path.abspath(resume_from_checkpoint) and target is self.model:  # type: ignore[attr-defined]
            self._pending_weights = None
            result = pending[1]()
        else:
            result = load_checkpoint_weights(target, Path(resume_from_checkpoint))
        if result is not None:
            self._issue_warnings_after_load(result)

    def around_best_model(self, load: Callable[[], Any]) -> None:
        """LoadBestModelAtEnd's hook: ``_load_best_model()`` runs, its ``super()`` loading the best weights."""
        self._pending_best = load
        try:
            self._load_best_model()
        finally:
            self._pending_best = None

    def _load_best_model(self) -> None:
        """Load the weights of ``state.best_model_checkpoint`` (verified) into the model."""
        load, self._pending_best = self._pending_best, None
        if load is None:  # a direct call
            plugin = next((p for p in self.plugins if isinstance(p, LoadBestModelAtEnd)), None)  # type: ignore[attr-defined]
            best = self.state.best_model_checkpoint
            if plugin is not None:
                load = lambda: plugin.load_best(self)  # noqa: E731
            elif best is not None:
                load = lambda: load_checkpoint_weights(self.model, Path(best))  # type: ignore[attr-defined]  # noqa: E731
            else:
                raise ConfigError("_load_best_model: no best checkpoint was recorded (state.best_model_checkpoint)")
        result = load()
        if result is not None:
            self._issue_warnings_after_load(result)

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        """After a load: warn about unexpected keys (trainbus refuses them before loading, so none come here) and
        missing ones that are no tied copy of a loaded weight (likewise)."""
        if getattr(load_result, "unexpected_keys", None):
            logger.warning("There were unexpected keys in the checkpoint model loaded: %s", load_result.unexpected_keys)

    def _get_output_dir(self, trial: Any = None) -> str:
        """transformers': where this run's checkpoints go. A search trial's arguments already name its run
        folder (``search.py``), so it is ``args.output_dir`` in both cases (an override stays refused: the
        Checkpointing plugin writes there)."""
        return str(self.args.output_dir)  # type: ignore[attr-defined]

    def _target(self, model: Any) -> Any:
        if model is None or model is self.model_wrapped:  # type: ignore[attr-defined]
            return self.model  # type: ignore[attr-defined]
        return model


def warn_changed_arguments(args: Any, checkpoint: Path) -> None:
    """transformers' warning, on its logger and in its words, when the resumed checkpoint's trainer_state.json has
    other logging / eval / save steps or batch size than ``args`` (its ``compare_trainer_and_checkpoint_args``)."""
    try:
        from transformers import trainer_utils
        from transformers.trainer_callback import TrainerState
    except ImportError:
        return
    # verified by the resume's read; a checkpoint from before trainbus_state.json has the engine's fields there too
    saved = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    state = TrainerState(**{f.name: saved[f.name] for f in dataclasses.fields(TrainerState) if f.name in saved})
    if state.train_batch_size is None:
        return  # transformers' own function would fail on it
    compare = getattr(trainer_utils, "compare_trainer_and_checkpoint_args", None)
    if compare is not None:
        compare(args, state)
    else:  # 4.x: a Trainer method reading only its arguments
        from transformers import Trainer as HFTrainer

        HFTrainer.compare_trainer_and_checkpoint_args(None, args, state)


def record_callback_states(trainer: Any) -> None:
    """``state.stateful_callbacks`` as transformers' checkpoint records it: the control's flags (a checkpoint is
    being saved: after the step's log and evaluation) and each callback's ``state()`` (ExportableState's)."""
    control = trainer.control
    flags = {"should_training_stop": control.should_training_stop, "should_epoch_stop": control.should_epoch_stop,
             "should_save": True, "should_evaluate": False, "should_log": False}  # fmt: skip
    states: dict[str, Any] = {"TrainerControl": {"args": flags, "attributes": {}}}
    for callback in getattr(trainer.callback_handler, "callbacks", []):
        state = getattr(callback, "state", None)
        if callable(state):
            name, value = type(callback).__name__, state()
            states[name] = [*_as_list(states[name]), value] if name in states else value
    trainer.state.stateful_callbacks = states


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def _checkpointing(trainer: Any) -> Checkpointing:
    plugin = next((p for p in trainer.plugins if isinstance(p, Checkpointing)), None)
    if plugin is None:
        raise ConfigError("_save_checkpoint needs the Checkpointing plugin (the Trainer has it unless it was removed)")
    return plugin
