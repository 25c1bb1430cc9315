"""A checkpoint in two stages: taken on the training thread, then written (there, or by a background writer).

``take_checkpoint`` does everything that reads the live run: the checks, the best checkpoint's path, the
temporary folder ``checkpoint-N.tmp-PID`` with the small files that come from the model's and the run's
own objects (the model folder's config and tokenizer files, peft's adapter folder, a Trainer subclass's
``save_model`` override), and the state a resume needs, split into JSON structures of its own and tensors.
With ``buffers`` (``snapshot.HostBuffers``: an asynchronous save) every tensor is copied into host memory
that training does not touch; without, the tensors are the live ones and the write follows at once
(``save_checkpoint``: a synchronous save, as before, with no copy).

``PendingCheckpoint.write`` does the rest, reading only what was taken: the tensor files, the trainer
state, the manifest (last), one fsync of everything and the rename into place (``directory.py``).
A failure anywhere removes the temporary folder: nothing is left that looks complete, and the checkpoints
before are untouched. ``rollback`` puts back the best checkpoint's path the take set.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import ConfigError, Engine, State

from . import codec, identity
from . import io as cio
from .directory import PREFIX, publish_directory
from .frozen import BASE_MODEL_FILES, adapter_model, checkpoint_fingerprint, frozen_parameters
from .history import TakenState, take_trainer_state, write_trainer_state
from .model_part import ModelPart, added_files
from .resuming import rng_file_stems
from .sharded import saved_by_every_rank
from .snapshot import HostBuffers

__all__ = ["PendingCheckpoint", "buffers_plan", "take_checkpoint"]


@dataclass
class PendingCheckpoint:
    """A checkpoint taken and not yet written: ``write()`` publishes it as ``final``."""

    tmp: Path
    final: Path
    part: ModelPart
    weights: tuple[str, dict[str, torch.Tensor]] | None  # None: the model part is written already (an override)
    bundles: list[tuple[str, Any, dict[str, torch.Tensor]]]  # (stem, JSON structure, tensors)
    trainer_state: TakenState
    manifest: dict[str, Any]
    previous_best: str | None
    buffers: HostBuffers | None = None
    written: dict[str, dict[str, Any]] = field(default_factory=dict)

    def write(self) -> Path:
        """Write what was taken and publish it; returns ``final``. Any thread may call it, once."""
        try:
            if self.buffers is not None:
                self.buffers.ready()  # the device copies have landed in host memory
            if self.weights is not None:
                self.part.write_taken(self.weights)
            files, model_listed = self.part.finish()
            for stem, structure, tensors in self.bundles:
                files |= cio.write_split_bundle(self.tmp, stem, structure, tensors)
            # the log history's full segments are linked from the last save, not rewritten (history.py)
            state_files, history, linked = write_trainer_state(self.trainer_state, self.tmp, self.final)
            files |= state_files
            cio.write_manifest(self.tmp, files, {**self.manifest, **history, **model_listed}, entries=files)
            # every file and tmp's entries durable before the rename (a linked segment's data already is)
            cio.sync_files(self.tmp, [*(name for name in files if name not in linked), cio.MANIFEST])
            publish_directory(self.tmp, self.final)
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        finally:
            self.bundles, self.weights = [], None  # the host copies are the buffers': hold no reference
        return self.final

    def rollback(self, state: State) -> None:
        """The write failed: the best checkpoint is again the one before (if the take had made this one it)."""
        rollback_best(state, self.final, self.previous_best)

    def discard(self) -> None:
        """Never written (the take failed half way, or the writer was not started): remove the temporary folder."""
        shutil.rmtree(self.tmp, ignore_errors=True)


def claim_best(state: State, final: Path) -> str | None:
    """``final`` becomes the best checkpoint when this step is the best step (``state.best_global_step``, the
    BestMetric plugin's); returns the best checkpoint before, for ``rollback_best``."""
    previous = state.best_model_checkpoint
    if state.best_global_step is not None and state.best_global_step == state.global_step:
        state.best_model_checkpoint = str(final)
    return previous


def rollback_best(state: State, final: Path, previous: str | None) -> None:
    """A save of ``final`` failed: the best checkpoint is again ``previous`` if ``claim_best`` had made it ``final``."""
    if state.best_model_checkpoint == str(final):
        state.best_model_checkpoint = previous


def take_checkpoint(
    engine: Engine,
    output_dir: str | Path,
    *,
    info: dict[str, Any] | None = None,
    rng_states: Sequence[dict[str, Any]],
    model_only: bool = False,
    model_folder: Callable[[Path], None] | None = None,
    buffers: HostBuffers | None = None,
) -> PendingCheckpoint:
    """Take this step's checkpoint (see the module doc); on failure nothing is left and the state is unchanged."""
    if engine.optimizer is None:
        raise ConfigError("save_checkpoint needs engine.optimizer: a checkpoint without it cannot resume")
    if saved_by_every_rank(engine.model):
        raise ConfigError("an FSDP or DeepSpeed model is saved by every rank: use save_sharded_checkpoint")
    state = engine.state
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.global_step}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    identity.run_id(state)  # the run's identity, in its state and its manifest (identity.py)
    previous_best = claim_best(state, final)
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        frozen_base = checkpoint_fingerprint(engine.model)
        part, weights = _take_model(engine, tmp, frozen_base, model_folder, buffers)
        bundles = [] if model_only else _take_training_state(engine, rng_states, buffers)
        manifest = _manifest_fields(state.global_step, len(rng_states), frozen_base, model_only)
        manifest |= {**(info or {}), identity.MANIFEST_KEY: state.run_id}
        taken = take_trainer_state(state)
    except BaseException:
        state.best_model_checkpoint = previous_best
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PendingCheckpoint(tmp, final, part, weights, bundles, taken, manifest, previous_best, buffers)


def buffers_plan(engine: Engine, *, optimizer: bool = True) -> list[tuple[str, torch.Size, torch.dtype, bool]]:
    """The host buffers an asynchronous ``take_checkpoint`` of this engine will fill for its large parts (the weights
    and, unless ``optimizer`` is False (save_only_model), the optimizer state, by the keys the take uses), for
    ``HostBuffers.reserve`` before the first save. No fingerprint is hashed: only whether there is a frozen base."""
    model = engine.model
    frozen = {} if adapter_model(model) is not None and frozen_parameters(model) else None
    name, weights = ModelPart(model, Path(), frozen).weights_to_write()
    plan = HostBuffers.planned(f"weights/{name}", weights)
    if optimizer and engine.optimizer is not None:
        plan += HostBuffers.planned("optimizer", codec.split_tensors(engine.optimizer.state_dict(), "optimizer")[1])
    return plan


def _manifest_fields(global_step: int, world_size: int, frozen_base: Any, model_only: bool) -> dict[str, Any]:
    """The manifest's own fields: the step, the world size, the frozen base, save_only_model."""
    processes = {"world_size": world_size} if world_size > 1 else {}
    base = {"frozen_base": frozen_base} if frozen_base is not None else {}
    only = {"model_only": True} if model_only else {}
    return {"global_step": global_step, **processes, **base, **only}


def _take_model(
    engine: Engine,
    tmp: Path,
    frozen_base: Any,
    model_folder: Callable[[Path], None] | None,
    buffers: HostBuffers | None,
) -> tuple[ModelPart, tuple[str, dict[str, torch.Tensor]] | None]:
    """The model part: the folder's files written now, the weights taken (written by ``PendingCheckpoint.write``).

    A ``model_folder`` whose ``saves_model`` is true (the facade, for a subclass overriding ``save_model`` /
    ``_save``) writes the model part itself, now: trainbus's weights only if its ``_save`` reaches the part
    (``model_part.py``); else ``finish`` writes them from the live model, so that part is never deferred.
    """
    part = ModelPart(engine.model, tmp, frozen_base)
    if model_folder is not None and getattr(model_folder, "saves_model", False):
        with part.open():
            model_folder(tmp)
        part.finish()  # writes trainbus's own weights from the live model if the override left them out
        return part, None
    name, tensors = part.weights_to_write()
    weights = (name, tensors if buffers is None else buffers.take(f"weights/{name}", tensors))
    part.write_adapter_folder()
    if model_folder is not None:
        added = added_files(tmp, model_folder)
        for name in [n for n in added if part.adapter is not None and n in BASE_MODEL_FILES]:
            (tmp / name).unlink()  # a base model's config.json in an adapter checkpoint would load a random base
    return part, weights


def _take_training_state(
    engine: Engine, rng_states: Sequence[dict[str, Any]], buffers: HostBuffers | None
) -> list[tuple[str, Any, dict[str, torch.Tensor]]]:
    """What a resume needs besides the model (optimizer, plugins' states, every rank's RNG states), split."""
    assert engine.optimizer is not None
    # the plugins part of engine.state_dict(), without its deep copy of State (the log history grows)
    values = [("optimizer", engine.optimizer.state_dict())]
    values.append(("plugins", {p.name: p.state_dict() for p in engine.plugins}))
    values += list(zip(rng_file_stems(len(rng_states)), rng_states, strict=True))
    bundles = []
    for stem, value in values:
        structure, tensors = codec.split_tensors(value, stem)  # a structure of its own: later changes do not reach it
        bundles.append((stem, structure, tensors if buffers is None else buffers.take(stem, tensors)))
    return bundles
