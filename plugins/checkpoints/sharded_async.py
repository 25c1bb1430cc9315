"""An asynchronous checkpoint of an FSDP2 run: every rank takes its part now, writes it in the background.

The layout and the commit are ``sharded_save.py``'s: every rank writes its own files into one temporary
folder, rank 0 gathers their manifest entries, writes the index, the shared files and the manifest, and
publishes the folder only once every rank's part is on disk; a failure on any rank leaves no checkpoint
and reaches every rank. What differs is where it runs:

- ``take_sharded_checkpoint`` (the training thread, every rank, at the SAVE): the folder's name and
  creation (collectives on the default group, as the synchronous save), this rank's slices of the
  weights and of the optimizer state copied into host buffers, and on rank 0 the shared state (plugins,
  every rank's RNG states, the trainer state) split and copied;
- ``PendingSharded.write`` (each rank's writer thread): the rank's files, then the gather and the
  outcome's broadcast over a gloo group of the writers' own (``writer_group``). A background thread must
  not issue collectives on the group training uses: two threads' collectives on one group would
  interleave differently on each rank.

DeepSpeed ZeRO checkpoints are written by DeepSpeed's own engine and stay synchronous.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import ConfigError, Engine, State

from ..distributed.deepspeed import deepspeed_engine_of
from ..distributed.processes import gather_to_main, keep_last_barrier, rank
from . import codec
from . import io as cio
from .history import TakenState, take_trainer_state
from .sharded import _reshard, optimizer_stem
from .sharded_save import (
    _local_model_state,
    _local_optimizer_state,
    _on_main,
    finish_sharded,
    save_sharded_checkpoint,
    shared_bundles,
    shared_fields,
    start_sharded,
)
from .snapshot import HostBuffers
from .writing import rollback_best
from .zero import model_file

logger = logging.getLogger("trainbus.checkpoint")

__all__ = ["PendingSharded", "ShardedSaves", "take_sharded_checkpoint", "writer_group"]

Bundle = tuple[str, Any, dict[str, torch.Tensor]]


def writer_group() -> Any:
    """A gloo group for the writer threads' collectives; every rank must call it at the same point (new_group)."""
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


@dataclass
class PendingSharded:
    """This rank's part of a sharded checkpoint, taken; ``write(group)`` writes it and (rank 0) publishes."""

    tmp: Path
    final: Path
    rank: int
    model: dict[str, torch.Tensor]
    index: dict[str, Any]
    optimizer: Bundle | None
    shared: tuple[dict[str, Any], list[Bundle], TakenState] | None  # rank 0: fields, bundles, trainer state
    previous_best: str | None
    buffers: HostBuffers
    failure: str | None = None  # this rank's take failed: reported through the commit, so every rank learns of it
    group: Any = None

    def write(self) -> Path:
        """Every rank's writer thread: this rank's files, then the commit over ``group``; raises on every rank if any
        rank failed (the folder removed)."""
        written: Any = self.failure
        try:
            if written is not None:
                raise RuntimeError(written)
            self.buffers.ready()
            files = {model_file(self.rank): cio.write_tensors(self.tmp / model_file(self.rank), self.model)}
            if self.optimizer is not None:
                files |= cio.write_split_bundle(self.tmp, *self.optimizer)
            cio.sync_files(self.tmp, files)
            written = {"layout": "fsdp2", "tensors": self.index, "files": files}
        except Exception as exc:  # reported to rank 0, which aborts the save for every rank
            written = self.failure or f"rank {self.rank}: {type(exc).__name__}: {exc}"
        finally:
            self.model, self.optimizer = {}, None  # the host copies are the buffers': hold no reference
        gathered = gather_to_main(written, group=self.group)
        outcome = _on_main(lambda: self._commit(gathered or []), group=self.group)
        self.shared = None
        if outcome is not None:
            raise RuntimeError(f"saving the sharded checkpoint {self.final} failed: {outcome}")
        return self.final

    def _commit(self, gathered: list[Any]) -> None:
        """Rank 0: publish once every rank's part is written (``sharded_save.finish_sharded``), else remove it all."""
        if self.shared is None:  # rank 0's own take failed: its message is among the gathered
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise RuntimeError("; ".join(w for w in gathered if isinstance(w, str)) or "rank 0's part was not taken")
        finish_sharded(self.tmp, self.final, gathered, *self.shared)

    def rollback(self, state: State) -> None:
        rollback_best(state, self.final, self.previous_best)


def take_sharded_checkpoint(
    engine: Engine,
    output_dir: str | Path,
    buffers: HostBuffers,
    *,
    info: Mapping[str, Any] | None = None,
    rng_states: Sequence[dict[str, Any]] | None = None,
    model_only: bool = False,
) -> PendingSharded:
    """Take this rank's part of ``checkpoint-{global_step}`` of an FSDP2 run; every rank must call it."""
    if engine.optimizer is None:
        raise ConfigError("save_checkpoint needs engine.optimizer: a checkpoint without it cannot resume")
    final, tmp, previous_best, outcome = start_sharded(engine, output_dir)
    if outcome is not None:
        rollback_best(engine.state, final, previous_best)
        raise RuntimeError(f"saving the sharded checkpoint {final} failed: {outcome}")
    pending = PendingSharded(tmp, final, rank(), {}, {}, None, None, previous_best, buffers)
    try:
        _take_parts(engine, pending, info, rng_states, model_only)
    except Exception as exc:  # every rank goes on to the commit, which fails the save on every rank
        pending.failure = f"rank {pending.rank}: {type(exc).__name__}: {exc}"
    return pending


def _take_parts(
    engine: Engine,
    pending: PendingSharded,
    info: Mapping[str, Any] | None,
    rng_states: Sequence[dict[str, Any]] | None,
    model_only: bool,
) -> None:
    """This rank's slices (and on rank 0 the shared state), copied into the host buffers."""
    assert engine.optimizer is not None
    buffers, me = pending.buffers, pending.rank
    _reshard(engine.model)
    tensors, pending.index = _local_model_state(engine.model, me)
    if not model_only:
        stem = optimizer_stem(me)
        structure, opt_tensors = codec.split_tensors(_local_optimizer_state(engine.optimizer), stem)
        pending.optimizer = (stem, structure, buffers.take(stem, opt_tensors))
    if me == 0:
        rngs = [] if model_only else list(rng_states or [])
        split = shared_bundles(engine, rngs, plugins=not model_only)
        bundles = [(stem, structure, buffers.take(stem, t)) for stem, structure, t in split]
        pending.shared = (shared_fields(engine, info, model_only), bundles, take_trainer_state(engine.state))
    pending.model = buffers.take("model", tensors)


class ShardedSaves:
    """The Checkpointing plugin's saves of a model every rank saves: FSDP2 in the background when asked (with a
    writer group made at the first one), DeepSpeed and synchronous saves through ``save_sharded_checkpoint``."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.group: Any = None
        self.warned = False

    def save(
        self, engine: Engine, info: Mapping[str, Any], rng_states: Any, model_only: bool, background: bool
    ) -> str:
        """Save this step's checkpoint; returns "background" when a writer thread writes it, else "written"."""
        plugin = self.plugin
        deepspeed = deepspeed_engine_of(engine.model) is not None
        if background and deepspeed and not self.warned:
            self.warned = True
            logger.warning("save_async: DeepSpeed writes its ZeRO checkpoints itself, so they are synchronous")
        if not background or deepspeed:
            save_sharded_checkpoint(engine, plugin.output_dir, info=info, rng_states=rng_states, model_only=model_only)
            return "written"
        if self.group is None:
            self.group = writer_group()  # every rank at this SAVE, the first asynchronous one
        saves = plugin._async  # AsyncSaves (async_saves.py)
        pending = take_sharded_checkpoint(
            engine, plugin.output_dir, saves.buffers, info=info, rng_states=rng_states, model_only=model_only
        )
        pending.group = self.group
        best, main = engine.state.best_model_checkpoint, pending.rank == 0
        saves.writer.submit(pending, lambda final: plugin._published(best, final, main))
        saves.written_elsewhere()
        return "background"

    def end(self) -> None:
        """The end of a run (every rank, the writes waited for): the writers' group ends safely for the exit."""
        keep_last_barrier(self.group)
