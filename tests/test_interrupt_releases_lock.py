"""Ctrl-C while a run's END handlers run still releases output_dir's lock (issue 37, item 7).

The lock is released by a cleanup handler at the very end of TRAIN_END. A KeyboardInterrupt raised by a
handler before it (a slow final save, a user's TRAIN_END handler, the closing after a failure) passed
through the dispatch and skipped it: the process kept the lock until it exited, so a notebook that
caught the Ctrl-C kept every other run out of that output_dir. Now the cleanup handlers after the
interrupted one still run, every END still open still closes, and then the interrupt is raised.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from tests.ckpt_hostile_helpers import make_engine
from trainbus.engine import Event, Priority
from trainbus.plugins.checkpoints.lock import LOCK_FILE, holds_lock


def lock_is_free(output_dir: Path) -> bool:
    """Whether a new open file description can take the flock (the process's own one would conflict)."""
    path = output_dir / LOCK_FILE
    if not path.exists():
        return True  # the holder removes it when it releases
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def interrupt(ev: Any) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("priority", [Priority.FIRST, Priority.LAST], ids=["first", "last"])
def test_ctrl_c_in_a_train_end_handler_releases_the_lock(tmp_path: Path, priority: Priority) -> None:
    engine = make_engine(tmp_path, 4)
    engine.on(Event.TRAIN_END, interrupt, priority=priority)
    with pytest.raises(KeyboardInterrupt):
        engine.fit()
    assert not holds_lock(tmp_path) and lock_is_free(tmp_path)


def test_ctrl_c_while_closing_after_a_failure_still_closes_the_run(tmp_path: Path) -> None:
    """A failure at step 3, then Ctrl-C in an EPOCH_END cleanup handler: TRAIN_END still closes (lock released)."""
    engine = make_engine(tmp_path, 4)
    closed: list[str] = []

    def fail(ev: Any) -> None:
        if ev.engine.state.global_step == 3:
            raise RuntimeError("a failure at step 3")

    engine.on(Event.STEP_END, fail)
    engine.on(Event.EPOCH_END, interrupt, cleanup=True)
    engine.on(Event.TRAIN_END, lambda ev: closed.append(type(ev.error).__name__), cleanup=True)
    with pytest.raises(KeyboardInterrupt) as raised:
        engine.fit()
    assert isinstance(raised.value.__context__, RuntimeError)  # the failure it interrupted is kept
    assert closed == ["RuntimeError"]
    assert not holds_lock(tmp_path) and lock_is_free(tmp_path)
