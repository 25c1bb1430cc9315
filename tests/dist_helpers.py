"""Multi-process tests: spawned gloo workers, jobs scripts launched as users launch them, and their results.

``run_processes`` runs a function in spawned processes. ``launch_job`` runs a jobs script
(``dist_jobs.py``, ``sharded_jobs.py``) with plain python, torchrun or accelerate launch; the script
hands its arguments to ``run_job_main``, which writes each rank's result to ``OUT/JOB-rank{r}.json``
for ``results`` to read back. Job subprocesses import this module too, so it has no pytest side effects.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from trainbus.plugins.distributed.processes import close_group

TOL = 1e-10  # the jobs run in float64: one process and several agree this closely
TIMED = ("runtime", "per_second")  # log keys that measure time, not training


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_processes(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int = 2, timeout: float = 120.0) -> None:
    """Run ``worker(rank, *args)`` in ``nprocs`` spawned processes; fail the test past ``timeout`` s.

    Spawn, not fork: forking a pytest-xdist worker, which runs threads, can deadlock the child.
    """
    started = time.monotonic()
    context = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    while not context.join(timeout=1):
        if time.monotonic() - started > timeout:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {nprocs}-process run did not finish in {timeout:.0f} s")


# -- jobs scripts, launched ----------------------------------------------------------------------------
def launch_job(
    script: Path,
    job: str,
    out: Path,
    processes: int,
    *,
    launcher: str = "torchrun",
    accelerate_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    expect_failure: str | None = None,
) -> None:
    """Run ``SCRIPT JOB OUT`` as a user would: plain python (one process), torchrun or accelerate launch.

    ``accelerate_args`` replace the default accelerate options (``--multi_gpu`` on ``processes``);
    ``env`` adds to the environment; ``expect_failure`` is text the run must fail with.
    """
    out.mkdir(parents=True, exist_ok=True)
    if processes == 1:
        command = [sys.executable, str(script)]
    elif launcher == "torchrun":
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={processes}",
            str(script),
        ]
    elif launcher == "accelerate":
        if accelerate_args is None:
            accelerate_args = [
                # --multi_gpu is accelerate's torchrun-based launcher; on a machine without GPUs its processes
                # use gloo on the CPU (--cpu alone starts one process unless MPI is set up)
                "--multi_gpu", f"--num_processes={processes}", "--num_machines=1", "--mixed_precision=no",
                "--dynamo_backend=no", f"--main_process_port={free_port()}",
            ]  # fmt: skip
        command = [sys.executable, "-m", "accelerate.commands.launch", *accelerate_args, str(script)]
    else:
        raise ValueError(f"launcher={launcher!r}; allowed: 'torchrun', 'accelerate'")
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("WORLD_SIZE", None)  # the launcher sets it; a one-process run must not inherit one
    done = subprocess.run([*command, job, str(out)], env=full_env, capture_output=True, text=True, timeout=timeout)
    if expect_failure is not None:
        assert done.returncode != 0, f"{job} was meant to fail:\n{done.stdout[-3000:]}"
        assert expect_failure in done.stdout + done.stderr, f"{job} failed otherwise:\n{done.stderr[-6000:]}"
        return
    assert done.returncode == 0, (
        f"{job} on {processes} process(es) failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )


def run_job_main(jobs: dict[str, Callable[[Path], Any]], argv: list[str]) -> None:
    """A jobs script's entry point: ``argv`` is ``[JOB, OUT]``; this rank's result goes to ``OUT/JOB-rank{r}.json``."""
    if len(argv) != 2 or argv[0] not in jobs:
        raise SystemExit(f"usage: JOB OUT, JOB one of {sorted(jobs)}; got {argv}")
    job, root = argv[0], Path(argv[1])
    torch.set_num_threads(1)
    result = jobs[job](root)
    rank = int(os.environ.get("RANK", "0"))
    (root / f"{job}-rank{rank}.json").write_text(json.dumps(result))
    close_group()  # as a user's script ends: every rank waits, and gloo's exit cannot abort (processes.py)


# -- their results, compared -----------------------------------------------------------------------------
def results(out: Path, job: str, rank: int = 0) -> dict[str, Any]:
    return json.loads((out / f"{job}-rank{rank}.json").read_text())  # type: ignore[no-any-return]


def assert_close(a: Any, b: Any, where: str = "") -> None:
    """Nested equality with floats within TOL (and NaN equal to NaN)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_close(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=0, abs_tol=TOL) or (math.isnan(a) and math.isnan(b)), f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def untimed(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The log entries without their timings, which differ from run to run."""
    return [{k: v for k, v in entry.items() if not any(t in k for t in TIMED)} for entry in log_history]
