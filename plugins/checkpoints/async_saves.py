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
from collections.abc import Callable
from functools import partial
from pathlib import Path

from trainbus.engine import Engine

from ..distributed.processes import barrier, signal_done, wait_done, world_size
from .background import BackgroundWriter, PendingCheckpoint
from .snapshot import HostBuffers

logger = logging.getLogger("trainbus.checkpoint")

__all__ = ["FAILED_RUN_WAIT_S", "AsyncSaves"]

FAILED_RUN_WAIT_S = 600  # how long a failed run's other ranks wait for rank 0's checkpoint write to end


class AsyncSaves:
    """One Checkpointing plugin's background writes: submitted by the ranks that write, waited for by all."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.writer = BackgroundWriter()
        self.buffers = HostBuffers()  # host copies of the tensors, reused between saves
        self.training = False  # between TRAIN_START and TRAIN_END: only then is a save written in the background
        self._barrier_due = False  # a background save since the last wait: every rank meets once it is written
        self._awaited: str | None = None  # a rank that does not write: the store key of rank 0's write in flight
        self._saves = 0  # background saves so far, the same count on every rank (a step may be saved twice)

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

    def raise_if_failed(self, engine: Engine) -> None:
        """The per-step check: one attribute read, the writer's error raised on the training thread."""
        if self.writer.failed:
            self.writer.raise_error(engine.state)

    def end(self, engine: Engine, failed: bool) -> None:
        """TRAIN_END: the write in flight ends; the buffers' host memory is released."""
        try:
            self.wait(engine, "the end of training", raise_error=not failed)
        finally:
            self.training = False
            self.buffers.clear()

    def _key(self, engine: Engine) -> str:
        """The store key rank 0's writer sets when this save's write ended (the same on every rank)."""
        return f"trainbus/checkpoint-written/{self.output_dir.absolute()}/{engine.state.global_step}/{self._saves}"
