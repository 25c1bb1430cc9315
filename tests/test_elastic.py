"""More than one machine, simulated on this one, and torchrun's restarts (issue 23, item 12).

Two nodes x one process: two torchrun agents (``--nnodes 2 --nproc_per_node 1``) meet at a c10d rendezvous
on localhost, as two machines of a cluster would, and train like one process with the same global batch.
A torchrun restart's ``train()`` goes on from the launch's last checkpoint by itself
(``resuming.resume_after_restart``): tested here in one process, with the environment torchrun gives a
restarted worker. A real ``torchrun --max-restarts 1`` run with a worker SIGKILLed at step 5 resumed
bit for bit on this machine, but not reliably: under torch 2.13 the restarted group's gloo set-up
sometimes reads the previous attempt's addresses from the agent's store ("connectFullMesh ...
Connection refused", about half the runs here), which costs another restart, and one run hung; that
job (``elastic_jobs.py restarted``) is kept for running by hand. Jobs are in ``elastic_jobs.py``; gloo
on the CPU, float64.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.dist_helpers import assert_close, free_port, launch_job, results, untimed

JOBS = Path(__file__).with_name("elastic_jobs.py")


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("WORLD_SIZE", None)
    return env


def _torchrun(options: list[str], job: str, out: Path) -> subprocess.Popen[str]:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", *options, str(JOBS), job, str(out)]
    return subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(launches: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    """Every launch's output; each must succeed within ``timeout`` s."""
    try:
        logs = [launch.communicate(timeout=timeout)[0] for launch in launches]
    finally:
        for launch in launches:
            if launch.poll() is None:
                launch.kill()
    for i, (launch, log) in enumerate(zip(launches, logs, strict=True)):
        assert launch.returncode == 0, f"torchrun {i} failed:\n{log[-6000:]}"
    return logs


def _launch_two_nodes(job: str, out: Path, timeout: float = 180) -> None:
    """Two torchrun agents, one per simulated node, meeting at a c10d rendezvous on localhost."""

    port = free_port()
    options = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}",
               "--rdzv_id=two-nodes", "--local_addr=127.0.0.1"]  # fmt: skip
    _wait([_torchrun([*options, f"--node_rank={node}"], job, out) for node in (0, 1)], timeout)


def _assert_same_run(one: dict, other: dict, *, exact: bool) -> None:
    if exact:
        assert one["params"] == other["params"]
        assert untimed(one["log_history"]) == untimed(other["log_history"])
        assert one["training_loss"] == other["training_loss"]
    else:
        assert_close(one["params"], other["params"], "params")
        assert_close(untimed(one["log_history"]), untimed(other["log_history"]), "log_history")
        assert_close(one["training_loss"], other["training_loss"], "training_loss")
    assert one["global_step"] == other["global_step"] == 9


def test_two_nodes_of_one_process_train_as_one_process(tmp_path: Path) -> None:
    _launch_two_nodes("nodes", tmp_path / "nodes")
    launch_job(JOBS, "nodes", tmp_path / "one", 1, timeout=120)
    alone = results(tmp_path / "one", "nodes")
    ranks = [results(tmp_path / "nodes", "nodes", rank) for rank in (0, 1)]
    assert alone["world_size"] == 1 and [r["world_size"] for r in ranks] == [2, 2]
    assert sorted(r["group_rank"] for r in ranks) == ["0", "1"]  # one process on each node
    for rank in ranks:
        _assert_same_run(rank, alone, exact=False)  # float64: agree to 1e-10 (another reduction order)
    assert ranks[0]["params"] == ranks[1]["params"]  # DDP: the ranks hold the same weights


def _regression_trainer(output_dir: Path, max_steps: int) -> Any:
    from tests.facade_helpers import Regressor, quiet_args, regression_data
    from trainbus.plugins import Trainer

    args = quiet_args(output_dir, max_steps=max_steps, save_strategy="steps", save_steps=2, logging_steps=1)
    return Trainer(Regressor(), args, train_dataset=regression_data(32))


def test_a_restart_resumes_only_its_own_launchs_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    _regression_trainer(tmp_path, 4).train()  # launch a's first attempt: checkpoint-2 and checkpoint-4
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = _regression_trainer(tmp_path, 6)
    restarted.train()  # launch a's restart goes on from checkpoint-4
    assert restarted.state.global_step == 6
    assert [entry["step"] for entry in restarted.state.log_history if "loss" in entry] == [1, 2, 3, 4, 5, 6]
    assert not (tmp_path / "previous-runs").exists()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-b")
    other = _regression_trainer(tmp_path, 4)
    with pytest.warns(UserWarning, match="checkpoint-2, checkpoint-4, checkpoint-6\\): this fresh run moved them"):
        other.train()  # another launch's restart: not resumed, a fresh run that sets launch a's checkpoints aside
    assert [entry["step"] for entry in other.state.log_history if "loss" in entry] == [1, 2, 3, 4]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "launch-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    first = _regression_trainer(tmp_path, 2)
    with pytest.warns(UserWarning, match="this fresh run moved them"):
        first.train()  # a first attempt never resumes by itself
    assert first.state.log_history[0]["step"] == 1
