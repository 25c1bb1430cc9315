"""The Trainer's process side as a mixin: accelerate's ``Accelerator``, the wrapped model, ``end()``."""

from __future__ import annotations

from typing import Any

import torch

from ..distributed.processes import close_group
from ..observability.tracker_base import TrackerSink


class TrainerProcesses:
    """``accelerator``, ``model_wrapped`` and ``end`` of HF's Trainer (``trainer.py`` composes it)."""

    distributed: Any
    args: Any
    model: torch.nn.Module
    plugins: Any

    @property
    def accelerator(self) -> Any:
        """accelerate's ``Accelerator`` (HF scripts call its is_main_process, gather_for_metrics, print, ...).

        Under several processes it is the one the Distributed plugin runs; in one process one is made
        on first use (the Trainer itself does not need it there).
        """
        if self.distributed is not None:
            return self.distributed.accelerator_for(self)
        if "_accelerator" not in self.__dict__:
            from accelerate import Accelerator

            accelerator = Accelerator(cpu=self.args.device.type == "cpu")
            self.__dict__["_accelerator"] = self._backward_through_hooks(accelerator)
        return self.__dict__["_accelerator"]

    @property
    def model_wrapped(self) -> torch.nn.Module:
        """The model as training runs it: its DDP wrapper or DeepSpeed engine, else the model itself (HF)."""
        wrapper = None if self.distributed is None else self.distributed.wrapped_model()
        return self.model if wrapper is None else wrapper

    def end(self) -> None:
        """The end of a script (transformers 5.18): the trackers finished, the process group destroyed.

        Call it once, after everything that needs the other processes (train, evaluate, predict, save_model).
        """
        for plugin in self.plugins:
            if isinstance(plugin, TrackerSink):
                plugin._finish()  # runs finish at train end already; one an evaluate() reopened finishes here
        if self.distributed is not None or (torch.distributed.is_available() and torch.distributed.is_initialized()):
            accelerator = self.accelerator  # made before the group goes: made after, it would make a new one
            close_group()  # every rank waits, and gloo's threads free nothing once the interpreter is finalizing
            accelerator.end_training()  # accelerate's trackers; the group is destroyed already
