"""One run per output_dir, and a fresh run never destroys checkpoints it did not write.

Two runs in one output_dir overwrite and rotate away each other's checkpoints, and a resume of either
then loads the other's weights without a word. So a run holds an OS lock on ``output_dir/.trainbus.lock``
(``fcntl.flock``, exclusive, not blocking) from the start of ``train()`` to its end; the kernel drops
it when the process dies, however it dies, so a killed run never leaves the directory locked. The
lock file holds the holder's pid, host and start time (JSON), which a second run's error names; the
holder removes it when it ends (a killed run leaves it, unlocked: the next run takes it over). Only
rank 0 takes it (only rank 0 writes checkpoints); every rank learns the outcome, so every rank fails
together. A process may take the lock it holds again (the Trainer holds it around ``fit()``, and the
Checkpointing plugin takes it at TRAIN_START for runs without the Trainer).

A fresh run (not resuming) in an output_dir that holds ``checkpoint-*`` directories it did not write
refuses to start (``check_fresh_run``): its saves would overwrite the old run's checkpoint of the
same step and its rotation would delete the others. ``overwrite_output_dir=True`` is the one way to
replace them: the old checkpoints are deleted when the run starts, so nothing of the old run can
later be taken for this run's (a resume, the best model, rotation). Checkpoints this Trainer wrote
in an earlier ``train()`` (an ``auto_find_batch_size`` retry, a second ``train()``) are its own.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

from trainbus.engine import ConfigError, Engine

from ..distributed.processes import broadcast_from_main, rank
from .directory import checkpoint_dirs, delete_checkpoint, tidy

logger = logging.getLogger("trainbus.checkpoint")

LOCK_FILE = ".trainbus.lock"

__all__ = [
    "LOCK_FILE",
    "OutputDirInUse",
    "OutputDirLock",
    "check_fresh_run",
    "claim_output_dir",
    "hold_output_dir",
    "lock_on_main",
]


class OutputDirInUse(ConfigError):
    """Another run holds the output_dir's lock."""


class OutputDirLock:
    """An exclusive, non-blocking ``flock`` on ``output_dir/.trainbus.lock``, re-entrant within a process."""

    _held: ClassVar[dict[str, tuple[OutputDirLock, int]]] = {}  # real path -> (the lock, how many holds)

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / LOCK_FILE
        self.fd: int | None = None

    @classmethod
    def acquire(cls, output_dir: str | Path) -> OutputDirLock:
        """The lock of ``output_dir`` (created), or OutputDirInUse naming the holder."""
        root = Path(output_dir)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise ConfigError(f"output_dir={str(root)!r} is not a directory: {exc}") from exc
        key = os.path.realpath(root)
        held = cls._held.get(key)
        if held is not None:
            cls._held[key] = (held[0], held[1] + 1)
            return held[0]
        lock = cls(root)
        lock._take()
        cls._held[key] = (lock, 1)
        return lock

    def _take(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        while True:
            fd = os.open(self.path, flags, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                raise OutputDirInUse(
                    f"output_dir {self.path.parent} is in use by another training run ({describe(self.holder())}): "
                    "two runs in one output_dir overwrite and rotate away each other's checkpoints. Wait for that "
                    "run to end (its lock goes with its process), or give this run another output_dir"
                ) from None
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder removed the file as we opened it: lock the one now there
        holder = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder).encode(), 0)
        self.fd = fd

    def holder(self) -> dict[str, Any]:
        """What the lock file says about its holder ({} when it says nothing readable)."""
        for _ in range(20):  # the holder writes it just after taking the lock
            try:
                data = self.path.read_bytes()[:4096]
                if data:
                    value = json.loads(data)
                    return value if isinstance(value, dict) else {}
            except (OSError, ValueError):
                return {}
            time.sleep(0.01)
        return {}

    def release(self) -> None:
        """Give one hold back; the last one unlocks (and empties the file, so it names no one)."""
        key = os.path.realpath(self.path.parent)
        lock, holds = self._held.get(key, (self, 1))
        if holds > 1:
            self._held[key] = (lock, holds - 1)
            return
        self._held.pop(key, None)
        if self.fd is not None:
            fd, self.fd = self.fd, None
            try:
                with contextlib.suppress(OSError):
                    self.path.unlink()  # still locked: a run that opened it now sees another file, and retries
            finally:
                os.close(fd)  # closing the last descriptor drops the flock


def _same_file(fd: int, path: Path) -> bool:
    try:
        here = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


def describe(holder: dict[str, Any]) -> str:
    if not holder:
        return "holder unknown"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}"


def lock_on_main(output_dir: str | Path) -> OutputDirLock | None:
    """``output_dir``'s lock, taken on rank 0 (None on the others); every rank raises if it is taken."""
    lock: OutputDirLock | None = None
    error = None
    if rank() == 0:
        try:
            lock = OutputDirLock.acquire(output_dir)
        except ConfigError as exc:
            error = str(exc)
    error = broadcast_from_main(error)
    if error is not None:
        raise OutputDirInUse(error)
    return lock


@contextlib.contextmanager
def hold_output_dir(output_dir: str | Path) -> Iterator[None]:
    """Hold ``output_dir``'s lock on rank 0 for the block; every rank raises OutputDirInUse if it is taken."""
    lock = lock_on_main(output_dir)
    try:
        yield
    finally:
        if lock is not None:
            lock.release()


def check_fresh_run(output_dir: str | Path, own: Sequence[str | Path] = (), *, overwrite: bool = False) -> None:
    """Refuse a fresh run in a directory holding checkpoints it did not write; with ``overwrite`` delete them.

    Call it holding the lock, on the process that writes checkpoints. Leftovers of an interrupted
    re-save are put back first (``directory.tidy``), so they count too.
    """
    root = Path(output_dir)
    tidy(root)
    mine = {os.path.realpath(path) for path in own}
    foreign = [path for _, path in checkpoint_dirs(root) if os.path.realpath(path) not in mine]
    if not foreign:
        return
    names = ", ".join(path.name for path in foreign)
    if not overwrite:
        raise ConfigError(
            f"output_dir {root} holds checkpoints this run did not write ({names}); a fresh run would overwrite "
            "or rotate them away. Resume that run with train(resume_from_checkpoint=True), give this run another "
            "output_dir, or pass overwrite_output_dir=True to delete them and start over"
        )
    for path in foreign:
        try:
            delete_checkpoint(path)
        except OSError as exc:
            raise ConfigError(f"overwrite_output_dir=True: cannot delete the old checkpoint {path}: {exc}") from exc
        logger.warning("overwrite_output_dir=True: deleted %s, a checkpoint of an earlier run", path)


@contextlib.contextmanager
def claim_output_dir(engine: Engine, resume_from_checkpoint: Any, own: Sequence[str | Path] | None) -> Iterator[None]:
    """For a Trainer's ``train()``: hold its output_dir's lock, and check a fresh run's directory.

    Reads ``engine.args.output_dir`` and ``overwrite_output_dir``; ``own`` lists the checkpoints the
    run's Checkpointing plugin wrote (None: the run has none and writes no checkpoint, so only the lock).
    """
    args = getattr(engine, "args", None)
    output_dir = getattr(args, "output_dir", None)
    if output_dir is None:
        yield
        return
    with hold_output_dir(output_dir):
        if not resume_from_checkpoint and own is not None:
            error = None
            if rank() == 0:
                try:
                    check_fresh_run(output_dir, own, overwrite=bool(getattr(args, "overwrite_output_dir", False)))
                except ConfigError as exc:
                    error = str(exc)
            error = broadcast_from_main(error)
            if error is not None:
                raise ConfigError(error)
        yield
