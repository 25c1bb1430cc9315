"""Work per batch, counted rather than timed: ATen ops and Python bytecodes.

Timing on a shared VM moves by a point or two between runs; these counts do not move at all. They
say what a framework adds to a raw loop: the same tensor work (equal ATen op counts) plus Python
around it (the extra bytecodes). They do not say how long that Python takes in context.
"""

from __future__ import annotations

import collections
import gc
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# record_function markers reach the dispatcher too; they are bookkeeping, not tensor work
_NOT_WORK = ("profiler.",)


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops that run under it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if not name.startswith(_NOT_WORK):
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def aten_ops(run: Callable[[], None]) -> collections.Counter[str]:
    """The ATen ops of one call of ``run``, by name (call it once before: lazy optimizer state)."""
    with OpCounter() as counter:
        run()
    return counter.ops


def bytecodes(run: Callable[[], None]) -> int:
    """Python bytecodes executed by one call of ``run`` (traced, so slow: use a short run)."""
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        if event == "opcode":
            count += 1
        return trace

    previous, collecting = sys.gettrace(), gc.isenabled()
    gc.collect()  # a collection inside the trace would count finalizers' bytecodes (earlier tests' garbage) as run's
    gc.disable()
    sys.settrace(trace)
    try:
        run()
    finally:
        sys.settrace(previous)
        if collecting:
            gc.enable()
    return count


def work_per_batch(run: Callable[[], None], batches: int) -> tuple[float, float]:
    """(ATen ops, Python bytecodes) per batch of a warm ``run`` over ``batches`` batches."""
    run()  # warm-up: lazy optimizer state, first-call caches
    ops = sum(aten_ops(run).values())
    return ops / batches, bytecodes(run) / batches
