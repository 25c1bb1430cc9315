"""The checkpoints of an output_dir: listing, publishing, deleting, and tidying what a crash left.

Names in ``output_dir``:

- ``checkpoint-N``: a checkpoint; complete when its manifest reads (``verified.is_complete``);
- ``checkpoint-N.tmp-PID``: a save in progress (or a crashed one) of process PID;
- ``checkpoint-N.old-PID``: the previous copy of step N while a re-save of step N replaces it;
- ``checkpoint-N.del-PID``: a checkpoint rotation is deleting.

A re-save of step N (``publish_directory``) renames ``checkpoint-N`` to ``.old-PID``, then the
finished ``.tmp-PID`` to ``checkpoint-N``, then deletes ``.old-PID``. A crash between the two renames
leaves no ``checkpoint-N`` but two complete copies; ``tidy`` (run before a rotation and when a run
starts or resumes, always holding output_dir's lock) puts the newer intact one back as ``checkpoint-N``
instead of deleting both as stale (it used to). A save in flight is never touched: its writer holds the
lock, so no other process tidies, whatever its pid namespace or host (a pid decides nothing).

``previous-runs/<time>/checkpoint-N``: the checkpoints of an earlier run, set aside (``set_aside``)
when a fresh run started in the directory; ``<time>`` is when that run wrote its newest checkpoint
(UTC). Only the ``checkpoint-N`` entries directly in ``output_dir`` are a run's checkpoints:
rotation, ``latest_checkpoint`` and a resume never look into ``previous-runs``. The move is a
rename per checkpoint, journaled (``previous-runs/<time>/.moving.json`` lists each entry's inode and mtime):
a run killed in the middle leaves the journal, and the next start finishes the move
(``finish_set_aside``) before it reads or writes any checkpoint.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import shutil
from pathlib import Path

from . import io as cio
from . import verified
from .safety import DamagedCheckpoint

logger = logging.getLogger("trainbus.checkpoint")

PREFIX = "checkpoint-"
PREVIOUS_RUNS = "previous-runs"
JOURNAL = ".moving.json"
NAME = re.compile(r"^checkpoint-(\d+)$")
LEFTOVER = re.compile(r"^checkpoint-(\d+)\.(tmp|old|del)-(\d+)$")

__all__ = [
    "LEFTOVER",
    "NAME",
    "PREFIX",
    "PREVIOUS_RUNS",
    "checkpoint_dirs",
    "delete_checkpoint",
    "finish_set_aside",
    "latest_checkpoint",
    "list_checkpoints",
    "pid_alive",
    "previous_runs",
    "publish_directory",
    "set_aside",
    "tidy",
]


def checkpoint_dirs(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Every ``checkpoint-N`` entry of ``output_dir`` (complete or not, a symlink too), oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = NAME.match(child.name)
        if match and (child.is_symlink() or child.is_dir()):
            found.append((int(match.group(1)), child))
    return sorted(found)


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (a real directory with a readable manifest) in ``output_dir`` as ``(step, path)``,
    oldest first. A damaged sibling is left out, never an error."""
    return [(step, path) for step, path in checkpoint_dirs(output_dir) if verified.is_complete(path)]


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def publish_directory(tmp: Path, final: Path) -> None:
    """Rename a finished ``tmp`` directory to ``final`` and fsync the parent; an existing ``final`` (a
    re-save of that step) is replaced, and put back if the rename fails. Between the two renames both
    copies are complete on disk, so a crash there loses neither (``tidy`` puts one back)."""
    old = None
    if final.exists() or final.is_symlink():
        old = final.with_name(f"{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old is not None:
            os.replace(old, final)
        raise
    cio.fsync_path(final.parent)
    if old is not None:
        _remove(old)


def delete_checkpoint(path: Path) -> None:
    """Delete a checkpoint: renamed to ``.del-PID`` first, so a crash during the removal leaves no
    half-deleted directory that still has its manifest. Raises OSError when the rename fails."""
    doomed = path.with_name(f"{path.name}.del-{os.getpid()}")
    os.replace(path, doomed)
    _remove(doomed)


def _remove(path: Path) -> None:
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs here (our own pid counts as dead). Not what ``tidy`` asks: a pid means
    nothing in another pid namespace or on another host; output_dir's lock says who is alive."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists but belongs to someone else
    return True


def tidy(root: Path) -> list[Path]:
    """Clean up after processes that died in a save, a re-save or a rotation; returns what it put back.

    Call it only holding output_dir's lock (``lock.tidy_under_lock``): the lock, not a pid, says who is
    alive. Every process that writes checkpoints into output_dir holds it while it writes, so whoever holds
    it sees only leftovers of runs that ended; a pid says nothing across pid namespaces (containers) or
    hosts, where a live writer's pid may look dead, or a dead one's alive.

    For a step with no ``checkpoint-N``, the newest intact leftover (the re-save's ``.tmp``, else the
    previous ``.old``), verified file by file, is renamed back to ``checkpoint-N``; every other leftover
    is removed.
    """
    if not root.is_dir():
        return []
    by_step: dict[int, list[tuple[str, Path]]] = {}
    for child in root.iterdir():
        match = LEFTOVER.match(child.name)
        if match:
            by_step.setdefault(int(match.group(1)), []).append((match.group(2), child))
    restored = []
    for step, leftovers in sorted(by_step.items()):
        final = root / f"{PREFIX}{step}"
        if not (final.exists() or final.is_symlink()):
            order = {"tmp": 0, "old": 1}  # the re-save's copy is the newer one; a rotation's is not put back
            for kind, path in sorted((lo for lo in leftovers if lo[0] in order), key=lambda lo: order[lo[0]]):
                try:
                    verified.read_manifest(path, verify=True)
                except DamagedCheckpoint:
                    continue
                os.replace(path, final)
                cio.fsync_path(root)
                logger.warning("put back %s from %s, left by a save that was interrupted", final, path.name)
                leftovers.remove((kind, path))
                restored.append(final)
                break
        for _, path in leftovers:
            _remove(path)
    return restored


# -- an earlier run's checkpoints, set aside ------------------------------------------------------
def _identity(path: Path) -> list[int]:
    found = os.stat(path, follow_symlinks=False)
    # a rename keeps all three; a checkpoint written since differs in one (a reused inode in its mtime)
    return [found.st_dev, found.st_ino, found.st_mtime_ns]


def set_aside(output_dir: str | Path) -> Path | None:
    """Move every ``checkpoint-N`` of ``output_dir`` into ``output_dir/previous-runs/<time>/``; returns that
    folder (None when there was none). Nothing is deleted or copied: one rename per checkpoint.

    ``<time>`` is when the newest of them was written (UTC, ``2025-01-31T09-30-00Z``; ``-2``, ... when
    taken). Leftovers of interrupted saves are tidied first (``tidy``), so a put-back copy moves too.
    Call it holding the output_dir's lock, on the process that writes checkpoints.
    """
    root = Path(output_dir)
    finish_set_aside(root)
    tidy(root)
    found = [path for _, path in checkpoint_dirs(root)]
    if not found:
        return None
    newest = max(os.stat(path, follow_symlinks=False).st_mtime for path in found)
    stamp = datetime.datetime.fromtimestamp(newest, datetime.UTC).strftime("%Y-%m-%dT%H-%M-%SZ")
    folder = root / PREVIOUS_RUNS / stamp
    folder.parent.mkdir(exist_ok=True)
    for n in range(2, 10_000):
        try:
            folder.mkdir()
            break
        except FileExistsError:
            folder = root / PREVIOUS_RUNS / f"{stamp}-{n}"
    journal = folder / JOURNAL
    journal.write_text(json.dumps({path.name: _identity(path) for path in found}), encoding="utf-8")
    cio.fsync_path(journal)
    cio.fsync_path(folder)
    _move_listed(root, folder, journal)
    return folder


def finish_set_aside(output_dir: str | Path) -> list[Path]:
    """Finish the moves a killed run left half done (a journal still there); returns their folders."""
    finished = []
    for journal in sorted(Path(output_dir).glob(f"{PREVIOUS_RUNS}/*/{JOURNAL}")):
        _move_listed(Path(output_dir), journal.parent, journal)
        logger.warning("finished setting aside an earlier run's checkpoints into %s (a move was interrupted)",
                       journal.parent)  # fmt: skip
        finished.append(journal.parent)
    return finished


def _move_listed(root: Path, folder: Path, journal: Path) -> None:
    """Move the journal's entries still in ``root`` (the same inode: not a checkpoint written since) to ``folder``."""
    try:
        listed = json.loads(journal.read_text(encoding="utf-8"))
    except ValueError:
        listed = {}  # torn as it was written: nothing was moved yet
    for name, identity in listed.items():
        path = root / name
        try:
            if NAME.match(name) and (path.exists() or path.is_symlink()) and _identity(path) == identity:
                os.replace(path, folder / name)
        except FileNotFoundError:
            continue  # moved meanwhile (only a process outside the lock could): nothing left to move
    cio.fsync_path(folder)
    cio.fsync_path(root)
    journal.unlink(missing_ok=True)
    if not any(folder.iterdir()):
        folder.rmdir()  # a journal torn as it was written: nothing had moved


def previous_runs(output_dir: str | Path) -> list[Path]:
    """The folders of earlier runs' checkpoints set aside in ``output_dir``, oldest first."""
    parent = Path(output_dir) / PREVIOUS_RUNS
    return sorted(path for path in parent.iterdir() if path.is_dir()) if parent.is_dir() else []
