"""A resume in another process while a fresh run sets the earlier run aside touches nothing (issue 37, item 7).

The fresh run journals the move (``previous-runs/<time>/.moving.json``) and renames each checkpoint; a
``resume(engine, True)`` started meanwhile "finished" that journal as if its writer had died (it took no
lock): it moved the checkpoints itself and deleted the journal, and the fresh run failed on
FileNotFoundError in the middle of its own move. Only the lock's holder may finish or tidy anything.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.ckpt_hostile_helpers import make_engine
from trainbus.engine import ConfigError
from trainbus.plugins.checkpoints.checkpoint import resume
from trainbus.plugins.checkpoints.directory import JOURNAL, PREVIOUS_RUNS

ROOT = Path(__file__).resolve().parents[1]

#: a fresh run into ``out`` that stops inside its set-aside, after the journal, until ``go`` exists
FRESH_RUN = """
import sys, time
from pathlib import Path
sys.path.insert(0, {root!r})
from tests.ckpt_hostile_helpers import make_engine
from trainbus.plugins.checkpoints import directory

out, ready, go = Path({out!r}), Path({ready!r}), Path({go!r})
move = directory._move_listed

def paused(root, folder, journal):
    ready.touch()
    for _ in range(1200):
        if go.exists():
            break
        time.sleep(0.05)
    return move(root, folder, journal)

directory._move_listed = paused
engine = make_engine(out, 2)
engine.fit()
print("fresh run done at step", engine.state.global_step)
"""


def wait_for(path: Path, process: subprocess.Popen[str], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if process.poll() is not None:
            pytest.fail(f"the fresh run ended first: {process.communicate()}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("the fresh run never reached its set-aside")
        time.sleep(0.05)


def test_a_resume_during_a_set_aside_leaves_the_move_to_the_fresh_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    make_engine(out, 4).fit()  # the earlier run: checkpoints 2 and 4
    ready, go = tmp_path / "ready", tmp_path / "go"
    script = textwrap.dedent(FRESH_RUN).format(root=str(ROOT), out=str(out), ready=str(ready), go=str(go))
    fresh = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(ready, fresh)  # the fresh run holds the lock, its journal written, nothing moved yet
        journals = list((out / PREVIOUS_RUNS).glob(f"*/{JOURNAL}"))
        assert len(journals) == 1
        with contextlib.suppress(ConfigError):  # it may read a checkpoint not yet moved, or refuse: it only reads
            resume(make_engine(out, 6), True)
        assert journals[0].exists() and (out / "checkpoint-4").exists(), "the resume finished another run's move"
    finally:
        go.touch()
        stdout, stderr = fresh.communicate(timeout=300)
    assert fresh.returncode == 0, stderr[-3000:]
    assert "fresh run done at step 2" in stdout
    aside = journals[0].parent
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]  # the fresh run's own
