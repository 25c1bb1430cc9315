"""HF's ``TrainerMemoryTracker`` API over ``MemoryMetrics``: the stage named after the calling method."""

from __future__ import annotations

import inspect
from typing import Any

#: HF's TrainerMemoryTracker names its stage after the method that calls start() / stop_and_update_metrics()
_STAGES = {
    "__init__": "init",
    "train": "train",
    "_inner_training_loop": "train",
    "_finalize_training": "train",
    "evaluate": "eval",
    "predict": "test",
}


class MemoryTracker:
    """HF's ``TrainerMemoryTracker`` API (``start`` / ``stop`` / ``stop_and_update_metrics``) over ``MemoryMetrics``.

    The stage is the calling method's name, as in HF (``evaluate`` -> ``eval``, ``predict`` -> ``test``);
    with ``skip_memory_metrics=True`` (HF's default) every call does nothing.
    """

    def __init__(self, memory_metrics: Any) -> None:
        self.memory_metrics = memory_metrics

    @staticmethod
    def _stage() -> str:
        """The stage of the method that called start() / stop_and_update_metrics(); HF's ValueError otherwise."""
        frame = inspect.currentframe()
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None  # type: ignore[union-attr]
        name = "?" if caller is None else caller.f_code.co_name
        if name not in _STAGES:
            raise ValueError(f"was called from {name}, but only expect to be called from one of {_STAGES.keys()}")
        return _STAGES[name]

    def start(self) -> None:
        if self.memory_metrics is not None:
            self.memory_metrics.start(self._stage())

    def stop(self, stage: str) -> dict[str, Any]:
        return {} if self.memory_metrics is None else dict(self.memory_metrics.stop(stage))

    def stop_and_update_metrics(self, metrics: dict[str, Any] | None = None) -> None:
        if self.memory_metrics is not None:
            self.memory_metrics.stop(self._stage(), metrics)
