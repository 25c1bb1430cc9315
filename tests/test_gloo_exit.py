"""``close_group``: once it returns, gloo's worker threads free no tensor, so the exit cannot abort in them.

gloo runs each collective on a worker thread of the group, which drops its reference to the finished work
only after the caller was woken and moved on. Freeing the work frees its tensors, and a tensor made in Python
takes the GIL to free: a worker that gets there once the interpreter is finalizing (the group outlives
``destroy_process_group`` while a DDP module or a trainer holds it) is ended by Python inside that destructor,
"terminate called without an active exception", SIGABRT, after a run that went well. On a loaded machine
that was a chance (about 1 in 49 distributed test runs under ``-n 2``). Here it is likely: each rank runs on
one CPU with the group's threads in the idle scheduling class, so the woken main thread takes the CPU from a
worker before it drops its work (in about 6 groups of 10; each process makes CYCLES groups in turn). A
tensor of the last collective alive when ``close_group`` returns must still be alive after the group's
threads were joined (ended with a plain barrier and ``destroy_process_group``, the joined threads freed it:
this test failed 14 runs in 14 then).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import run_processes

from trainbus.plugins.distributed.processes import close_group

pytestmark = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and hasattr(os, "SCHED_IDLE")), reason="Linux scheduling classes"
)


def _threads() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _names(threads: set[int]) -> list[str]:
    names = []
    for tid in threads & _threads():
        with open(f"/proc/self/task/{tid}/comm") as comm:
            names.append(comm.read().strip())
    return names


#: groups made and closed in turn by each process: a worker is late at close_group in most (not all) of them
CYCLES = 4


def _worker(rank: int, out: str) -> None:
    torch.set_num_threads(1)
    cpu = sorted(os.sched_getaffinity(0))[rank % len(os.sched_getaffinity(0))]
    for tid in _threads():
        os.sched_setaffinity(tid, {cpu})  # the threads started later inherit it
    results = [_cycle(rank, f"file://{out}/store-{cycle}") for cycle in range(CYCLES)]
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


def _cycle(rank: int, store: str) -> dict[str, Any]:
    """A group made, used once, closed, and freed (its threads joined): what was alive when, and its threads."""
    import torch.distributed as dist

    before = _threads()
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    group_threads = _threads() - before
    for tid in group_threads:  # off the CPU while the main thread can run
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    total = torch.ones(3, dtype=torch.float64)  # made in Python: freeing it takes the GIL
    dist.all_reduce(total)
    assert total.tolist() == [2.0, 2.0, 2.0]
    started = _names(group_threads)  # named by now: they ran
    tensor = weakref.ref(total)
    del total  # alive while a work holds it
    group: Any = dist.group.WORLD  # held past destroy_process_group, as a DDP module holds it
    close_group()
    held_at_close = tensor() is not None  # no group thread ran since close_group returned
    for tid in group_threads & _threads():
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    del group
    gc.collect()  # the last reference: the group's destructor joins its threads, which drop their works
    return {"held_at_close": held_at_close, "held_after_join": tensor() is not None, "started": started,
            "left": _names(group_threads)}  # fmt: skip


def test_no_tensor_is_freed_by_gloo_threads_after_close_group(tmp_path: Path) -> None:
    run_processes(_worker, (str(tmp_path),), timeout=240)
    for rank in range(2):
        for result in json.loads((tmp_path / f"rank{rank}.json").read_text()):
            # the worker threads ran to their end (torch names them; the transport's thread stays with the kept work)
            assert "pt_gloo_runloop" in result["started"] and "pt_gloo_runloop" not in result["left"], result
            # a tensor held at close_group was not freed by the group's threads afterwards
            assert result["held_after_join"] == result["held_at_close"], result


def test_close_group_without_a_group_does_nothing() -> None:
    assert not torch.distributed.is_initialized()
    close_group()
    assert not torch.distributed.is_initialized()
