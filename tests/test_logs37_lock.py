"""Tidying and setting aside only under the lock (#37 item 3): a save in flight is never touched by another process,
whatever its pid namespace or host; the lock, not the pid, says who is alive.

Another container is simulated by a process that holds the output_dir's flock (as trainbus takes it) with a lock file
naming another host, and a save in flight named with a pid that is dead here (a writer in another pid namespace);
a leftover named with a pid that lives here but holds no lock (another namespace's dead writer whose pid number is
reused here) is stale, and tidied once the lock is free.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.logs37_helpers import engine, steps, trainer, tree
from trainbus.plugins import TrainerCallback
from trainbus.plugins.checkpoints.directory import previous_runs
from trainbus.plugins.checkpoints.lock import LOCK_FILE, OutputDirInUse
from trainbus.plugins.checkpoints.resuming import resume

#: holds argv[1]'s lock as trainbus takes it (flock on .trainbus.lock), naming a host and pid of another container
HOLDER = textwrap.dedent(
    """
    import fcntl, json, os, sys
    fd = os.open(os.path.join(sys.argv[1], ".trainbus.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": 7, "host": "node-17-container-b", "started": "2026-11-29T09:00:00+00:00"}).encode())
    print("held", flush=True)
    sys.stdin.read()
    """
)
DEAD_PID = 4_000_000  # above any pid_max: no process here has it


@pytest.fixture
def another_container(tmp_path: Path) -> Iterator[Path]:
    """output_dir with a checkpoint-2, and another container's run holding the lock while it saves step 4."""
    out = tmp_path / "out"
    engine(out, 4, save_steps=2).fit()
    os.replace(out / "checkpoint-4", out / f"checkpoint-4.tmp-{DEAD_PID}")  # its save in flight
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield out
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_resume_true_never_touches_a_save_in_flight_of_another_container(another_container: Path) -> None:
    out = another_container
    before = tree(out)
    resumed = engine(out, 8, save_steps=2)
    assert resume(resumed, True) == out / "checkpoint-2"  # read only: the newest complete one
    assert tree(out) == before  # the save in flight (and everything else) untouched
    with pytest.raises(OutputDirInUse, match="node-17-container-b"):
        resumed.fit()
    assert tree(out) == before


def test_a_fresh_engine_run_never_touches_it_either(another_container: Path) -> None:
    before = tree(another_container)
    with pytest.raises(OutputDirInUse, match=r"pid 7 on host node-17-container-b"):
        engine(another_container, 8, save_steps=2).fit()
    assert tree(another_container) == before and not previous_runs(another_container)


def test_a_trainer_resume_with_auto_find_batch_size_never_touches_it(another_container: Path) -> None:
    """auto_find_batch_size reads the checkpoint's batch size before train() takes the lock."""
    before = tree(another_container)
    run = trainer(another_container, save_strategy="steps", save_steps=2, auto_find_batch_size=True)
    with pytest.raises(OutputDirInUse):
        run.train(resume_from_checkpoint=True)
    assert tree(another_container) == before


def test_a_trainer_resume_never_touches_it(another_container: Path) -> None:
    before = tree(another_container)
    with pytest.raises(OutputDirInUse):
        trainer(another_container, save_strategy="steps", save_steps=2).train(resume_from_checkpoint=True)
    assert tree(another_container) == before


def test_a_leftover_of_a_live_pid_that_holds_no_lock_is_stale(tmp_path: Path) -> None:
    """A re-save of step 6 interrupted between its renames: its complete copy, named with a pid alive here (the
    parent's) but no lock held: the lock says its writer is gone, so the copy is put back and resumed."""
    engine(tmp_path, 6, save_steps=2).fit()
    os.replace(tmp_path / "checkpoint-6", tmp_path / f"checkpoint-6.old-{os.getppid()}")
    (tmp_path / f"checkpoint-8.tmp-{os.getppid()}").mkdir()  # a save that died half written
    resumed = engine(tmp_path, 8, save_steps=2)
    assert resume(resumed, True) == tmp_path / "checkpoint-6"
    assert not (tmp_path / f"checkpoint-8.tmp-{os.getppid()}").exists()
    resumed.fit()
    assert steps(tmp_path) == [2, 4, 6, 8]


def test_a_trainer_puts_back_a_live_pids_leftover_once_the_lock_is_free(tmp_path: Path) -> None:
    trainer(tmp_path, max_steps=6, save_strategy="steps", save_steps=2).train()
    os.replace(tmp_path / "checkpoint-6", tmp_path / f"checkpoint-6.tmp-{os.getppid()}")
    resumed = trainer(tmp_path, save_strategy="steps", save_steps=2)
    seen: list[int] = []
    resumed.add_callback(type("Seen", (TrainerCallback,), {"on_train_begin": lambda self, a, state, c, **k: seen.append(
        state.global_step)})())  # fmt: skip
    resumed.train(resume_from_checkpoint=True)
    assert seen == [6]  # resumed from the put-back step 6, not from 4
    assert not (tmp_path / f"checkpoint-6.tmp-{os.getppid()}").exists() and steps(tmp_path) == [2, 4, 6, 8]


def test_a_lock_file_naming_another_host_but_unlocked_is_taken_over(tmp_path: Path) -> None:
    """A killed run's lock file (its host's name inside) locks nothing: the next run tidies and trains."""
    engine(tmp_path, 4, save_steps=2).fit()
    half = tmp_path / f"checkpoint-6.tmp-{DEAD_PID}"  # a save killed half written
    shutil.copytree(tmp_path / "checkpoint-4", half)
    (half / "manifest.json").unlink()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"pid": 7, "host": "node-17-container-b"}))
    fd = os.open(tmp_path / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: we can take it (then give it back)
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
    resumed = engine(tmp_path, 6, save_steps=2)
    assert resume(resumed, True) == tmp_path / "checkpoint-4"
    assert not (tmp_path / f"checkpoint-6.tmp-{DEAD_PID}").exists()  # stale: tidied under the lock
    resumed.fit()
    assert steps(tmp_path) == [2, 4, 6]
