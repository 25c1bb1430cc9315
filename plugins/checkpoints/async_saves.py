"""The Checkpointing plugin's asynchronous side (``save_async=True``): the writer, the host buffers, the waits.

A background save runs only while training runs (from TRAIN_START to TRAIN_END, which waits for it): a
``write`` outside ``fit()`` (a direct ``_save_checkpoint`` after training) is written at once, under no
run's lock otherwise. Where the ranks of a multi-process run meet after a background write:

- the next save, the end of training, a reader of the checkpoint (``wait``): every rank waits for its own
  writer (rank 0's under DDP, each rank's under FSDP2), then a barrier, then a failed write's error;
- a failed run's cleanup: no collective (another rank may be inside an unrelated one, which a barrier
  could meet): the ranks that do not write wait for rank 0's word through the store (``signal_done`` /
  ``wait_done``), so none exits while rank 0 writes and has the launcher stop it mid-write.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

from trainbus.engine import Engine

from ..distributed.processes import barrier, rank, signal_done, wait_done, world_size
from .background import BackgroundWriter, PendingCheckpoint
from .sharded import saved_by_every_rank
from .snapshot import HostBuffers
from .writing import buffers_plan

logger = logging.getLogger("trainbus.checkpoint")

__all__ = ["FAILED_RUN_WAIT_S", "AsyncSaves"]

FAILED_RUN_WAIT_S = 600  # how long a failed run's other ranks wait for rank 0's checkpoint write to end


class AsyncSaves:
    """One Checkpointing plugin's background writes: submitted by the ranks that write, waited for by all."""

    def __init__(self, output_dir: Path, *, model_only: bool = False) -> None:
        self.output_dir = output_dir
        self.model_only = model_only  # save_only_model: no optimizer buffers are reserved
        self.writer = BackgroundWriter()
        self.buffers = HostBuffers()  # host copies of the tensors, reused between saves
        self.training = False  # between TRAIN_START and TRAIN_END: only then is a save written in the background
        self._barrier_due = False  # a background save since the last wait: every rank meets once it is written
        self._awaited: str | None = None  # a rank that does not write: the store key of rank 0's write in flight
        self._saves = 0  # background saves so far, the same count on every rank (a step may be saved twice)
        self._warmed = False  # the buffers were reserved for this run (after its first step)
        self._warming: threading.Thread | None = None

    def submit(self, engine: Engine, pending: PendingCheckpoint, then: Callable[[Path], None]) -> None:
        """A writing rank: write ``pending`` in the background (rank 0 tells the others through the store)."""
        self._saves += 1
        told = partial(signal_done, self._key(engine)) if world_size() > 1 else None
        self.writer.submit(pending, then, finally_=told)
        self._barrier_due = True

    def follow(self, engine: Engine) -> None:
        """A rank that does not write (DDP): rank 0 writes this save in the background."""
        self._saves += 1
        self._awaited = self._key(engine)
        self._barrier_due = True

    def written_elsewhere(self) -> None:
        """Every rank writes its part (FSDP2): the ranks meet at the next wait."""
        self._barrier_due = True

    def wait(self, engine: Engine, why: str = "", *, raise_error: bool = True, expected: bool = True) -> None:
        """Wait until the write in flight is on disk (every rank calls it: they meet after it), then raise its error
        if it failed; ``raise_error=False`` in a failed run's cleanup (no collective, the error is logged)."""
        if self._warming is not None:  # the buffers are the take's from here on
            self._warming.join()
            self._warming = None
        self.writer.wait(why, logging.INFO if expected else logging.WARNING)
        if self._barrier_due:
            self._barrier_due = False
            if raise_error:
                barrier()
            elif self._awaited is not None and not wait_done(self._awaited, FAILED_RUN_WAIT_S):
                logger.warning("rank 0's checkpoint write did not end within %d s (rank 0 gone?)", FAILED_RUN_WAIT_S)
            self._awaited = None
        if raise_error:
            self.writer.raise_error(engine.state)

    def step_end(self, engine: Engine) -> None:
        """The per-step check (an attribute read or two): the writer's error raised on the training thread; after the
        run's first step (the optimizer's state exists), the buffers reserved in a thread (``warm``)."""
        if self.writer.failed:
            self.writer.raise_error(engine.state)
        if not self._warmed:
            self._warmed = True
            self.warm(engine)

    def warm(self, engine: Engine) -> None:
        """Allocate and touch the host buffers of the weights and the optimizer state in a thread, so that the first
        save copies into memory already there (on the 51M-parameter model its step took 230 ms, the others 35 ms).
        Rank 0 of a run whose model one process saves; a sharded model's ranks allocate at their first save."""
        if rank() != 0 or engine.optimizer is None or saved_by_every_rank(engine.model):
            return
        plan = buffers_plan(engine, optimizer=not self.model_only)
        self._warming = threading.Thread(target=self.buffers.reserve, args=(plan,), name="trainbus-checkpoint-buffers")
        self._warming.start()

    def end(self, engine: Engine, failed: bool) -> None:
        """TRAIN_END: the write in flight ends; the buffers' host memory is released."""
        try:
            self.wait(engine, "the end of training", raise_error=not failed)
        finally:
            self.training = self._warmed = False
            self.buffers.clear()

    def _key(self, engine: Engine) -> str:
        """The store key rank 0's writer sets when this save's write ended (the same on every rank)."""
        return f"trainbus/checkpoint-written/{self.output_dir.absolute()}/{engine.state.global_step}/{self._saves}"
