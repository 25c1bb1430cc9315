"""Running a function in 2 gloo processes from a test: spawned, bounded in time, port chosen here."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.multiprocessing as mp


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
