"""The few collectives trainbus features need, over the default ``torch.distributed`` group.

Every helper is a no-op (or the identity) in one process, so features call them unconditionally.
Under ``torch.distributed`` with more than one process trainbus assumes data-parallel training:
every rank runs the same loop on its shard, gradients are averaged across ranks (DDP), and what is
written to disk is written by rank 0.

These are torch.distributed's own collectives, not accelerate's ``gather_object`` & co: accelerate's
need its ``PartialState`` to have set up the group, and a user who called ``init_process_group``
and wrapped the model in DDP themselves must get the same exact losses and checkpoints.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import sys
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist


def world_size() -> int:
    """Processes in the default ``torch.distributed`` group (1 when it is not initialised)."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def rank() -> int:
    """This process's rank in the default group (0 when it is not initialised)."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise sum of ``tensor`` over every process, as a new tensor (no host read)."""
    if world_size() == 1:
        return tensor
    total = tensor.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def barrier() -> None:
    """Wait until every process gets here (a checkpoint is complete before anyone reads it)."""
    if world_size() > 1:
        dist.barrier()


def broadcast_from_main(value: Any, group: Any = None) -> Any:
    """Rank 0's ``value`` on every process (a path, a decision); the value travels pickled in memory only.
    ``group``: another process group than the default one (a writer thread's: checkpoints/sharded_async.py)."""
    if world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather(value: Any) -> list[Any]:
    """Every rank's ``value`` in rank order, on every rank (pickled in memory; for small facts, not per step)."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def gather_to_main(value: Any, group: Any = None) -> list[Any] | None:
    """Every rank's ``value`` in rank order on rank 0; None on the other ranks (``group``: as broadcast_from_main)."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] | None = [None] * world_size() if rank() == 0 else None
    dist.gather_object(value, gathered, dst=0, group=group)
    return gathered


def signal_done(key: str) -> None:
    """Mark ``key`` done in the default group's store (a thread may call it: no collective)."""
    if world_size() > 1:
        dist.distributed_c10d._get_default_store().set(key, b"1")


def wait_done(key: str, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for another rank's ``signal_done(key)``; False when it did not come (that rank died,
    or the store is gone). For a failed run's cleanup, where a collective could meet another rank's unrelated one."""
    if world_size() == 1:
        return True
    try:
        dist.distributed_c10d._get_default_store().wait([key], datetime.timedelta(seconds=timeout_s))
    except Exception:  # a timeout, or the store's host is gone: the caller logs what it could not wait for
        return False
    return True


def keep_last_barrier(group: Any) -> None:
    """``close_group``'s safe ending for a group made with ``new_group`` (its own threads): a barrier on it whose
    work is kept for the process, so no gloo worker of that group frees a tensor while Python finalizes.
    Every rank of the group calls it; the group stays usable."""
    if group is not None and dist.is_available() and dist.is_initialized():
        _last_barrier(group)


def collective_device() -> torch.device:
    """Where tensors for the default group's collectives live: the current GPU under NCCL, else the CPU."""
    if world_size() > 1 and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_closing = {"registered": False, "crashed": False}


def close_group() -> None:
    """The end of a multi-process run: wait for every rank, then destroy the default process group.

    Call it (``Trainer.end()`` does) where a script would call ``destroy_process_group``: unlike that, it
    makes the exit safe from gloo's abort (``_last_barrier``). A no-op without a group. It covers the default
    group's threads: a group made with ``new_group`` has threads of its own.
    """
    if dist.is_available() and dist.is_initialized():
        _last_barrier()
        dist.destroy_process_group()


def _last_barrier(group: Any = None) -> None:
    """A barrier, the group's last collective, whose work this process keeps until it ends.

    gloo runs each collective on one of the group's worker threads, which drops its reference to the finished
    work only after the caller has been woken and moved on. The work holds its tensors (and a barrier, weakly,
    every work in progress when it was issued); freeing a tensor made in Python takes the GIL. When that
    happens after the interpreter began finalizing (a worker delayed on a loaded machine, with the group still
    held past ``destroy_process_group`` by a DDP module or a trainer), Python ends the thread inside the
    destructor and the process aborts: SIGABRT, "terminate called without an active exception". A barrier
    snapshots, under the lock the workers release their works with, every work in progress or queued; kept
    alive (one object, never freed), it frees none of them, so no worker thread frees a tensor after this.
    """
    work = dist.barrier(group=group, async_op=True)
    work.wait()
    # a Python reference alone could be dropped while finalizing, before a delayed worker drops its own
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))


def close_group_at_exit() -> None:
    """At a clean interpreter exit, ``close_group``: wait for every rank and destroy the process group.

    A script that ends without closing the group lets one rank tear it down while another still talks to it,
    and leaves gloo's worker threads running into the interpreter's finalization (``_last_barrier``); either
    can abort a rank (SIGABRT) after a run that went well. After an uncaught exception the group is only
    destroyed: the other ranks may never arrive at a barrier.
    """
    if _closing["registered"]:
        return
    _closing["registered"] = True
    previous_hook = sys.excepthook

    def excepthook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        _closing["crashed"] = True
        previous_hook(kind, value, tb)

    sys.excepthook = excepthook
    atexit.register(_close_group)


def _close_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        return
    if _closing["crashed"]:
        dist.destroy_process_group()
    else:
        close_group()


__all__ = [
    "all_gather",
    "all_reduce_sum",
    "barrier",
    "broadcast_from_main",
    "close_group",
    "close_group_at_exit",
    "collective_device",
    "gather_to_main",
    "rank",
    "world_size",
]
