"""SkipNonFinite: skip the optimizer step of a window whose loss or gradients hold a NaN / Inf, with no host sync.

The check runs on the device at BEFORE_OPTIMIZER_STEP, after the AMP plugin unscaled (FIRST) and before clipping
(DEFAULT) can turn an infinite norm into zeros: GradScaler's own kernel, ``_amp_foreach_non_finite_check_and_unscale_``
with a scale of 1 (values unchanged), sets one ``found_inf`` flag from every gradient and the window's losses, one
launch per device and dtype. The flag reaches the optimizer the way GradScaler hands it over: torch's fused Adam,
AdamW, SGD and Adagrad read ``optimizer.found_inf`` on the device and leave parameters and state as they were (Adam's
step count included). The flag is added to a device counter; nothing is read on the host per step.

What the host cannot know per step it learns at the next logging point, where the counter is read (one read per
logging window, and one at TRAIN_END). The record gets ``nonfinite_steps`` (steps skipped since the last record), and
the bookkeeping is made to match an fp16-overflow skip: ``state.optimizer_steps_taken`` and the learning-rate schedule
go back by the skipped steps. Until then the engine counted those steps as taken: OPTIMIZER_STEP fired for them (the
scheduler stepped, an EMA averaged the unchanged weights), so within a logging window the steps after a skip use the
rate of one schedule step later. ``sync=True`` reads the flag every step instead, as the fp16 scaler does, returns
False from the optimizer-step hook like an fp16 overflow (no OPTIMIZER_STEP, no scheduler step), and works with any
optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

from trainbus.engine import ConfigError, Event, Plugin, Priority

from ..distributed.processes import all_reduce_sum, collective_device, world_size
from .schedulers import LRScheduler

if TYPE_CHECKING:
    from trainbus.engine import Engine
    from trainbus.engine.events import (
        BeforeOptimizerStepEvent,
        LogEvent,
        LossEvent,
        TrainEndEvent,
        TrainStartEvent,
    )

Step = Callable[[torch.optim.Optimizer], Any]


def rewind_schedule(scheduler: LambdaLR, steps: int) -> None:
    """Take back ``steps`` steps of a closed-form schedule: rates and counters as if they never happened."""
    scheduler.last_epoch -= steps + 1
    scheduler.step()  # recomputes every group's lr from last_epoch
    scheduler._step_count -= steps + 1  # the rewind's own step() and the skipped steps did not step


class SkipNonFinite(Plugin):
    """Skip the optimizer step when the window's loss or any gradient is NaN / Inf, decided on the device.

    Args:
        sync: read the flag on the host every step (one sync per step, like fp16 loss scaling): the skip is
            then exact at once (no OPTIMIZER_STEP, no scheduler step) and any optimizer works. Default False:
            no per-step read; needs a torch fused optimizer and a closed-form (``LambdaLR``) schedule.
        check_loss: also skip when a loss is non-finite while the gradients are finite. Across processes the
            losses differ per rank, so the flag is then all-reduced (one collective per step, no host read).

    Attributes:
        skipped_steps: steps skipped, as known on the host (up to the last logging point with ``sync=False``).

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
        >>> data[1][0][0, 0] = float("nan")
        >>> skip = SkipNonFinite()
        >>> engine = Engine(model, torch.optim.AdamW(model.parameters(), fused=True), train_data=data,
        ...                 max_epochs=1, loss_fn=torch.nn.MSELoss(), plugins=[skip])
        >>> engine.fit().optimizer_steps_taken, skip.skipped_steps, bool(model.weight.isfinite().all())
        (2, 1, True)
    """

    priority = Priority.PRODUCER

    def __init__(self, *, sync: bool = False, check_loss: bool = True) -> None:
        for name, value in (("sync", sync), ("check_loss", check_loss)):
            if not isinstance(value, bool):
                raise ConfigError(f"SkipNonFinite: {name} must be True or False, got {value!r}")
        self.sync = sync
        self.check_loss = check_loss
        self.skipped_steps = 0
        self._reported = 0  # skipped_steps at the last log record
        self._counter: torch.Tensor | None = None  # on the device: steps skipped there (sync=False)
        self._reconciled = 0  # the counter's value the host has accounted for
        self._found: torch.Tensor | None = None  # this window's flag: 1.0 when something is non-finite
        self._armed = False  # the flag was computed for the window now stepping
        self._losses: list[torch.Tensor] = []
        self._params: list[torch.Tensor] = []
        self._units: dict[torch.device, torch.Tensor] = {}
        self._unprimed_sgd = False
        self._across_ranks = False  # the flag is all-reduced: losses checked, several processes

    def attach(self, engine: Engine) -> None:
        if engine.optimizers:
            raise ConfigError(
                f"SkipNonFinite skips the one optimizer step of a window and takes back its schedule; this engine has "
                f"several optimizers {list(engine.optimizers)}: veto a step with a BEFORE_OPTIMIZER_STEP handler "
                "(ev.optimizer names it; set ev.skip = True when its gradients are not finite)"
            )
        if engine.optimizer is not None:
            self._check_optimizer(engine.optimizer)
        self.on(engine, Event.TRAIN_START, self.train_start, priority=Priority.LAST)  # after optimizer / scheduler
        if self.check_loss:
            self.on(engine, Event.LOSS, self.keep_loss, priority=Priority.CONSUMER)
        self.on(engine, Event.BEFORE_OPTIMIZER_STEP, self.check)  # PRODUCER: after unscaling, before clipping
        self.wrap_hook(engine, "optimizer_step", self._guarded)
        self.on(engine, Event.LOG, self.log, priority=Priority.DEFAULT)  # after TrainLogger filled the record
        self.on(engine, Event.TRAIN_END, self.train_end, priority=Priority.FIRST)  # before the train metrics

    # -- configuration ---------------------------------------------------------------------------
    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if self.sync:
            return
        if not getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ConfigError(
                f"SkipNonFinite skips a step on the device through found_inf, which only torch's fused optimizers "
                f"read; {type(optimizer).__name__} without fused=True does not. Use fused=True (Adam, AdamW, SGD, "
                "Adagrad; HF optim='adamw_torch_fused'), or SkipNonFinite(sync=True) (one host read per step)"
            )

    def _check_schedule(self, engine: Engine) -> None:
        scheduler = self._schedule(engine)
        if scheduler is not None and not isinstance(scheduler, LambdaLR):
            raise ConfigError(
                "SkipNonFinite(sync=False) takes skipped steps back from the schedule at the logging point, which "
                f"needs a closed form (LambdaLR: every named schedule); {type(scheduler).__name__} computes each "
                "rate from the last. Use SkipNonFinite(sync=True)"
            )

    @staticmethod
    def _schedule(engine: Engine) -> Any:
        plugin = engine.get_plugin(LRScheduler)
        scheduler = getattr(plugin, "scheduler", None)
        return None if isinstance(scheduler, ReduceLROnPlateau) else scheduler  # plateau steps on eval only

    # -- handlers --------------------------------------------------------------------------------
    def train_start(self, ev: TrainStartEvent) -> None:
        engine = ev.engine
        optimizer = engine.optimizer
        assert optimizer is not None
        self._check_optimizer(optimizer)
        if not self.sync:
            self._check_schedule(engine)
        self._params = [p for group in optimizer.param_groups for p in group["params"]]
        device = self._params[0].device if self._params else engine.device
        self._found = torch.zeros((), device=device)  # float32, as the check kernel wants
        counter = self._counter if self._counter is not None else torch.zeros(())
        self._counter = counter.to(device)
        self._losses, self._armed, self._units = [], False, {device: torch.ones((), device=device)}
        self._across_ranks = self.check_loss and world_size() > 1
        # torch's fused SGD builds its momentum buffers in its first step even when found_inf skips that
        # step, and leaves them uninitialised: until they exist the skip is decided on the host
        self._unprimed_sgd = isinstance(optimizer, torch.optim.SGD) and any(
            g["momentum"] for g in optimizer.param_groups
        )

    def keep_loss(self, ev: LossEvent) -> None:
        self._losses.append(ev.loss.detach())

    def check(self, ev: BeforeOptimizerStepEvent) -> None:
        found = self._found
        assert found is not None, "SkipNonFinite: BEFORE_OPTIMIZER_STEP before TRAIN_START"
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in self._params:
            grad = p.grad
            if grad is not None:
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
        if self._losses:
            losses = torch.stack([loss.reshape(()) for loss in self._losses])  # a new tensor: the check writes it
            groups.setdefault((losses.device, losses.dtype), []).append(losses)
            self._losses = []
        found.zero_()
        flags = {found.device: found}
        for (device, _), tensors in groups.items():
            flag = flags.get(device)
            if flag is None:  # gradients on another device (a model split over devices)
                flag = flags[device] = torch.zeros((), device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, self._unit(device))
        merge = len(flags) > 1 or self._across_ranks
        for flag in flags.values():
            if flag is not found:
                found.add_(flag.to(found.device, non_blocking=True))
        if self._across_ranks:  # ranks' losses differ: every rank must decide alike
            found.copy_(all_reduce_sum(found.to(collective_device())))
        if merge:
            found.clamp_(max=1.0)  # the fused optimizers skip on exactly 1.0
        self._armed = True

    def _unit(self, device: torch.device) -> torch.Tensor:
        unit = self._units.get(device)
        if unit is None:
            unit = self._units[device] = torch.ones((), device=device)
        return unit

    def _guarded(self, inner: Step) -> Step:
        def skip_non_finite(optimizer: torch.optim.Optimizer) -> Any:
            found, counter = self._found, self._counter
            if not self._armed or found is None or counter is None:  # not called from the loop's window
                return inner(optimizer)
            self._armed = False
            if self.sync or (self._unprimed_sgd and self._sgd_unprimed(optimizer)):
                if found.item():  # the host read sync=True asks for (or fused SGD's first step)
                    self.skipped_steps += 1
                    return False
                return inner(optimizer)
            optimizer.found_inf = found  # type: ignore[attr-defined]  # read on the device, as GradScaler does
            optimizer.grad_scale = None  # type: ignore[attr-defined]
            try:
                stepped = inner(optimizer)
            finally:
                del optimizer.found_inf, optimizer.grad_scale  # type: ignore[attr-defined]
            if stepped is not False:  # a skip inside (fp16 overflow) is already known to the engine
                counter.add_(found)
            return stepped

        return skip_non_finite

    def _sgd_unprimed(self, optimizer: torch.optim.Optimizer) -> bool:
        if all("momentum_buffer" in optimizer.state.get(p, {}) for p in self._params if p.grad is not None):
            self._unprimed_sgd = False
        return self._unprimed_sgd

    def reconcile(self, engine: Engine) -> None:
        """Read the device counter (one host read) and account for the steps skipped since the last read."""
        if self._counter is None:
            return
        total = int(self._counter.item())
        new = total - self._reconciled
        if new:
            engine.state.optimizer_steps_taken -= new
            scheduler = self._schedule(engine)
            if scheduler is not None:
                rewind_schedule(scheduler, new)
            self.skipped_steps += new
        self._reconciled = total

    def log(self, ev: LogEvent) -> None:
        if not ev.window:
            return
        if not self.sync:
            self.reconcile(ev.engine)
        if ev.logs:
            ev.logs["nonfinite_steps"] = self.skipped_steps - self._reported
            self._reported = self.skipped_steps

    def train_end(self, ev: TrainEndEvent) -> None:
        if not self.sync:
            self.reconcile(ev.engine)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_steps": self.skipped_steps,
            "reported": self._reported,
            "reconciled": self._reconciled,
            "counter": None if self._counter is None else self._counter.detach().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("skipped_steps", "reported", "reconciled"):
            value = state.get(key, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"SkipNonFinite state: {key} must be an integer >= 0, got {value!r}")
        counter = state.get("counter")
        if counter is not None and not (isinstance(counter, torch.Tensor) and counter.numel() == 1):
            raise ConfigError(f"SkipNonFinite state: counter must be a one-element tensor or None, got {counter!r}")
        self.skipped_steps = state.get("skipped_steps", 0)
        self._reported = state.get("reported", 0)
        self._reconciled = state.get("reconciled", 0)
        self._counter = None if counter is None else counter.reshape(()).float()  # moved to the device at TRAIN_START
