"""fp16 overflow skipped on the device: no host read per step (the part of ``MixedPrecision`` behind ``sync``).

Torch's fused Adam, AdamW, SGD and Adagrad (``_step_supports_amp_scaling``) read ``optimizer.found_inf`` on
the device and leave parameters and state as they were when it is 1 (Adam's step count included), as
``GradScaler.step`` hands it to them. ``DeviceSkip`` hands them the flag ``unscale_`` set, adds it to a device
counter (one scalar kernel per optimizer step) and lets the engine count the step as taken: OPTIMIZER_STEP fires,
the scheduler steps. The host learns the skips at the next logging point (one read per logging window) and at
TRAIN_END, where ``state.optimizer_steps_taken``, ``skipped_steps`` and the schedule are taken back, as
``SkipNonFinite`` does, so from there on they are what a host read per step gives.

With a flat schedule (none, ``constant``, or ``reduce_lr_on_plateau``, which moves at evaluations only) the run
is then bit for bit the host-read run: weights, optimizer state, scale, counts. With a schedule that moves, a
step after a skip within a logging window uses the rate of one schedule step later per skip, until the logging
point takes the schedule back; so ``MixedPrecision`` does this by default only with a flat schedule, and
``sync=False`` asks for it with any closed-form (``LambdaLR``) schedule.

``keep_schedule=True`` leaves the skipped steps in the schedule, as transformers does with a fused optimizer:
accelerate reports a step as skipped only when ``optimizer.step`` was not called, and ``GradScaler.step`` always
calls a fused optimizer's (which skips inside), so the Trainer steps its scheduler anyway. Nothing is taken back
from the schedule then, any schedule will do, and the run is bit for bit the hand-written AMP loop
(``scaler.step``; ``scheduler.step()`` every step). Only the counts are taken back at the logging point.

A step is decided on the host instead (one read, as before) where the device cannot decide it alone: a
non-fused optimizer, a step function or several optimizers, gradients on several devices, engines where something
else counts taken steps (an OPTIMIZER_STEP handler other than the schedule's, ``SkipNonFinite``), and the steps
before the optimizer's state exists: a fused optimizer builds it in a step it skips (Adam's zero moments; fused
SGD's momentum buffers, left uninitialised), so until the first step taken each step is decided on the host and
the optimizer's state is what it was, step for step (usually the first steps only, while the scale settles).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

from trainbus.engine import ConfigError, Event

from .nonfinite import SkipNonFinite, rewind_schedule
from .schedule_shapes import constant_factor
from .schedulers import LRScheduler

if TYPE_CHECKING:
    from trainbus.engine.view import EngineView as Engine  # what a payload's ``engine`` is

#: plugins whose OPTIMIZER_STEP handlers may see a step skipped on the device as taken: the schedule (taken
#: back at the logging point) and HF callbacks' on_optimizer_step (transformers calls it on a skipped step too)
_TOLERATED = (LRScheduler,)
_TOLERATED_NAMES = ("CallbackAdapter",)


def schedule_of(engine: Engine) -> Any:
    """The scheduler the optimizer steps move (None: none, or a plateau schedule, which moves at evaluations)."""
    plugin = engine.get_plugin(LRScheduler)
    scheduler = getattr(plugin, "scheduler", None)
    return None if isinstance(scheduler, ReduceLROnPlateau) else scheduler


def flat(scheduler: Any) -> bool:
    """Whether the schedule's rate never changes with the step (none, or every group's factor constant)."""
    if scheduler is None:
        return True
    return isinstance(scheduler, LambdaLR) and all(f is constant_factor for f in scheduler.lr_lambdas)


def why_not(engine: Engine, optimizer: torch.optim.Optimizer, sync: bool | None, keep_schedule: bool) -> str | None:
    """Why this run's overflow cannot be skipped on the device (None: it can).

    ``sync`` None: only where that is the host-read run bit for bit; ``keep_schedule``: skipped steps stay in
    the schedule (nothing to take back, so any schedule will do)."""
    if engine.step_function is not None or engine.optimizers:
        return "a step function or several optimizers step their optimizers themselves"
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return (
            f"{type(optimizer).__name__} without fused=True cannot skip a step on the device (torch's fused "
            "Adam, AdamW, SGD and Adagrad can; HF optim='adamw_torch_fused')"
        )
    if engine.get_plugin(SkipNonFinite) is not None:
        return "SkipNonFinite would count an overflow as a non-finite step of its own"
    tolerated = {p.name for p in engine.plugins if isinstance(p, _TOLERATED) or type(p).__name__ in _TOLERATED_NAMES}
    others = [n for n in engine.bus.handler_names(Event.OPTIMIZER_STEP) if n.rsplit(".", 1)[0] not in tolerated]
    if others:
        return f"OPTIMIZER_STEP handlers {others} would see a skipped step as taken"
    scheduler = schedule_of(engine)
    if keep_schedule or flat(scheduler):
        return None
    if sync is None:
        return "the schedule moves: within a logging window the rate after a skip would lag (sync=False allows it)"
    if not isinstance(scheduler, LambdaLR):
        return f"{type(scheduler).__name__} has no closed form, so skipped steps cannot be taken back from it"
    return None


class DeviceSkip:
    """The device counter of skipped steps, the step that hands the flag over, and the reconciliation."""

    def __init__(self) -> None:
        self.optimizer: torch.optim.Optimizer | None = None  # the bound optimizer; another one is decided on the host
        self.counter: torch.Tensor | None = None  # on the device: steps skipped there
        self.reconciled = 0  # the counter's value the host has accounted for
        self.on_host = 0  # skips decided on the host but counted as taken (keep_schedule), not yet taken back
        self.unprimed = False  # the optimizer has no state yet for some parameter it steps

    def bind(self, optimizer: torch.optim.Optimizer, device: torch.device, keep_schedule: bool) -> None:
        """Skip ``optimizer``'s steps on ``device``. Until its state exists the host decides; with
        ``keep_schedule`` (the reference is the hand-written loop, whose skipped steps build Adam's zero state
        too) only for fused SGD with momentum, whose skipped first step leaves its buffers uninitialised."""
        self.optimizer = optimizer
        counter = self.counter if self.counter is not None else torch.zeros(())
        self.counter = counter.to(device)
        momentum = isinstance(optimizer, torch.optim.SGD) and any(g["momentum"] for g in optimizer.param_groups)
        stateless = isinstance(optimizer, torch.optim.SGD) and not momentum
        self.unprimed = momentum if keep_schedule else not stateless

    def unbind(self) -> None:
        self.optimizer = None

    def flag(self, optimizer: torch.optim.Optimizer, found: dict[torch.device, torch.Tensor]) -> torch.Tensor | None:
        """The one found-inf flag to hand over, or None when this step is decided on the host."""
        if optimizer is not self.optimizer or len(found) != 1:
            return None
        (flag,) = found.values()
        if self.counter is None or flag.device != self.counter.device:
            return None
        if self.unprimed and not self._primed(optimizer):
            return None
        return flag

    def step(self, optimizer: torch.optim.Optimizer, flag: torch.Tensor, inner: Callable[..., Any]) -> Any:
        optimizer.found_inf = flag  # type: ignore[attr-defined]  # read on the device, as GradScaler hands it
        optimizer.grad_scale = None  # type: ignore[attr-defined]  # the gradients are unscaled already
        try:
            stepped = inner(optimizer)
        finally:
            del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
        if stepped is not False:  # a skip inside is the engine's already
            assert self.counter is not None
            self.counter.add_(flag)
        return stepped

    def _primed(self, optimizer: torch.optim.Optimizer) -> bool:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if all(optimizer.state.get(p) for p in params):
            self.unprimed = False
        return not self.unprimed

    def skipped_on_host(self) -> None:
        """A skip the host decided, which the engine counts as taken (keep_schedule): taken back as the others."""
        self.on_host += 1

    def pending(self) -> int:
        """Skips on the device the host has not accounted for (one host read)."""
        return self.on_host + (0 if self.counter is None else int(self.counter.item()) - self.reconciled)

    def reconcile(self, engine: Engine, keep_schedule: bool) -> int:
        """Read the counter (one host read); take the new skips back from the counts (and the schedule)."""
        if self.counter is None:
            return 0
        total = int(self.counter.item())
        new = total - self.reconciled + self.on_host
        self.on_host = 0
        if new:
            engine.state.optimizer_steps_taken -= new
            scheduler = None if keep_schedule else schedule_of(engine)
            if scheduler is not None:
                rewind_schedule(scheduler, new)
        self.reconciled = total
        return new

    def load(self, pending: int) -> None:
        """A checkpoint's unaccounted skips: the counter starts from them, to be taken back at the next read."""
        device = self.counter.device if self.counter is not None else None  # bound: stays on the optimizer's device
        self.counter = torch.tensor(float(pending), device=device)
        self.reconciled = self.on_host = 0


def check_pending(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"MixedPrecision state: pending_skips must be an integer >= 0, got {value!r}")
    return value
