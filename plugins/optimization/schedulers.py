"""Learning-rate schedules by Hugging Face name, and the plugin that steps them.

Each schedule is the closed form of ``transformers.get_scheduler`` as a ``LambdaLR`` multiplier
(``reduce_lr_on_plateau`` is torch's ``ReduceLROnPlateau``). The ``LRScheduler`` plugin steps the
schedule at OPTIMIZER_STEP, which fires only when the optimizer really stepped: an fp16 overflow
skips the scheduler step too, and torch never warns about a scheduler step before an optimizer step.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import LambdaLR, ReduceLROnPlateau

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import ConfigKeyError, ConfigTypeError, check_positive_int, suggest

from .schedule_shapes import (
    constant_factor,
    constant_with_warmup_factor,
    cosine_factor,
    cosine_warmup_with_min_lr_factor,
    cosine_with_restarts_factor,
    inverse_sqrt_factor,
    linear_factor,
    polynomial_factor,
    warmup_stable_decay_factor,
)

if TYPE_CHECKING:
    from trainbus.engine import Engine
    from trainbus.engine.events import EvalEndEvent, OptimizerStepEvent, TrainStartEvent

#: what this module builds: a LambdaLR, or ReduceLROnPlateau (a subclass of LRScheduler in torch >= 2.2)
Scheduler = torch.optim.lr_scheduler.LRScheduler


#: scheduler name -> the extra keyword arguments it accepts (``lr_scheduler_kwargs``)
SCHEDULER_KWARGS: dict[str, tuple[str, ...]] = {
    "linear": (),
    "cosine": ("num_cycles",),
    "cosine_with_restarts": ("num_cycles",),
    "polynomial": ("lr_end", "power"),
    "constant": (),
    "constant_with_warmup": (),
    "inverse_sqrt": ("timescale",),
    "reduce_lr_on_plateau": tuple(p for p in inspect.signature(ReduceLROnPlateau).parameters if p != "optimizer"),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"),
    "warmup_stable_decay": (
        "num_decay_steps",
        "num_stable_steps",
        "warmup_type",
        "decay_type",
        "min_lr_ratio",
        "num_cycles",
    ),
}
SCHEDULER_NAMES: tuple[str, ...] = tuple(SCHEDULER_KWARGS)
_SHAPES = ("linear", "cosine", "1-sqrt")


def resolve_warmup_steps(num_training_steps: int, num_warmup_steps: float = 0, warmup_ratio: float = 0.0) -> int:
    """Warmup steps as HF computes them: ``num_warmup_steps`` when > 0, else ``ceil(ratio * total)``.

    A ``num_warmup_steps`` in (0, 1) is a ratio too (transformers 5 merged the two arguments).
    """
    for name, value in (("warmup_ratio", warmup_ratio), ("num_warmup_steps", num_warmup_steps)):
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigTypeError(f"{name} must be a number, got {value!r:.80} ({type(value).__name__})")
    if not 0.0 <= warmup_ratio <= 1.0:  # transformers' range: 1 warms up over the whole run
        raise ConfigError(f"warmup_ratio must be in [0, 1], got {warmup_ratio!r}")
    if not num_warmup_steps >= 0:
        raise ConfigError(f"num_warmup_steps must be >= 0, got {num_warmup_steps!r}")
    if num_warmup_steps >= 1:
        if num_warmup_steps != int(num_warmup_steps):
            raise ConfigError(f"num_warmup_steps must be an integer or a ratio in [0, 1), got {num_warmup_steps!r}")
        return int(num_warmup_steps)
    ratio = num_warmup_steps if num_warmup_steps > 0 else warmup_ratio
    return math.ceil(num_training_steps * ratio)


def check_scheduler_name(name: str) -> None:
    if name not in SCHEDULER_KWARGS:
        raise ConfigError(
            f"unknown lr scheduler {name!r}{suggest(name, SCHEDULER_NAMES)}; "
            f"known schedulers: {', '.join(SCHEDULER_NAMES)}"
        )


def check_scheduler_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    """Raise ConfigError for keyword arguments the scheduler ``name`` does not take, or bad shapes."""
    check_scheduler_name(name)
    allowed = SCHEDULER_KWARGS[name]
    for key in kwargs:
        if key not in allowed:
            listing = ", ".join(allowed) if allowed else "none"
            raise ConfigError(
                f"lr scheduler {name!r} takes no argument {key!r}{suggest(key, allowed)}; it takes: {listing}"
            )
    for key in ("warmup_type", "decay_type"):
        if key in kwargs and kwargs[key] not in _SHAPES:
            raise ConfigError(f"{key} must be one of {', '.join(_SHAPES)}, got {kwargs[key]!r}")


def _check_arguments(scheduler_kwargs: Any, metric: Any, num_training_steps: Any) -> None:
    """LRScheduler's arguments of the wrong kind, named (they failed later, as ``'int' object is not iterable``)."""
    if scheduler_kwargs is not None and not isinstance(scheduler_kwargs, Mapping):
        raise ConfigTypeError(
            f"scheduler_kwargs must be a dict of the schedule's arguments (e.g. {{'num_cycles': 2}}) or None, "
            f"got {scheduler_kwargs!r} ({type(scheduler_kwargs).__name__})"
        )
    if not isinstance(metric, str) or not metric:
        raise ConfigTypeError(f"metric must be the name of an eval metric (e.g. 'loss'), got {metric!r}")
    check_positive_int("num_training_steps (or None: the run's length)", num_training_steps, allow_none=True)


def _lambda(
    name: str, optimizer: torch.optim.Optimizer, total: int, warmup: int, kw: dict[str, Any]
) -> Callable[[int], float]:
    if name == "constant":
        return constant_factor
    if name == "constant_with_warmup":
        return partial(constant_with_warmup_factor, num_warmup_steps=warmup)
    if name == "inverse_sqrt":
        timescale = kw.get("timescale") or warmup or 10_000
        return partial(inverse_sqrt_factor, num_warmup_steps=warmup, timescale=timescale)
    if name == "warmup_stable_decay":
        if "num_decay_steps" not in kw:
            raise ConfigError("warmup_stable_decay needs lr_scheduler_kwargs['num_decay_steps']")
        stable = kw.pop("num_stable_steps", None)
        if stable is None:
            stable = total - warmup - kw["num_decay_steps"]
        return partial(warmup_stable_decay_factor, num_warmup_steps=warmup, num_stable_steps=stable, **kw)
    if name == "linear":
        return partial(linear_factor, num_warmup_steps=warmup, num_training_steps=total)
    if name == "cosine":
        return partial(cosine_factor, num_warmup_steps=warmup, num_training_steps=total, **kw)
    if name == "cosine_with_restarts":
        return partial(cosine_with_restarts_factor, num_warmup_steps=warmup, num_training_steps=total, **kw)
    lr_init = float(optimizer.defaults["lr"])
    if name == "polynomial":
        lr_end = kw.get("lr_end", 1e-7)
        if not lr_init > lr_end:
            raise ConfigError(f"polynomial: lr_end ({lr_end}) must be smaller than the initial lr ({lr_init})")
        return partial(
            polynomial_factor,
            num_warmup_steps=warmup,
            num_training_steps=total,
            lr_end=lr_end,
            power=kw.get("power", 1.0),
            lr_init=lr_init,
        )
    # cosine_with_min_lr, cosine_warmup_with_min_lr
    min_lr, rate = kw.pop("min_lr", None), kw.pop("min_lr_rate", None)
    if (min_lr is None) == (rate is None):
        raise ConfigError(f"{name} needs exactly one of lr_scheduler_kwargs['min_lr'] or ['min_lr_rate']")
    rate = min_lr / lr_init if min_lr is not None else rate
    factor = cosine_warmup_with_min_lr_factor if name == "cosine_warmup_with_min_lr" else cosine_factor
    return partial(factor, num_warmup_steps=warmup, num_training_steps=total, min_lr_rate=rate, **kw)


def create_scheduler(
    name: str,
    optimizer: torch.optim.Optimizer,
    num_training_steps: int,
    num_warmup_steps: float = 0,
    warmup_ratio: float = 0.0,
    scheduler_kwargs: Mapping[str, Any] | None = None,
) -> Scheduler:
    """Build the schedule ``name`` (one of ``SCHEDULER_NAMES``) for ``num_training_steps`` optimizer steps.

    Args:
        name: HF ``lr_scheduler_type``.
        optimizer: the optimizer whose learning rates are scheduled.
        num_training_steps: total optimizer steps (``state.max_steps``).
        num_warmup_steps, warmup_ratio: see ``resolve_warmup_steps``.
        scheduler_kwargs: HF ``lr_scheduler_kwargs``; the keys allowed per name are in ``SCHEDULER_KWARGS``.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1.0)
        >>> sched = create_scheduler("linear", opt, num_training_steps=4, num_warmup_steps=2)
        >>> lrs = []
        >>> for _ in range(4):
        ...     lrs.append(opt.param_groups[0]["lr"]); opt.step(); sched.step()
        >>> lrs
        [0.0, 0.5, 1.0, 0.5]
    """
    check_scheduler_name(name)
    kwargs = dict(scheduler_kwargs or {})
    check_scheduler_kwargs(name, kwargs)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_positive_int("num_training_steps", num_training_steps)
    warmup = resolve_warmup_steps(num_training_steps, num_warmup_steps, warmup_ratio)
    if name == "reduce_lr_on_plateau":
        return ReduceLROnPlateau(optimizer, **kwargs)
    return LambdaLR(optimizer, _lambda(name, optimizer, num_training_steps, warmup, kwargs))


class LRScheduler(Plugin):
    """Steps a learning-rate schedule once per optimizer step actually taken.

    Given a name, the schedule is built at TRAIN_START from ``state.max_steps`` (known only then).
    ``reduce_lr_on_plateau`` steps at EVAL_END on ``metric`` instead (HF's ``metric_for_best_model``;
    an ``eval_`` style prefix is added when missing).

    Args:
        scheduler: a scheduler instance, or a name from ``SCHEDULER_NAMES``.
        num_warmup_steps, warmup_ratio, scheduler_kwargs: for a named scheduler (see ``create_scheduler``).
        metric: the eval metric a plateau scheduler watches.
        num_training_steps: fixes the schedule length instead of ``state.max_steps``.
        optimizer: with several optimizers (``Engine(model, {"d": ..., "g": ...})``), the name of the one this
            schedules: built on it, stepped after its steps only. The plugin is then named ``LRScheduler[g]``, so
            one schedule per optimizer needs no ``name=``. Required with several optimizers.

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(4)]
        >>> engine = Engine(model, torch.optim.SGD(model.parameters(), lr=1.0), train_data=data,
        ...                 max_epochs=1, loss_fn=torch.nn.MSELoss(), plugins=[LRScheduler("linear")])
        >>> _ = engine.fit()
        >>> engine.optimizer.param_groups[0]["lr"]
        0.0
    """

    priority = Priority.DEFAULT

    def __init__(
        self,
        scheduler: Scheduler | str,
        *,
        num_warmup_steps: float = 0,
        warmup_ratio: float = 0.0,
        scheduler_kwargs: Mapping[str, Any] | None = None,
        metric: str = "loss",
        num_training_steps: int | None = None,
        optimizer: str | None = None,
    ) -> None:
        if optimizer is not None and (not isinstance(optimizer, str) or not optimizer):
            raise ConfigError(f"optimizer must name one of the engine's optimizers (a str), got {optimizer!r}")
        self.optimizer = optimizer
        if optimizer is not None:
            self.name = f"LRScheduler[{optimizer}]"
        self.scheduler: Scheduler | None = None
        self.scheduler_name: str | None = None
        _check_arguments(scheduler_kwargs, metric, num_training_steps)
        if isinstance(scheduler, str):
            check_scheduler_kwargs(scheduler, dict(scheduler_kwargs or {}))
            resolve_warmup_steps(1, num_warmup_steps, warmup_ratio)  # validates at construction
            self.scheduler_name = scheduler
        elif isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
            self.scheduler = scheduler
        else:
            raise ConfigError(
                f"scheduler must be a name ({', '.join(SCHEDULER_NAMES)}) or a torch scheduler, got {scheduler!r}"
            )
        self.num_warmup_steps = num_warmup_steps
        self.warmup_ratio = warmup_ratio
        self.scheduler_kwargs = dict(scheduler_kwargs or {})
        self.metric = metric
        self.num_training_steps = num_training_steps
        self._pending: dict[str, Any] | None = None

    @property
    def plateau(self) -> bool:
        return isinstance(self.scheduler, ReduceLROnPlateau) or self.scheduler_name == "reduce_lr_on_plateau"

    def attach(self, engine: Engine) -> None:
        # built after an optimizer plugin (FIRST would race it), before loggers read the lr
        self.on(engine, Event.TRAIN_START, self.build, priority=Priority.PRODUCER)
        self._check_named(engine)
        if self.plateau:
            self.on(engine, Event.EVAL_END, self.eval_end, priority=Priority.CONSUMER)
        elif self.optimizer is None:
            self.on(engine, Event.OPTIMIZER_STEP, self.optimizer_step)
        else:  # a name: the one-optimizer path keeps its handler as it was, with no look at the payload
            self.on(engine, Event.OPTIMIZER_STEP, self.named_optimizer_step)

    def _check_named(self, engine: Engine) -> Any:
        """The optimizer this schedules: the named one, else engine.optimizer (refused when there are several)."""
        optimizers = engine.optimizers
        if self.optimizer is None:
            if optimizers and self.scheduler is None:
                raise ConfigError(f"this engine has several optimizers {list(optimizers)}: give LRScheduler(..., "
                                  f"optimizer={next(iter(optimizers))!r}), one schedule per optimizer")  # fmt: skip
            return engine.optimizer
        if self.optimizer not in optimizers:
            raise ConfigError(f"LRScheduler(optimizer={self.optimizer!r}): this engine's optimizers are "
                              f"{list(optimizers)} (Engine(model, {{name: optimizer, ...}}))")  # fmt: skip
        return optimizers[self.optimizer]

    def build(self, ev: TrainStartEvent) -> None:
        engine = ev.engine
        if self.scheduler is None:
            optimizer = self._check_named(engine)  # type: ignore[arg-type]
            assert self.scheduler_name is not None and optimizer is not None
            total = self.num_training_steps or engine.state.max_steps
            self.scheduler = create_scheduler(
                self.scheduler_name,
                optimizer,
                total,
                self.num_warmup_steps,
                self.warmup_ratio,
                self.scheduler_kwargs,
            )
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None

    def optimizer_step(self, ev: OptimizerStepEvent) -> None:
        assert self.scheduler is not None
        self.scheduler.step()

    def named_optimizer_step(self, ev: OptimizerStepEvent) -> None:
        """Step after this schedule's optimizer stepped (or the loop's step of all of them)."""
        if ev.optimizer is None or ev.optimizer == self.optimizer:
            assert self.scheduler is not None
            self.scheduler.step()

    def eval_end(self, ev: EvalEndEvent) -> None:
        if not isinstance(self.scheduler, ReduceLROnPlateau):
            return  # evaluated before training started: nothing to step yet
        key = self.metric if self.metric.startswith(f"{ev.prefix}_") else f"{ev.prefix}_{self.metric}"
        if key not in ev.metrics:
            raise ConfigKeyError(f"reduce_lr_on_plateau watches {key!r}, but the eval metrics are {sorted(ev.metrics)}")
        self.scheduler.step(float(ev.metrics[key]))  # one host read per evaluation, not per step

    def get_last_lr(self) -> list[float]:
        """The learning rates of the optimizer's groups as the schedule set them last."""
        if self.scheduler is None:
            return []
        if isinstance(self.scheduler, ReduceLROnPlateau):
            return [float(g["lr"]) for g in self.scheduler.optimizer.param_groups]
        return [float(lr) for lr in self.scheduler.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        if self.scheduler is None:
            return {"scheduler": self._pending}
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("scheduler")
        if saved is None:
            return
        if self.scheduler is None:
            self._pending = dict(saved)  # applied when the schedule is built at TRAIN_START
        else:
            self._restore(saved)

    def _restore(self, saved: Mapping[str, Any]) -> None:
        assert self.scheduler is not None
        self.scheduler.load_state_dict(dict(saved))
        # building a LambdaLR sets the optimizer's lr to the step-0 value; put back the resumed one
        last = saved.get("_last_lr")
        if last is not None:
            for group, lr in zip(self.scheduler.optimizer.param_groups, last):
                group["lr"] = lr
