"""The background writer of asynchronous checkpoints: one write in flight, its error never lost.

``Checkpointing(save_async=True)`` takes a checkpoint on the training thread (``writing.take_checkpoint``
with host buffers) and hands ``BackgroundWriter.submit`` the rest: writing the files, publishing the
folder and rotating. The promises the synchronous save keeps hold because the write is the same code
(``PendingCheckpoint.write``: a temporary folder, the manifest last, one fsync, a rename), and because:

- at most one write is in flight: ``submit`` first waits for the one before (and logs the wait with its
  seconds: saves more frequent than a write takes); the host buffers are reused only after that;
- whoever reads checkpoints waits first (``wait``): the next save, the end of training (before
  ``load_best_model_at_end``, rotation's ``only_best_at_end`` and the lock's release), a stop's
  checkpoint (written synchronously), a crash's cleanup; rotation and ``tidy`` run in the writer, after
  the rename, so nothing ever sees a half-written checkpoint, and the lock is held until the write ends;
- an error in the writer is kept and raised on the training thread at the next step (``raise_error``,
  a ``CheckpointWriteError`` from the writer's exception), or at the next wait, whichever comes first.

The writer is a thread started per write (a start costs well under a millisecond, once per save), not a
daemon: an interpreter that exits with a write in flight finishes it first. Its scheduling priority is
lowered (``os.setpriority`` on the thread, Linux), so on a machine with few cores the training threads
keep the CPU and the writer uses what they leave. Serialising and hashing release the GIL for large
tensors (safetensors and xxhash work on buffers), fsync waits in the kernel.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from trainbus.engine import State

logger = logging.getLogger("trainbus.checkpoint")

__all__ = ["BackgroundWriter", "CheckpointWriteError"]

WRITER_NICENESS = 10  # how much lower than training the writer thread is scheduled (Linux threads)


class PendingCheckpoint(Protocol):
    """A checkpoint taken and not yet written (``writing.PendingCheckpoint``, ``sharded_async.PendingSharded``)."""

    final: Path

    def write(self) -> Path: ...

    def rollback(self, state: State) -> None: ...


class CheckpointWriteError(RuntimeError):
    """A background checkpoint write failed; its cause is the writer's exception. The checkpoints written before
    are intact (a failed write leaves only its temporary folder, removed)."""


class BackgroundWriter:
    """Runs one ``PendingCheckpoint.write`` at a time in a thread; the training thread waits where it reads."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._pending: PendingCheckpoint | None = None
        self._error: BaseException | None = None
        self._failed: PendingCheckpoint | None = None
        self.waited_seconds = 0.0  # the training thread's total wait for writes (for logs and benchmarks)
        self.writes = 0
        self._warned = False

    @property
    def busy(self) -> bool:
        """A write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """A write failed and its error has not been raised yet (one attribute read: the per-step check)."""
        return self._error is not None

    def submit(
        self,
        pending: PendingCheckpoint,
        then: Callable[[Path], None],
        why: str = "a checkpoint",
        finally_: Callable[[], None] | None = None,
    ) -> None:
        """Write ``pending`` in the background, then call ``then(final)`` there (rotation), and ``finally_()`` once
        the write ended either way (telling the other ranks); waits for the write before (logged when it had to)."""
        self.wait(why)
        self._pending = pending
        thread = threading.Thread(
            target=self._run, args=(pending, then, finally_), name="trainbus-checkpoint-writer"
        )
        self._thread = thread
        thread.start()

    def _run(
        self, pending: PendingCheckpoint, then: Callable[[Path], None], finally_: Callable[[], None] | None
    ) -> None:
        _lower_priority()
        try:
            final = pending.write()
            then(final)
            self.writes += 1
        except BaseException as exc:  # kept for the training thread: an error here is never lost
            self._error, self._failed = exc, pending
            logger.error("the background write of %s failed: %s", pending.final, exc)
        finally:
            if finally_ is not None:
                try:
                    finally_()
                except Exception as exc:  # the store is gone: the other ranks stop waiting at their time limit
                    logger.warning("could not tell the other ranks that %s was written: %s", pending.final, exc)

    def wait(self, why: str = "", level: int = logging.WARNING) -> float:
        """Wait for the write in flight (if any); returns the seconds waited, logged at ``level`` naming ``why`` when
        the write had not ended. Does not raise its error."""
        thread = self._thread
        if thread is None:
            return 0.0
        started = time.perf_counter()
        waiting = thread.is_alive()
        thread.join()
        self._thread = self._pending = None
        waited = time.perf_counter() - started
        self.waited_seconds += waited
        if waiting and why:
            if level >= logging.WARNING and self._warned:
                level = logging.INFO  # once per writer as a warning: saves every step would repeat it every step
            self._warned = self._warned or level >= logging.WARNING
            logger.log(level, "%s waited %.2f s for the background checkpoint write before it", why, waited)
        return waited

    def raise_error(self, state: State) -> None:
        """Raise a failed write's error on the training thread, once; the best checkpoint is again the one before."""
        error, failed = self._error, self._failed
        if error is None or failed is None:
            return
        self._error = self._failed = None
        failed.rollback(state)
        raise CheckpointWriteError(
            f"the background write of checkpoint {failed.final} failed: {error!r}; the checkpoints written before "
            "are intact (fix the cause, e.g. free disk space, and resume from the newest one)"
        ) from error


def _lower_priority() -> None:
    """Schedule this thread below training's (Linux: a thread's niceness is its own); elsewhere nothing."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICENESS))
    except (AttributeError, OSError):  # no setpriority (Windows), or not allowed
        pass
