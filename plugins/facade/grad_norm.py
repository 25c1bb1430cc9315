"""transformers 5's ``_clip_grad_norm`` / ``_get_grad_norm`` on trainbus's Trainer, called where transformers calls
them when a subclass overrides either.

transformers 5 clips once per optimizer step, after the window's backward passes and before the
``on_pre_optimizer_step`` callbacks: ``_clip_grad_norm(model)`` when ``max_grad_norm > 0`` (it clips and returns
the norm before clipping), then ``_get_grad_norm(model, grad_norm)`` (the norm to log: the one given, else measured
without clipping). trainbus's ``GradientClipping`` plugin does that work at BEFORE_OPTIMIZER_STEP; for a subclass
overriding either method, composition uses ``ClippingThroughTrainer`` instead, whose handler calls the two methods
there (after mixed precision unscaled the gradients) and keeps what ``_get_grad_norm`` returned as the step's
``grad_norm`` (logged, and passed to ``_maybe_log_save_evaluate``). A Trainer whose class overrides neither keeps
``GradientClipping`` as it is: no step pays for this module.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainbus.engine import ConfigError

from ..distributed.processes import world_size
from ..optimization.clipping import GradientClipping

#: the methods this module calls for a subclass
NAMES = ("_clip_grad_norm", "_get_grad_norm")


class ClippingThroughTrainer(GradientClipping):
    """``GradientClipping`` whose step goes through the Trainer's ``_clip_grad_norm`` / ``_get_grad_norm``."""

    def __init__(self, max_norm: float | None) -> None:
        super().__init__(max_norm, norm_when_off=True)
        self.name = "GradientClipping"  # its handler's name and its place are the plugin's

    def clip(self, ev: Any) -> None:
        trainer = ev.engine
        model = trainer.model_wrapped
        norm = trainer._clip_grad_norm(model) if self.max_norm is not None else None
        norm = trainer._get_grad_norm(model, grad_norm=norm)
        if norm is not None:
            trainer.step_outputs["grad_norm"] = norm


def check_grad_norm_overrides(trainer: Any, clips: bool) -> None:
    """An override the run would never call (DeepSpeed clips itself; an optimizer stepping in backward leaves no
    gradients to clip): refused at construction."""
    overridden = [name for name in NAMES if trainer.overrides(name)]
    if overridden and not clips:
        why = "DeepSpeed clips" if getattr(trainer.args, "deepspeed_plugin", None) is not None else (
            f"optim={trainer.args.optim!s} steps inside backward and leaves no gradients to clip"
        )  # fmt: skip
        raise ConfigError(
            f"{', '.join(f'{type(trainer).__qualname__}.{n}' for n in overridden)}: this run never clips gradients "
            f"itself ({why}), so the override would not be called; remove it or train without that setting"
        )


class TrainerGradNorm:
    """transformers 5's clipping methods (a mixin of ``Trainer``)."""

    args: Any

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        """Clip ``model``'s gradients to ``args.max_grad_norm``; the total norm before clipping (transformers 5')."""
        if world_size() > 1:  # accelerate's, as transformers: it knows FSDP's sharded gradients
            return self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)  # type: ignore[attr-defined,no-any-return]
        return torch.nn.utils.clip_grad_norm_(list(model.parameters()), self.args.max_grad_norm, foreach=True)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        """The step's gradient norm: ``grad_norm`` when clipping measured it, else measured without clipping."""
        if grad_norm is not None:
            return grad_norm
        if world_size() > 1:
            return self.accelerator.clip_grad_norm_(model.parameters(), math.inf)  # type: ignore[attr-defined]
        return torch.nn.utils.clip_grad_norm_(list(model.parameters()), math.inf, foreach=True)
