"""One run per output_dir at a time; a new run sets an earlier run's checkpoints aside, never deletes them.

Two runs in one output_dir overwrite and rotate away each other's checkpoints, and a resume of either
then loads the other's weights without a word. So a run holds an OS lock on ``output_dir/.trainbus.lock``
(``fcntl.flock``, exclusive, not blocking) from the start of ``train()`` to its end; the kernel drops
it when the process dies, however it dies, so a killed run never leaves the directory locked. The
lock file holds the holder's pid, host and start time (JSON), which a second run's error names; the
holder removes it when it ends (a killed run leaves it, unlocked: the next run takes it over). Only
rank 0 takes it (only rank 0 writes checkpoints); every rank learns the outcome, so every rank fails
together. A process may take the lock it holds again (the Trainer holds it around its resume and
``fit()``; the Checkpointing plugin takes it at TRAIN_START, for any composition). The lock, not a pid,
says who is alive: leftovers of saves are tidied and earlier runs set aside only by a holder of the lock
(``tidy_under_lock``; a ``resume(engine, True)`` takes it if free, else touches nothing), so a save in
flight in another container or on another host, whose pid means nothing here, is never touched. The lock is the
main process's alone: a forked child (a DataLoader worker) closes its inherited descriptor at once
(``os.register_at_fork``), so a killed run's workers never keep the directory locked; an acquisition
that fails midway closes its descriptor, and an output_dir that cannot be locked is named with its
remedy (``lock_errors.py``).

Which checkpoints are a run's (the lineage rule). The ``checkpoint-N`` entries directly in
output_dir are the checkpoints of one run: the one that last started there fresh, and every resume
of it (a run killed and started again with ``resume_from_checkpoint=True`` is the same run). So:

- a fresh ``train()`` (``resume_from_checkpoint`` None or False), or a resume from a checkpoint
  outside output_dir (a branch from elsewhere), starts a new run. As under transformers 5 (which
  has no ``overwrite_output_dir``) it trains whatever output_dir holds, with the same numbers and
  the same checkpoint names; but first every ``checkpoint-N`` there (this Trainer's own from an
  earlier ``train()`` too) is moved into ``output_dir/previous-runs/<time>/`` (``start_fresh``,
  ``directory.set_aside``), with a warning naming that folder. Nothing is deleted;
  ``overwrite_output_dir`` changes nothing (HF's Trainer never read it);
- ``resume_from_checkpoint=True`` takes the newest intact ``checkpoint-N`` directly in output_dir;
  it never looks into ``previous-runs``, so it never resumes a run that a fresh run replaced, nor
  do rotation and ``latest_checkpoint`` see those. A set-aside checkpoint is resumed only by its
  path (``resume_from_checkpoint="out/previous-runs/.../checkpoint-8"``), which starts a new run;
- a checkpoint that does not fit the run (another model, optimizer or number of processes) is
  refused when it is applied, naming the difference (``reading.apply_checkpoint``).

The Checkpointing plugin applies the rule at TRAIN_START (``lineage.py``), so a bare Engine's fresh
``fit()`` sets the earlier run aside as a Trainer's fresh ``train()`` does, and ``resume(engine, ...)``
before ``fit()`` continues the run or starts a new one as ``resume_from_checkpoint`` would. A Trainer
always has its Checkpointing plugin (``save_strategy="no"`` still saves when a callback or a signal
asks); an engine without one takes no lock and moves nothing.
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
import stat
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from trainbus.engine import ConfigError

from ..distributed.processes import broadcast_from_main, rank
from .directory import finish_set_aside, set_aside, tidy
from .lock_errors import check_regular, unusable

logger = logging.getLogger("trainbus.checkpoint")

LOCK_FILE = ".trainbus.lock"

__all__ = [
    "LOCK_FILE",
    "OutputDirInUse",
    "OutputDirLock",
    "hold_output_dir",
    "holds_lock",
    "lock_on_main",
    "starts_a_run",
    "start_fresh",
    "tidy_under_lock",
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
        """The lock of ``output_dir`` (created), or OutputDirInUse naming the holder.

        Any other failure (a read-only or lockless filesystem, no permission, a lock file that is not a
        regular file, a full disk) is a ConfigError naming the path and what to do (``lock_errors.py``),
        and leaves nothing locked.
        """
        root = Path(output_dir)
        try:
            root.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as exc:
            raise ConfigError(f"output_dir={str(root)!r} is not a directory: {exc}") from exc
        except OSError as exc:
            raise unusable(root, exc, creating=True) from exc
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
        # O_NONBLOCK: a FIFO in its place must not block the open (it is refused below)
        flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        while True:
            try:
                fd = os.open(self.path, flags, 0o644)
            except OSError as exc:
                raise unusable(self.path, exc) from exc
            try:
                check_regular(fd, self.path)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise unusable(self.path, exc) from exc
                raise OutputDirInUse(
                    f"output_dir {self.path.parent} is in use by another training run ({describe(self.holder())}): "
                    "two runs in one output_dir overwrite and rotate away each other's checkpoints. Wait for that "
                    "run to end (its lock goes with its process), or give this run another output_dir"
                ) from None
            except BaseException:
                os.close(fd)
                raise
            if _same_file(fd, self.path):
                break
            os.close(fd)  # its holder removed the file as we opened it: lock the one now there
        try:
            holder = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            }
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except BaseException as exc:
            os.close(fd)  # a failed acquisition keeps no lock (closing our only descriptor drops it)
            if isinstance(exc, OSError):
                raise unusable(self.path, exc, writing=True) from exc
            raise
        self.fd = fd

    def holder(self) -> dict[str, Any]:
        """What the lock file says about its holder ({} when it says nothing readable)."""
        for _ in range(20):  # the holder writes it just after taking the lock
            try:
                data = _read_head(self.path, 4096)
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


def _forget_in_child() -> None:
    """In a forked child (a DataLoader worker): close the inherited lock descriptors and forget the holds.

    A flock belongs to the open file description, which fork shares: a child keeping its copy would hold
    the lock after the main process died (idle workers for seconds, a hung one for as long as it hangs).
    Closing a copy never unlocks the parent's (only LOCK_UN or closing the last copy does).
    """
    for lock, _ in OutputDirLock._held.values():
        if lock.fd is not None:
            with contextlib.suppress(OSError):
                os.close(lock.fd)
            lock.fd = None
    OutputDirLock._held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _read_head(path: Path, size: int) -> bytes:
    """At most ``size`` bytes of a regular file, never through a link nor from a FIFO or device put in its place."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        return os.read(fd, size) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    finally:
        os.close(fd)


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


def holds_lock(output_dir: str | Path) -> bool:
    """Whether this process holds ``output_dir``'s lock now."""
    return os.path.realpath(output_dir) in OutputDirLock._held


def tidy_under_lock(output_dir: str | Path, *, take: bool = True) -> bool:
    """Finish an interrupted set-aside and tidy leftovers of ended saves (``directory.tidy``), only under the lock.

    The lock is this process's hold, or (``take``) one taken now if it is free; when another process holds it
    (a run in flight, in this container or another, on this host or another), nothing is touched: its
    ``checkpoint-N.tmp-PID`` may be a save in progress, whatever the pid looks like from here. An output_dir
    that cannot be locked (read-only) is not tidied either. Returns whether it tidied.
    """
    root = Path(output_dir)
    if not root.is_dir():
        return False
    if not holds_lock(root) and not take:
        return False
    try:
        lock = OutputDirLock.acquire(root)  # re-entrant: a hold of this process is counted once more
    except ConfigError as exc:
        logger.info("not tidying %s: %s", root, exc)
        return False
    try:
        finish_set_aside(root)
        tidy(root)
    finally:
        lock.release()
    return True


def lock_on_main(output_dir: str | Path) -> OutputDirLock | None:
    """``output_dir``'s lock, taken on rank 0 (None on the others); every rank raises if it is taken
    (OutputDirInUse) or cannot be taken (ConfigError: ``lock_errors``)."""
    lock: OutputDirLock | None = None
    error = None
    if rank() == 0:
        try:
            lock = OutputDirLock.acquire(output_dir)
        except ConfigError as exc:
            error = (isinstance(exc, OutputDirInUse), str(exc))
    error = broadcast_from_main(error)
    if error is not None:
        raise (OutputDirInUse if error[0] else ConfigError)(error[1])
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


def start_fresh(output_dir: str | Path, resume_true: str = "resume(engine, True)") -> Path | None:
    """Set the checkpoints in ``output_dir`` aside for a new run (``directory.set_aside``), warning where.

    Call it holding the lock, on the process that writes checkpoints. Returns the folder they went to.
    ``resume_true``: how the caller's user resumes the newest checkpoint (the Trainer says
    ``train(resume_from_checkpoint=True)``), for the messages.
    """
    try:
        folder = set_aside(output_dir)
    except OSError as exc:
        raise ConfigError(
            f"output_dir {output_dir} holds an earlier run's checkpoints, and moving them aside for this fresh run "
            f"failed ({type(exc).__name__}: {exc}); nothing was deleted. Resume that run with "
            f"{resume_true}, or give this run another output_dir"
        ) from exc
    if folder is not None:
        names = ", ".join(sorted((p.name for p in folder.iterdir()), key=lambda name: (len(name), name)))
        message = (
            f"output_dir {output_dir} held checkpoints of an earlier run ({names}): this fresh run moved them "
            f"to {folder}, where rotation and {resume_true} never look (resume one by its path)"
        )
        logger.warning(message)
        warnings.warn(message, stacklevel=4)
    return folder


def starts_a_run(resume_from_checkpoint: Any, output_dir: str | Path) -> bool:
    """Whether ``train(resume_from_checkpoint=...)`` starts a new run in ``output_dir`` (the lineage rule above):
    a fresh one, or a resume from a checkpoint that is not directly in output_dir."""
    if not resume_from_checkpoint:
        return True
    if resume_from_checkpoint is True or not isinstance(resume_from_checkpoint, str | os.PathLike):
        return False  # True (the newest here), or a bad value its resume will name
    parent = os.path.dirname(os.path.abspath(resume_from_checkpoint))
    return os.path.realpath(parent) != os.path.realpath(output_dir)
