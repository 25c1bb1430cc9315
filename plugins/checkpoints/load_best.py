"""LoadBestModelAtEnd: at TRAIN_END the model gets the weights of the best checkpoint (HF's load_best_model_at_end)."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import Composition, ConfigError, Engine, Event, Plugin, Priority
from trainbus.engine.events import Payload

from ..distributed.processes import broadcast_from_main, rank
from . import io as cio
from .best_schedule import check_best_schedule
from .frozen import check_base
from .model_part import weights_file
from .restored import BEST_NAME
from .resuming import verify_best_weights
from .rotation import warn
from .safety import DamagedCheckpoint
from .sharded import SHARDED, load_model_shards
from .verified import read_manifest

logger = logging.getLogger("trainbus.checkpoint")


class LoadBestModelAtEnd(Plugin):
    """At TRAIN_END, loads the weights of ``state.best_model_checkpoint`` into the model (K5).

    Runs first at TRAIN_END so that later handlers (a final save_model) see the best weights.
    Without a best checkpoint (no evaluation, or the best step was not saved) it warns and keeps
    the last weights, as HF does. Only a ``checkpoint-N`` directory whose manifest says step N is
    loaded (a resume names the best inside the run's directory: ``restored.trusted_best``). A best
    checkpoint that is damaged (or does not fit the model) is warned about and the run keeps its own
    weights: the finish of a long run never fails on it. The weights file is checked whole before
    anything is copied, so the model is never half loaded.
    """

    priority = Priority.FIRST

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_END, self.load)

    def check_composition(self, composition: Composition) -> list[str]:
        """When fit() starts: a ConfigError for save and evaluation schedules that can never record a best
        (``best_schedule.py``); a warning naming what else is missing (what a handler could still supply)."""
        return check_best_schedule(composition.plugins, composition.scheduled)

    def load(self, ev: Payload) -> None:
        """TRAIN_END: the best weights; an engine offering ``around_best_model(load)`` (the facade: a subclass's
        ``_load_best_model``, whose ``super()`` loads) runs the load itself when there is a best checkpoint."""
        around = getattr(ev.engine, "around_best_model", None)
        if callable(around) and ev.engine.state.best_model_checkpoint is not None:
            around(partial(self.load_best, ev.engine))
        else:
            self.load_best(ev.engine)

    def load_best(self, engine: Engine) -> Any:
        """Load the best checkpoint's weights (or warn and keep the run's); what ``load_state_dict`` returned."""
        best = engine.state.best_model_checkpoint
        if best is None:
            logger.warning("LoadBestModelAtEnd: no best checkpoint was recorded; keeping the last weights")
            return None
        directory = Path(best)
        problem = None
        manifest: dict[str, Any] = {}
        if rank() == 0:  # rank 0 checks, so that every rank loads or none does
            try:
                manifest = _checked(directory)
            except DamagedCheckpoint as exc:
                problem = str(exc)
        problem = broadcast_from_main(problem)
        result = None
        if problem is None:
            try:
                result = _load_best(engine.model, directory, manifest)
            except ConfigError as exc:  # nothing was copied: the weights are checked against the model first
                problem = str(exc)
        if problem is not None:
            warn(
                f"LoadBestModelAtEnd: the best checkpoint {best} cannot be loaded ({problem}); "
                "keeping the run's own weights"
            )
            return None
        logger.info("loaded the best model from %s (step %s)", best, engine.state.best_global_step)
        return result


def _checked(directory: Path) -> dict[str, Any]:
    """The manifest of a best checkpoint whose weights are intact, and which is a checkpoint of a run:
    named ``checkpoint-N``, with N the step its manifest records (a resume trusts no other: restored.py)."""
    match = BEST_NAME.match(directory.name)
    if match is None:
        raise DamagedCheckpoint(f"{directory} is not a checkpoint-N directory of the run")
    manifest = verify_best_weights(directory)
    if manifest.get("global_step", int(match.group(1))) != int(match.group(1)):
        raise DamagedCheckpoint(f"{directory} holds the checkpoint of step {manifest.get('global_step')!r:.40}")
    return manifest


def load_checkpoint_weights(model: torch.nn.Module, directory: Path) -> Any:
    """The weights of a checkpoint (its resume weights, or every rank's slices) checked, then loaded into ``model``."""
    return _load_best(model, directory, verify_best_weights(directory))


def _load_best(model: torch.nn.Module, directory: Path, manifest: dict[str, Any]) -> Any:
    """The weights of a checkpoint that rank 0 has just verified (``manifest`` read there; {} elsewhere)."""
    manifest = manifest or read_manifest(directory, verify=False)
    if SHARDED in manifest:  # FSDP: every rank loads its own slices
        load_model_shards(model, directory, verify=False)
        return None
    weights = directory / weights_file(manifest, directory / cio.MANIFEST)
    frozen = check_base(model, manifest.get("frozen_base"), str(directory))
    return cio.load_weights(model, cio.read_tensors(weights), str(weights), may_lack=frozen)
