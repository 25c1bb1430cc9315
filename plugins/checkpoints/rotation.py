"""Checkpoint rotation: which checkpoints ``save_total_limit`` keeps, and deleting the others.

The newest ``limit`` stay, the best and the newest are never deleted, and a checkpoint that cannot
be deleted is warned about and kept (rotation only saves disk space; the run goes on).
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Sequence
from pathlib import Path

from trainbus.engine import ConfigError

from .directory import delete_checkpoint, list_checkpoints
from .lock import tidy_under_lock

logger = logging.getLogger("trainbus.checkpoint")


def same_path(a: str | Path | None, b: Path) -> bool:
    return a is not None and Path(a).resolve() == b.resolve()


def checkpoints_to_keep(steps: list[int], limit: int, best: int | None) -> set[int]:
    """Which of ``steps`` (ordered oldest to newest) rotation keeps (HF's rule).

    The newest ``limit`` stay; when the best is older than those, it stays instead of the oldest
    of them, except that the newest always stays (so ``limit=1`` keeps best and newest: 2).
    """
    if limit < 1:
        raise ConfigError(f"save_total_limit must be an integer >= 1 or None, got {limit!r}")
    if best is None or best not in steps or best in steps[-limit:]:
        return set(steps[-limit:])
    newest = steps[-max(limit - 1, 1) :]
    return {best, *newest}


def rotate_checkpoints(
    output_dir: str | Path, limit: int | None, best: str | Path | None = None, written: Sequence[str | Path] = ()
) -> list[Path]:
    """Delete complete checkpoints beyond ``limit`` (never the best nor the newest); returns the deleted.

    ``written`` lists the checkpoints this run wrote, oldest first: they count as more recent than
    any other, so checkpoints an earlier run left with higher step numbers rotate out first and
    the checkpoint just written is never the one deleted.
    Incomplete directories are not counted and not touched, except, when this process holds output_dir's
    lock (a run's Checkpointing does), what ended saves left behind (``directory.tidy``: an interrupted
    re-save's copy is put back, the rest removed); with no limit only at a process's first rotation of
    ``output_dir``, so that a save lists nothing there.
    A checkpoint that cannot be deleted (permissions, a busy file system) is warned about and kept:
    rotation only saves disk space, and the run goes on.
    """
    root = Path(output_dir)
    if limit is None and _tidied(root):
        return []  # nothing to delete, nothing left to tidy: no listing, so a save costs the same at 10 or 10,000
    try:
        tidy_under_lock(root, take=False)  # only holding output_dir's lock: a run's own (lock.py)
    except OSError as exc:
        warn(f"checkpoint rotation could not tidy {root}: {exc}; the run goes on")
    if limit is None:
        return []
    found = list_checkpoints(output_dir)
    if not found:
        return []
    best_step = next((step for step, path in found if same_path(best, path)), None)
    ours = _ours(root, found, written)
    by_recency = [step for step, _ in found if step not in ours] + ours
    keep = checkpoints_to_keep(by_recency, limit, best_step)
    deleted = []
    for step, path in found:
        if step not in keep and delete_or_warn(path):
            deleted.append(path)
    return deleted


#: (output_dir, pid) whose leftovers this process has tidied once: while it holds the output_dir's lock no
#: other process writes there, and its own failed saves remove what they leave (checkpoint.save_checkpoint)
_TIDIED: set[tuple[str, int]] = set()


def _tidied(root: Path) -> bool:
    """Whether ``root`` was tidied by this process already (and mark it so)."""
    key = (str(root.absolute()), os.getpid())
    if key in _TIDIED:
        return True
    _TIDIED.add(key)
    return False


def _ours(root: Path, found: list[tuple[int, Path]], written: Sequence[str | Path]) -> list[int]:
    """The steps of ``found`` that ``written`` lists, in its order: matched by name, each folder resolved once
    (not every path the run wrote against every checkpoint there: that grew with the run)."""
    steps = {path.name: step for step, path in found}
    here = root.resolve()
    folders: dict[Path, bool] = {}
    ours = []
    for path in map(Path, written):
        if path.name in steps:
            inside = folders.get(path.parent)
            if inside is None:
                inside = folders[path.parent] = path.parent.resolve() == here
            if inside:
                ours.append(steps[path.name])
    return ours


def delete_or_warn(path: Path) -> bool:
    """Delete a checkpoint; a failure is a warning (the checkpoint stays), never the run's end."""
    try:
        delete_checkpoint(path)
    except OSError as exc:
        warn(f"checkpoint rotation could not delete {path} ({type(exc).__name__}: {exc}); it is kept, the run goes on")
        return False
    return True


def warn(message: str) -> None:
    logger.warning(message)
    warnings.warn(message, stacklevel=3)
