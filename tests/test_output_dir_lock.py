"""One run per output_dir at a time (#23, item 1); a fresh run sets an earlier run's checkpoints aside and deletes
nothing (#27 item 6: tests/test_rerun_output_dir.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import safetensors.torch as st
import torch

from tests.facade_helpers import Regressor, quiet_args, regression_data
from trainbus.plugins import Trainer, TrainerCallback
from trainbus.plugins.checkpoints.lock import LOCK_FILE, OutputDirInUse, OutputDirLock

ROOT = Path(__file__).resolve().parent.parent
NAMING_THE_DIR = {"training_args.json", "manifest.json"}

#: a child process that trains a Trainer in argv[1] once the file argv[2] exists, and reports how it went
RUN = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    torch.set_num_threads(1)
    import safetensors.torch as st
    from tests.facade_helpers import Regressor, quiet_args, regression_data
    from trainbus.plugins import Trainer, TrainerCallback

    class Slow(TrainerCallback):  # long enough that the two runs overlap
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(0.05)

    out, go, report = sys.argv[1], sys.argv[2], sys.argv[3]
    torch.manual_seed(0)
    args = quiet_args(out, max_steps=12, save_strategy="steps", save_steps=4, learning_rate=0.05)
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(48), callbacks=[Slow()])
    open(report + ".ready", "w").close()  # built: waiting for the go
    while not os.path.exists(go):
        time.sleep(0.001)
    try:
        trainer.train()
    except Exception as exc:
        json.dump({"error": type(exc).__name__, "message": str(exc)}, open(report, "w"))
    else:
        st.save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items()}, report + ".weights")
        json.dump({"steps": trainer.state.global_step}, open(report, "w"))
    """
)

#: a child that holds argv[1]'s lock until its stdin closes
HOLD = textwrap.dedent(
    """
    import sys
    from trainbus.plugins.checkpoints.lock import OutputDirLock
    lock = OutputDirLock.acquire(sys.argv[1])
    print("held", flush=True)
    sys.stdin.read()
    """
)


def child(script: str, *args: str, stdin: int | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], cwd=ROOT, env=env, text=True, stdin=stdin, stdout=subprocess.PIPE
    )


def solo_trainer(out: Path, **kwargs: object) -> Trainer:
    torch.manual_seed(0)
    kwargs = {"max_steps": 12, "save_strategy": "steps", "save_steps": 4, "learning_rate": 0.05, **kwargs}
    args = quiet_args(out, **kwargs)
    return Trainer(Regressor(), args, train_dataset=regression_data(48))


def file_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): _less_run_id(p) for p in sorted(root.rglob("*")) if p.is_file()}


def _less_run_id(path: Path) -> bytes:
    """The file's bytes; of trainbus_state.json those less its run_id (each run has its own)."""
    if path.name != "trainbus_state.json":
        return path.read_bytes()
    document = json.loads(path.read_bytes())
    del document["state"]["run_id"]
    return json.dumps(document, sort_keys=True).encode()


def test_two_runs_started_together_one_trains_bit_exact_the_other_fails_naming_it(tmp_path: Path) -> None:
    out, go = tmp_path / "shared", tmp_path / "go"
    runs = [child(RUN, str(out), str(go), str(tmp_path / f"report{i}")) for i in range(2)]
    deadline = time.monotonic() + 240  # both built (imports are slow on a loaded machine) before the go
    while not all((tmp_path / f"report{i}.ready").exists() for i in range(2)):
        assert time.monotonic() < deadline and all(run.poll() is None for run in runs), "a run did not start"
        time.sleep(0.01)
    go.touch()  # both start train() at once
    for run in runs:
        assert run.wait(timeout=300) == 0
    reports = [json.loads((tmp_path / f"report{i}").read_text()) for i in range(2)]
    winners = [i for i, r in enumerate(reports) if "steps" in r]
    assert len(winners) == 1, reports
    (loser,) = [r for r in reports if "error" in r]
    # the loser failed at once, saying who holds the directory: it wrote nothing, moved nothing aside
    assert loser["error"] == "OutputDirInUse", loser
    assert f"host {socket.gethostname()}" in loser["message"] and "pid " in loser["message"]
    assert not (out / "previous-runs").exists()
    assert reports[winners[0]]["steps"] == 12
    solo = solo_trainer(tmp_path / "solo")
    solo.train()
    weights = st.load_file(str(tmp_path / f"report{winners[0]}.weights"))
    for name, tensor in solo.model.state_dict().items():
        assert torch.equal(weights[name], tensor), name
    for step in (4, 8, 12):  # every checkpoint the winner wrote is the solo run's, byte for byte (but the
        ours, theirs = (file_bytes(root / f"checkpoint-{step}") for root in (out, tmp_path / "solo"))
        assert ours.keys() == theirs.keys()  # files naming the output_dir: the arguments, and so the manifest)
        assert {k: v for k, v in ours.items() if k not in NAMING_THE_DIR} == {
            k: v for k, v in theirs.items() if k not in NAMING_THE_DIR
        }
    assert not (out / LOCK_FILE).exists()  # released at the end of train()


def test_a_held_output_dir_fails_at_once_and_a_killed_holder_frees_it(tmp_path: Path) -> None:
    holder = child(HOLD, str(tmp_path), stdin=subprocess.PIPE)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        trainer = solo_trainer(tmp_path)
        started = time.monotonic()
        with pytest.raises(OutputDirInUse, match=rf"in use by another training run \(pid {holder.pid} on host "):
            trainer.train()
        assert time.monotonic() - started < 5
        assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE]  # nothing written
        holder.send_signal(signal.SIGKILL)  # however the holder dies, the kernel drops its lock
        holder.wait(timeout=30)
    finally:
        holder.kill()
    assert (tmp_path / LOCK_FILE).exists()  # left by the killed holder, unlocked: taken over
    assert trainer.train().global_step == 12
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_lock_is_released_when_training_fails(tmp_path: Path) -> None:
    class Failing(TrainerCallback):
        def on_step_end(self, args: object, state: object, control: object, **kwargs: object) -> None:
            raise RuntimeError("boom")

    trainer = solo_trainer(tmp_path)
    trainer.add_callback(Failing())
    with pytest.raises(Exception, match="boom"):
        trainer.train()
    assert not OutputDirLock._held and not (tmp_path / LOCK_FILE).exists()
    lock = OutputDirLock.acquire(tmp_path)  # free again
    lock.release()


def test_the_same_process_may_take_its_own_lock_again(tmp_path: Path) -> None:
    first = OutputDirLock.acquire(tmp_path)
    second = OutputDirLock.acquire(tmp_path)
    assert second is first
    second.release()
    assert (tmp_path / LOCK_FILE).exists()
    holder = json.loads((tmp_path / LOCK_FILE).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and "started" in holder
    first.release()
    assert not (tmp_path / LOCK_FILE).exists()
