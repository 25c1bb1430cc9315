"""The process group of one torchrun attempt, on a store of its own: restarted workers reconnect.

torchrun's c10d rendezvous hands its workers a TCPStore that the agent owns for the whole launch
(``TORCHELASTIC_USE_AGENT_STORE=True``, pytorch PR 128096). torch's ``env://`` rendezvous assumes a
fresh store per attempt and adds no prefix, so the group of a restarted attempt is made under the same
keys as the first one: gloo reads the dead workers' addresses, still in the store, and fails to connect
("connectFullMesh ... Connection refused") or waits on a peer that never comes. Here the default group is
made before accelerate's ``PartialState`` (which then keeps it) on the agent's store under a prefix named
by ``TORCHELASTIC_RESTART_COUNT``, so an attempt sees only its own keys.

The restart count names the attempt on one node, where one agent restarts every worker together. Across
nodes each agent counts its own restarts; when a node re-joins while another's workers were healthy,
that agent restarts them without counting, and the counts differ: the new group then waits on keys the
other node writes under another prefix and fails after ``ddp_timeout``, which costs a restart.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

ATTEMPT_PREFIX = "trainbus/attempt-"


def attempt_store_prefix() -> str | None:
    """The store prefix of a restarted torchrun attempt; None for the first attempt, or outside a torchrun agent
    that shares its store.

    The first attempt keeps torch's own group (accelerate's ``env://``, unprefixed keys): a run that is never
    restarted is made exactly as without trainbus. Each restart's keys are apart from it and from each other.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return None if restarts in ("", "0") else f"{ATTEMPT_PREFIX}{restarts}"


def _backend(backend: str | None, cpu: bool) -> str | None:
    """The backend accelerate would choose: the one asked for, gloo on the CPU, NCCL on CUDA; None for others."""
    if backend is not None:
        return backend
    if cpu or not torch.cuda.is_available():
        # accelerate uses gloo for processes on the CPU; a machine with another accelerator (NPU, XPU, ...)
        # keeps accelerate's own choice
        return "gloo" if cpu or not _other_accelerator() else None
    return "nccl"


def _other_accelerator() -> bool:
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


def init_attempt_group(backend: str | None = None, *, cpu: bool, timeout: datetime.timedelta | None = None) -> bool:
    """Make the default process group on this attempt's scoped store; True when it made it.

    A no-op (False) when a group exists already, outside a torchrun agent's shared store, in one process,
    or where accelerate's own backend choice is not gloo / NCCL. Call it before accelerate's
    ``PartialState`` or ``Accelerator``: they keep an initialised group.
    """
    prefix = attempt_store_prefix()
    if prefix is None or not dist.is_available() or dist.is_initialized():
        return False
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    chosen = _backend(backend, cpu)
    if world_size <= 1 or chosen is None:
        return False
    # a client of the agent's store, as torch's env:// makes it under an agent that shares its store
    agent_store = dist.TCPStore(  # type: ignore[attr-defined]
        host_name=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]), world_size=world_size,
        is_master=False, timeout=timeout or default_pg_timeout,
    )  # fmt: skip
    store = dist.PrefixStore(prefix, agent_store)  # type: ignore[attr-defined]
    # timeout None: the backend's default, as init_process_group has it
    dist.init_process_group(backend=chosen, store=store, rank=rank, world_size=world_size, timeout=timeout)
    return True


__all__ = ["attempt_store_prefix", "init_attempt_group"]
