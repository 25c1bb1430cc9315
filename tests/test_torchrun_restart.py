"""A worker killed under ``torchrun --max-restarts 1`` is restarted and ends bit for bit as the run never killed.

torchrun's c10d rendezvous keeps one TCPStore in the agent for the whole launch, and a restarted attempt's
workers meet on it again: a process group made with plain ``env://`` finds the first attempt's keys (the
dead workers' gloo addresses) and fails to connect ("connectFullMesh ... Connection refused") or hangs.
trainbus makes the group of every attempt on the agent's store under a prefix named by the restart count
(``processes.init_attempt_group``), so each attempt meets only itself. The job is ``elastic_jobs.py
restarted``: rank 1 SIGKILLs itself at the end of step 5 on the first attempt; torchrun starts both ranks
again and the plain ``train()`` goes on from checkpoint-4. gloo on the CPU, float64.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_helpers import launch_job, results, untimed

JOBS = Path(__file__).with_name("elastic_jobs.py")


def _torchrun_with_one_restart(out: Path, timeout: float) -> str:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "--max-restarts=1", str(JOBS), "restarted", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    try:
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as late:
        raise AssertionError(f"torchrun did not finish in {timeout:.0f} s:\n{str(late.output)[-6000:]}") from None
    assert done.returncode == 0, f"torchrun failed:\n{done.stdout[-8000:]}"
    return done.stdout


def test_a_killed_worker_is_restarted_and_goes_on_from_its_last_checkpoint_bit_exact(tmp_path: Path) -> None:
    restarted, whole = tmp_path / "restarted", tmp_path / "whole"
    launch_job(JOBS, "nodes", whole, 2, timeout=150)  # the same run on two processes, never interrupted
    log = _torchrun_with_one_restart(restarted, timeout=180)
    assert (restarted / "killed-at-5").exists()  # the first attempt died at step 5
    assert "resuming from this launch's newest checkpoint" in log
    for rank in (0, 1):
        resumed, uninterrupted = results(restarted, "restarted", rank), results(whole, "nodes", rank)
        assert resumed["restarts"] == 1  # one restart was enough: the second attempt's group connected
        assert resumed["forwards"] == 9 - 4  # the second attempt trained steps 5-9 only: it resumed checkpoint-4
        assert resumed["params"] == uninterrupted["params"]
        assert untimed(resumed["log_history"]) == untimed(uninterrupted["log_history"])
        assert resumed["training_loss"] == uninterrupted["training_loss"]
        assert resumed["global_step"] == uninterrupted["global_step"] == 9
    manifest = json.loads((restarted / "run" / "checkpoint-8" / "manifest.json").read_text())
    assert manifest["torchelastic_run"]  # the launch that wrote it, which a restart resumes and nothing else does


def test_each_attempt_has_its_own_store_prefix_and_nothing_changes_outside_torchrun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainbus.plugins.distributed.attempt_group import attempt_store_prefix, init_attempt_group

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert attempt_store_prefix() is None
    assert init_attempt_group(cpu=True) is False  # plain python / accelerate launch: accelerate makes the group
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert attempt_store_prefix() is None  # the first attempt: torch's own group, as without trainbus
    assert init_attempt_group(cpu=True) is False
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert attempt_store_prefix() == "trainbus/attempt-1"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert init_attempt_group(cpu=True) is False  # one process: no group to make
