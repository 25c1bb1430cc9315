"""Mixed precision as a plugin: autocast around forward and loss, loss scaling for fp16.

bf16 needs no scaling: the plugin only wraps the ``forward`` and ``compute_loss`` hooks in
``torch.autocast``. fp16 adds a ``torch.amp.GradScaler``:

- ``backward`` hook: backpropagates ``scaler.scale(loss)``;
- BEFORE_OPTIMIZER_STEP at priority FIRST: ``scaler.unscale_(optimizer)``, so clipping (DEFAULT) and
  every other handler see the true gradients;
- ``optimizer_step`` hook: on overflow (an inf/NaN gradient) it does not step and returns False, so the
  engine fires no OPTIMIZER_STEP and the scheduler does not step either; ``skipped_steps`` counts it.
  Otherwise it calls the inner hook. Then ``scaler.update()`` adjusts the scale.

Deciding that reads the overflow flag on the host, one sync per optimizer step (``GradScaler.step`` does the
same read for a non-fused optimizer). With a fused optimizer (HF's default ``adamw_torch_fused``) the skip can
be taken on the device instead (``fp16_skip.DeviceSkip``): the optimizer reads the flag itself, a device
counter counts the skips, and the counts and the schedule are taken back at the next logging point. That is
bit for bit the same run where the rate does not move with the step, so it is the default there (``sync=None``);
``sync=False`` asks for it under any closed-form schedule (within a logging window the rate after a skip lags
by one schedule step per skip), ``sync=True`` reads on the host every step. ``keep_schedule=True`` leaves
skipped steps in the schedule, as transformers does with a fused optimizer (the hand-written AMP loop too).

Under a step function (``Engine(..., step=fn)``) the plugin runs ``fn`` under autocast (the engine runs
``step_optimizer``'s backward and step outside it) and unscales the optimizer each step names; one scaler
serves every optimizer, updated after each one's step, as torch's AMP recipe for several optimizers does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import ConfigTypeError, check_positive_int, suggest

from .fp16_skip import DeviceSkip, check_pending, why_not

if TYPE_CHECKING:
    from trainbus.engine import Engine
    from trainbus.engine.events import (
        BeforeOptimizerStepEvent,
        LogEvent,
        StepEndEvent,
        TrainEndEvent,
        TrainStartEvent,
    )

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch can autocast to ``dtype`` on ``device_type`` (tried on a tiny matmul)."""
    if not torch.amp.is_autocast_available(device_type):
        return False
    if device_type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return False
    try:
        with torch.autocast(device_type, dtype=dtype):
            a = torch.ones(2, 2, device=device_type)
            out = a @ a
        return bool(out.dtype == dtype)
    except (RuntimeError, ValueError):
        return False


class MixedPrecision(Plugin):
    """Train in bf16 or fp16 autocast; fp16 scales the loss and skips steps that overflow.

    Args:
        dtype: ``"bf16"`` or ``"fp16"`` (also ``"bfloat16"`` / ``"float16"``).
        device_type: autocast device type; default: the engine's device.
        scaler: a GradScaler to use for fp16 (tests inject one); default ``torch.amp.GradScaler``
            built from ``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``.
        sync: fp16: ``True`` reads the overflow flag on the host every step; ``False`` skips on the device
            (a fused optimizer, taken back at logging points) and says at TRAIN_START why it cannot; ``None``
            (default) skips on the device where that is bit for bit the host-read run (see the module).
        keep_schedule: fp16, a skip on the device: the skipped step stays in the learning-rate schedule, as
            transformers (accelerate) does with a fused optimizer; then any schedule skips on the device.

    Attributes:
        skipped_steps: optimizer steps skipped because the gradients overflowed (fp16); with a skip on the
            device, as known at the last logging point (and at the end of training).
        device_skip: whether this run's overflows are skipped on the device (set at TRAIN_START).

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
        >>> amp = MixedPrecision("fp16", init_scale=2.0**8)
        >>> engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_epochs=1,
        ...                 loss_fn=torch.nn.MSELoss(), plugins=[amp])
        >>> engine.fit().optimizer_steps_taken + amp.skipped_steps
        3
        >>> amp = MixedPrecision("fp16", init_scale=2.0**8)  # a fused optimizer: overflows skipped on the device
        >>> engine = Engine(model, torch.optim.AdamW(model.parameters(), fused=True), train_data=data, max_epochs=1,
        ...                 loss_fn=torch.nn.MSELoss(), plugins=[amp])
        >>> engine.fit().optimizer_steps_taken + amp.skipped_steps, amp.device_skip
        (3, True)
    """

    priority = Priority.FIRST

    def __init__(
        self,
        dtype: str = "bf16",
        *,
        device_type: str | None = None,
        scaler: torch.amp.GradScaler | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        sync: bool | None = None,
        keep_schedule: bool = False,
    ) -> None:
        if dtype not in DTYPES:
            raise ConfigError(
                f"unknown mixed precision {dtype!r}{suggest(dtype, DTYPES)}; allowed: {', '.join(DTYPES)}"
            )
        missing = [name for name in ("scale", "unscale_", "update") if not hasattr(scaler, name)]
        if scaler is not None and missing:
            raise ConfigTypeError(
                f"scaler must be a torch.amp.GradScaler or None, got {scaler!r:.80} (no {missing[0]})"
            )
        if scaler is not None and DTYPES[dtype] != torch.float16:
            raise ConfigError(f"a loss scaler is for fp16 only; {dtype} needs none")
        _check_scaler_settings(init_scale, growth_factor, backoff_factor, growth_interval)
        _check_device_type(device_type)
        if sync is not None and not isinstance(sync, bool):
            raise ConfigError(f"sync must be True, False or None (decided per run), got {sync!r}")
        if not isinstance(keep_schedule, bool):
            raise ConfigError(f"keep_schedule must be True or False, got {keep_schedule!r}")
        self.dtype = DTYPES[dtype]
        self.device_type = device_type
        self.scaler: Any = scaler
        self._scaler_kwargs: dict[str, Any] = {
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
        }
        self.skipped_steps = 0
        self._unscaled = False  # unscale_ ran for this step and update() has not yet
        self._pending_scaler: dict[str, Any] | None = None
        self._step_function: Callable[..., Any] | None = None  # a step function's own, put back at detach
        self.sync = sync
        self.keep_schedule = keep_schedule
        self.device_skip = False
        self._device = DeviceSkip()

    @property
    def fp16(self) -> bool:
        return self.dtype == torch.float16

    def attach(self, engine: Engine) -> None:
        device_type = self.device_type or engine.device.type
        if not autocast_supported(device_type, self.dtype):
            name = "fp16" if self.fp16 else "bf16"
            other = "bf16" if self.fp16 else "fp16, or no mixed precision"
            raise ConfigError(
                f"{name} autocast is not supported on device {device_type!r} by torch {torch.__version__}; try {other}"
            )
        self.device_type = device_type
        if engine.step_function is not None:  # the step function replaces forward and loss: it runs under autocast
            self._step_function = engine.step_function
            engine.step_function = self._autocast(engine.step_function)
        else:
            self.wrap_hook(engine, "forward", self._autocast)
            self.wrap_hook(engine, "compute_loss", self._autocast)
        if not self.fp16:
            return
        if self.scaler is None:
            self.scaler = torch.amp.GradScaler(device_type, **self._scaler_kwargs)
        if self._pending_scaler is not None:
            self.scaler.load_state_dict(self._pending_scaler)
            self._pending_scaler = None
        self.wrap_hook(engine, "backward", self._scaled_backward)
        self.wrap_hook(engine, "optimizer_step", self._scaled_step)
        # a step function's steps name their optimizer: unscale that one (one scaler for all, as torch advises)
        unscale = self.unscale if engine.step_function is None else self.unscale_named
        self.on(engine, Event.BEFORE_OPTIMIZER_STEP, unscale, priority=Priority.FIRST)
        self.on(engine, Event.STEP_END, self.step_end, priority=Priority.FIRST)
        self.on(engine, Event.TRAIN_START, self.train_start, priority=Priority.LAST)  # after the schedule
        if self.sync is not True:
            self.on(engine, Event.LOG, self.log, priority=Priority.DEFAULT)  # as SkipNonFinite: after the record
            self.on(engine, Event.TRAIN_END, self.train_end, priority=Priority.FIRST)  # before the train metrics

    def detach(self, engine: Engine) -> None:
        self._device.unbind()
        self.device_skip = False
        if self._step_function is not None:
            engine.step_function, self._step_function = self._step_function, None
        super().detach(engine)

    # -- hook wrappers ---------------------------------------------------------------------------
    def _autocast(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        device_type, dtype = self.device_type, self.dtype
        assert device_type is not None

        def autocast(*args: Any) -> Any:
            with torch.autocast(device_type, dtype=dtype):
                return inner(*args)

        autocast.__qualname__ = f"autocast({getattr(inner, '__qualname__', 'hook')})"
        return autocast

    def _scaled_backward(self, inner: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
        def scaled_backward(loss: torch.Tensor) -> None:
            inner(self.scaler.scale(loss))

        return scaled_backward

    def _scaled_step(self, inner: Callable[[torch.optim.Optimizer], Any]) -> Callable[[torch.optim.Optimizer], bool]:
        def scaled_step(optimizer: torch.optim.Optimizer) -> bool:
            if not self._unscaled:  # called outside the loop's BEFORE_OPTIMIZER_STEP
                self.scaler.unscale_(optimizer)
            found = self.scaler._found_inf_per_device(optimizer)
            flag = self._device.flag(optimizer, found) if self.device_skip and self._unscaled else None
            if flag is not None:  # the optimizer skips on the device; the host learns it at the logging point
                stepped = self._device.step(optimizer, flag, inner) is not False
            elif bool(sum(v.item() for v in found.values())):  # the one host read of an fp16 step
                stepped = self._skipped_on_host(optimizer)
            else:
                stepped = inner(optimizer) is not False  # None from a plain optimizer.step()
            self.scaler.update()
            self._unscaled = False
            return stepped

        return scaled_step

    def _skipped_on_host(self, optimizer: torch.optim.Optimizer) -> bool:
        """An overflow read on the host: not stepped; with keep_schedule and a skip on the device, a step the
        schedule counts (every skip alike), taken back from the counts at the logging point as the others."""
        if self.keep_schedule and self.device_skip:
            self._device.skipped_on_host()
            optimizer._opt_called = True  # type: ignore[attr-defined]  # as a fused step would: torch's scheduler
            return True  # then does not warn that it steps first (it does so on purpose here)
        self.skipped_steps += 1
        return False

    # -- handlers --------------------------------------------------------------------------------
    def unscale(self, ev: BeforeOptimizerStepEvent) -> None:
        optimizer = ev.engine.optimizer
        assert optimizer is not None
        self.scaler.unscale_(optimizer)
        self._unscaled = True

    def unscale_named(self, ev: BeforeOptimizerStepEvent) -> None:
        name = ev.optimizer
        self.scaler.unscale_(ev.engine.optimizers[name] if name is not None else ev.engine.optimizer)
        self._unscaled = True

    def train_start(self, ev: TrainStartEvent) -> None:
        engine, optimizer = ev.engine, ev.engine.optimizer
        assert optimizer is not None
        reason = "sync=True" if self.sync else why_not(engine, optimizer, self.sync, self.keep_schedule)
        if reason is not None and self.sync is False:
            raise ConfigError(f"MixedPrecision(sync=False) cannot skip an fp16 overflow on the device: {reason}; "
                              "use sync=None (decided per run) or sync=True (one host read per step)")  # fmt: skip
        self.device_skip = reason is None
        if reason is None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
            self._device.bind(optimizer, params[0].device if params else engine.device, self.keep_schedule)
        else:  # decided on the host; skips a checkpoint had not taken back yet are taken back now
            self._device.unbind()
            self.skipped_steps += self._device.reconcile(engine, self.keep_schedule)

    def log(self, ev: LogEvent) -> None:
        if ev.window and self.device_skip:
            self.skipped_steps += self._device.reconcile(ev.engine, self.keep_schedule)

    def train_end(self, ev: TrainEndEvent) -> None:
        if self.device_skip:
            self.skipped_steps += self._device.reconcile(ev.engine, self.keep_schedule)

    def step_end(self, ev: StepEndEvent) -> None:
        # a handler vetoed the step after we unscaled: update() clears the scaler's per-step record
        if self._unscaled:
            self.scaler.update()
            self._unscaled = False

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        scaler = self.scaler.state_dict() if self.scaler is not None else None
        # skips on the device not yet taken back: a resumed run takes them back where this one would
        pending = self._device.pending()
        return {"skipped_steps": self.skipped_steps, "scaler": scaler, "pending_skips": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._device.load(check_pending(state.get("pending_skips", 0)))
        saved = state.get("scaler")
        if not saved:
            return
        if not self.fp16:
            raise ConfigError("the saved state has a loss scaler, but this MixedPrecision is bf16")
        if self.scaler is None:
            self._pending_scaler = dict(saved)  # loaded when attach builds the scaler
        else:
            self.scaler.load_state_dict(dict(saved))


def _check_scaler_settings(init_scale: Any, growth_factor: Any, backoff_factor: Any, growth_interval: Any) -> None:
    """GradScaler's ranges, at construction (torch asserts growth and backoff only when the scaler is made)."""
    numbers = {"init_scale": init_scale, "growth_factor": growth_factor, "backoff_factor": backoff_factor}
    for name, value in numbers.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise ConfigError(f"{name} must be a number, got {value!r}")
    if not init_scale > 0:
        raise ConfigError(f"init_scale must be > 0, got {init_scale!r}")
    if not growth_factor > 1:
        raise ConfigError(f"growth_factor must be > 1 (the scale grows by it), got {growth_factor!r}")
    if not 0 < backoff_factor < 1:
        raise ConfigError(f"backoff_factor must be in (0, 1) (the scale shrinks by it), got {backoff_factor!r}")
    check_positive_int("growth_interval", growth_interval)


def _check_device_type(device_type: Any) -> None:
    """None (the engine's device) or a torch device type without an index ('cuda', 'cpu', ...)."""
    if device_type is None:
        return
    try:
        valid = isinstance(device_type, str) and torch.device(device_type).type == device_type
    except RuntimeError:
        valid = False
    if not valid:
        raise ConfigError(
            f"device_type must be a torch device type such as 'cuda' or 'cpu' (no index), or None for the "
            f"engine's device; got {device_type!r}"
        )
