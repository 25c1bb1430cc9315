"""Recording the aten ops a training loop runs, step by step (the CPU proxy for CUDA kernels per step)."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode


class OpRecorder(TorchDispatchMode):
    """The aten ops run while active; ``mark`` (a handler, e.g. on STEP_START) starts a new step's list."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[list[str]] = [[]]

    def mark(self, ev: Any) -> None:
        self.steps.append([])

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.steps[-1].append(str(func))
        return func(*args, **(kwargs or {}))
