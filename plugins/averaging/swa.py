"""Stochastic weight averaging (SWA) as a plugin, through ``torch.optim.swa_utils``.

The SWA phase starts at an epoch (``start_epoch``, 0-based) or at an optimizer step
(``start_step``, counted in steps really taken). From its start:

- ``SWALR`` drives the learning rate: it is built from the lr the run has reached, anneals it to
  ``swa_lr`` over ``anneal_epochs`` of its steps (cosine or linear) and steps once per unit (at the
  end of every finished epoch, or after every optimizer step). The plugin owns the lr then: it
  writes SWALR's lr back into the optimizer after anything else that sets it (another schedule's
  OPTIMIZER_STEP, a plateau schedule's EVAL_END, a resume), so the steps use it and loggers see it.
- ``AveragedModel`` averages the weights (the equal-weight SWA average) at the end of the phase's
  first unit and of every ``every``-th one after it: the ends of epochs ``start_epoch``,
  ``start_epoch + every``, ... or the weights after optimizer steps ``start_step``,
  ``start_step + every``, ...

At TRAIN_END ``update_bn`` recomputes the averaged model's BatchNorm statistics over the train data
(or ``bn_data``), through the engine's ``to_device`` and ``forward`` hooks so any batch shape works,
with the global RNG states kept as they were; across processes each rank's statistics are then
averaged. With ``load_at_end`` the averaged weights and buffers are then copied into the model, so
what is saved or evaluated after training is the SWA model (as Lightning's SWA callback does).

The averaged model, the scheduler and where the phase stands are in ``state_dict()``: a checkpoint
carries them (the averaged tensors go to safetensors) and a resume continues bit for bit. An
``AveragedModel`` update reads its ``n_averaged`` counter (two host syncs on a GPU): SWA averages
once per epoch or every few steps, not at every step as ``EMA`` does.
"""

from __future__ import annotations

import itertools
import logging
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import check_positive_int

from ..distributed.processes import all_reduce_sum, world_size

if TYPE_CHECKING:
    from trainbus.engine import Engine
    from trainbus.engine.events import (
        EpochEndEvent,
        EpochStartEvent,
        OptimizerStepEvent,
        StepStartEvent,
        TrainEndEvent,
        TrainStartEvent,
    )

logger = logging.getLogger(__name__)

ANNEAL_STRATEGIES = ("cos", "linear")


def _check_lr(swa_lr: object) -> float | list[float] | None:
    def ok(value: object) -> bool:
        return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and value >= 0

    if swa_lr is None:
        return None
    if ok(swa_lr):
        return float(swa_lr)  # type: ignore[arg-type]
    if isinstance(swa_lr, Sequence) and not isinstance(swa_lr, str) and swa_lr and all(ok(v) for v in swa_lr):
        return [float(v) for v in swa_lr]
    raise ConfigError(
        "swa_lr must be a learning rate >= 0, a non-empty list of them (one per parameter group), "
        f"or None (SWA leaves the learning rate alone), got {swa_lr!r}"
    )


class _HookForward(torch.nn.Module):
    """``update_bn``'s model: a batch goes through the engine's ``to_device`` and ``forward`` hooks."""

    def __init__(self, module: torch.nn.Module, engine: Engine, device: torch.device) -> None:
        super().__init__()
        self.module = module
        self.engine = engine
        self.device = device

    def forward(self, batch: Any) -> Any:
        hooks = self.engine.hooks
        return hooks.forward(self.module, hooks.to_device(batch, self.device))


class SWA(Plugin):
    """Stochastic weight averaging: an equal-weight average of late weights, SWALR, BatchNorm update.

    Args:
        swa_lr: the learning rate SWALR anneals to (one per parameter group, or one for all);
            None: SWA leaves the learning rate to the other plugins.
        start_epoch: the phase starts with this epoch (0-based); its end is averaged first.
        start_step: or: the phase starts with this optimizer step (1-based, steps taken); the
            weights after it are averaged first. Exactly one of the two.
        every: average every ``every`` units (epochs or optimizer steps) of the phase.
        anneal_epochs: SWALR steps (units) to go from the run's lr to ``swa_lr``; 0: at once.
        anneal_strategy: "cos" or "linear".
        use_buffers: average the buffers too (``AveragedModel(use_buffers=True)``); by default
            they are copied from the model at each average and recomputed by ``update_bn``.
        update_bn: recompute the BatchNorm statistics of the averaged model at TRAIN_END.
        bn_data: the batches for that (default: ``engine.train_data``).
        load_at_end: copy the averaged weights into the model at TRAIN_END.
        device: where the averaged model lives (default: the model's device).

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
        >>> data = [(torch.randn(8, 2), torch.randn(8, 1)) for _ in range(4)]
        >>> swa = SWA(swa_lr=0.01, start_epoch=2, anneal_epochs=2)
        >>> engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data,
        ...                 max_epochs=5, loss_fn=torch.nn.MSELoss(), plugins=[swa])
        >>> _ = engine.fit()
        >>> int(swa.averaged.n_averaged), engine.optimizer.param_groups[0]["lr"]
        (3, 0.01)
        >>> all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), swa.averaged_state_dict().values()))
        True
    """

    priority = Priority.DEFAULT

    def __init__(
        self,
        swa_lr: float | Sequence[float] | None = None,
        *,
        start_epoch: int | None = None,
        start_step: int | None = None,
        every: int = 1,
        anneal_epochs: int = 10,
        anneal_strategy: str = "cos",
        use_buffers: bool = False,
        update_bn: bool = True,
        bn_data: Iterable[Any] | None = None,
        load_at_end: bool = True,
        device: torch.device | str | None = None,
    ) -> None:
        if (start_epoch is None) == (start_step is None):
            raise ConfigError(
                "SWA needs exactly one of start_epoch (the 0-based epoch the averaging starts with) "
                f"and start_step (the optimizer step it starts with), got start_epoch={start_epoch!r}, "
                f"start_step={start_step!r}"
            )
        if start_epoch is not None:
            check_positive_int("SWA start_epoch (0-based)", start_epoch, minimum=0)
        else:
            check_positive_int("SWA start_step (optimizer steps, 1-based)", start_step, minimum=1)
        check_positive_int("SWA every", every)
        check_positive_int("SWA anneal_epochs", anneal_epochs, minimum=0)
        if anneal_strategy not in ANNEAL_STRATEGIES:
            raise ConfigError(f"SWA anneal_strategy must be one of {ANNEAL_STRATEGIES}, got {anneal_strategy!r}")
        for flag, value in (("use_buffers", use_buffers), ("update_bn", update_bn), ("load_at_end", load_at_end)):
            if not isinstance(value, bool):
                raise ConfigError(f"SWA {flag} must be True or False, got {value!r}")
        if bn_data is not None and not isinstance(bn_data, Iterable):
            raise ConfigError(f"SWA bn_data must be an iterable of batches or None, got {type(bn_data).__name__}")
        try:
            self.device = None if device is None else torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(f"SWA device must be a torch device or None, got {device!r}") from exc
        self.swa_lr = _check_lr(swa_lr)
        self.unit = "epoch" if start_epoch is not None else "step"
        self.start: int = start_epoch if start_epoch is not None else start_step  # type: ignore[assignment]
        self.every = every
        self.anneal_epochs = anneal_epochs
        self.anneal_strategy = anneal_strategy
        self.use_buffers = use_buffers
        self.update_bn = update_bn
        self.bn_data = bn_data
        self.load_at_end = load_at_end
        #: the averaged model (``torch.optim.swa_utils.AveragedModel``); None before the first average
        self.averaged: AveragedModel | None = None
        #: the phase's ``SWALR``; None before the phase (or with ``swa_lr=None``)
        self.scheduler: SWALR | None = None
        self._last_unit = -1  # the last epoch / optimizer step the phase processed (replays are skipped)
        self._pending_averaged: dict[str, torch.Tensor] | None = None
        self._pending_scheduler: dict[str, Any] | None = None
        self._engine: Engine | None = None

    # -- wiring ----------------------------------------------------------------------------------
    def attach(self, engine: Engine) -> None:
        if engine.optimizers:
            raise ConfigError(
                f"SWA drives one optimizer's learning rate (SWALR) and averages the whole model; this engine has "
                f"several {list(engine.optimizers)}: average one network with torch.optim.swa_utils.AveragedModel "
                "in a plugin of your own, or use EMA(optimizer=name), which serves one named optimizer"
            )
        self._engine = engine
        # last: an optimizer plugin may build the optimizer, a schedule may restore its lr (PRODUCER)
        self.on(engine, Event.TRAIN_START, self._train_start, priority=Priority.LAST)
        if self.unit == "epoch":
            self.on(engine, Event.EPOCH_START, self._epoch_start, priority=Priority.LAST)
            self.on(engine, Event.EPOCH_END, self._epoch_end)
        else:
            self.on(engine, Event.STEP_START, self._step_start, priority=Priority.LAST)
        # last: after another schedule stepped (DEFAULT) and after anything that edits the weights
        self.on(engine, Event.OPTIMIZER_STEP, self._optimizer_step, priority=Priority.LAST)
        self.on(engine, Event.EVAL_END, self._apply_lr_event, priority=Priority.LAST)  # after a plateau schedule
        self.on(engine, Event.TRAIN_END, self._train_end)

    def detach(self, engine: Engine) -> None:
        super().detach(engine)
        self._engine = None

    # -- the phase -------------------------------------------------------------------------------
    def _build_scheduler(self, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any] | None = None) -> None:
        if self.swa_lr is None:
            return
        groups = len(optimizer.param_groups)
        if isinstance(self.swa_lr, list) and len(self.swa_lr) != groups:
            raise ConfigError(f"swa_lr has {len(self.swa_lr)} learning rates but the optimizer has {groups} groups")
        self.scheduler = SWALR(
            optimizer,
            swa_lr=self.swa_lr,  # type: ignore[arg-type]  # a list is allowed: one lr per group
            anneal_epochs=self.anneal_epochs,
            anneal_strategy=self.anneal_strategy,  # type: ignore[arg-type]
        )
        if saved is not None:
            self.scheduler.load_state_dict(dict(saved))
        self._apply_lr(optimizer)

    def _apply_lr(self, optimizer: torch.optim.Optimizer | None) -> None:
        """Write SWALR's last lr into the optimizer (others may have set theirs since)."""
        if self.scheduler is None or optimizer is None:
            return
        for group, lr in zip(optimizer.param_groups, self.scheduler.get_last_lr()):
            group["lr"] = lr

    def _apply_lr_event(self, ev: Any) -> None:
        self._apply_lr(ev.engine.optimizer)

    def _advance(self, engine: Engine, unit: int) -> None:
        """One unit of the phase ended: average when due, then step SWALR."""
        self._apply_lr(engine.optimizer)  # SWALR derives its next lr from the one it set last
        if (unit - self.start) % self.every == 0:
            self.average(engine)
        if self.scheduler is not None:
            if self.scheduler._step_count == 1:  # its first step may come before any optimizer step after a resume
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step", UserWarning)
                    self.scheduler.step()
            else:
                self.scheduler.step()
        self._last_unit = unit

    def average(self, engine: Engine | None = None) -> None:
        """Add the model's current weights to the average (what the phase does at each averaging point)."""
        engine = self._engine_or(engine)
        self._materialize(engine)
        if self.averaged is None:
            self.averaged = AveragedModel(engine.model, device=self.device, use_buffers=self.use_buffers)
        self.averaged.update_parameters(engine.model)

    def _train_start(self, ev: TrainStartEvent) -> None:
        engine = ev.engine
        self._materialize(engine)
        optimizer = engine.optimizer
        assert optimizer is not None  # fit() checked it
        if self._pending_scheduler is not None:
            saved, self._pending_scheduler = self._pending_scheduler, None
            self._build_scheduler(optimizer, saved)
        elif self.scheduler is not None and self.scheduler.optimizer is not optimizer:
            self._build_scheduler(optimizer, self.scheduler.state_dict())  # an optimizer plugin made a new one
        self._apply_lr(optimizer)

    def _epoch_start(self, ev: EpochStartEvent) -> None:
        if ev.epoch >= self.start and self.scheduler is None and ev.engine.optimizer is not None:
            self._build_scheduler(ev.engine.optimizer)

    def _epoch_end(self, ev: EpochEndEvent) -> None:
        state = ev.engine.state
        finished = state.epochs_completed == ev.epoch + 1  # not a stop in the middle of the epoch
        # each epoch of the phase once, whatever fires its EPOCH_END
        if finished and ev.epoch >= self.start and ev.epoch > self._last_unit:
            self._advance(ev.engine, ev.epoch)

    def _step_start(self, ev: StepStartEvent) -> None:
        optimizer = ev.engine.optimizer
        if self.scheduler is None and optimizer is not None and ev.engine.state.optimizer_steps_taken + 1 >= self.start:
            self._build_scheduler(optimizer)

    def _optimizer_step(self, ev: OptimizerStepEvent) -> None:
        engine = ev.engine
        if self.unit == "step":
            taken = engine.state.optimizer_steps_taken
            if taken >= self.start and taken > self._last_unit:
                self._advance(engine, taken)
                return
        self._apply_lr(engine.optimizer)

    # -- the end of training ---------------------------------------------------------------------
    def _train_end(self, ev: TrainEndEvent) -> None:
        engine = ev.engine
        if self.averaged is None:
            where = f"epoch {self.start}" if self.unit == "epoch" else f"optimizer step {self.start}"
            logger.warning("SWA: the run ended before %s, where averaging starts; the model keeps its weights", where)
            return
        if self.update_bn:
            self.recompute_bn(engine)
        if self.load_at_end:
            engine.model.load_state_dict(self.averaged.module.state_dict())

    def recompute_bn(self, engine: Engine | None = None, data: Iterable[Any] | None = None) -> None:
        """``torch.optim.swa_utils.update_bn`` on the averaged model over ``data`` (default: bn_data or train_data)."""
        engine = self._engine_or(engine)
        if self.averaged is None:
            raise ConfigError("SWA has averaged nothing yet: no BatchNorm statistics to recompute")
        module = self.averaged.module
        batch_norms = [m for m in module.modules() if isinstance(m, _BatchNorm)]
        if not batch_norms:
            return
        data = data if data is not None else self.bn_data if self.bn_data is not None else engine.train_data
        if data is None:
            raise ConfigError("SWA update_bn needs data: pass bn_data or give the engine train_data")
        first = next(itertools.chain(module.parameters(), module.buffers()))
        model = _HookForward(module, engine, first.device)
        model.train(module.training)  # update_bn puts back the mode it finds
        devices = []
        if first.device.type == "cuda":
            devices = [torch.cuda.current_device() if first.device.index is None else first.device.index]
        with torch.random.fork_rng(devices=devices):  # a shuffling loader or dropout draws nothing from the run
            update_bn(((batch,) for batch in data), model)  # a 1-tuple: update_bn passes its first item on
        processes = world_size()
        if processes > 1:  # every rank saw its shard: average the statistics
            with torch.no_grad():
                for bn in batch_norms:
                    for buffer in (bn.running_mean, bn.running_var):
                        if buffer is not None:
                            buffer.copy_(all_reduce_sum(buffer) / processes)

    def averaged_state_dict(self, engine: Engine | None = None) -> dict[str, torch.Tensor]:
        """The averaged model's ``state_dict()`` (the model's keys), for saving."""
        if self.averaged is None:
            self._materialize(self._engine_or(engine))
        if self.averaged is None:
            raise ConfigError("SWA has averaged nothing yet")
        return dict(self.averaged.module.state_dict())

    def _engine_or(self, engine: Engine | None) -> Engine:
        if engine is None:
            engine = self._engine
        if engine is None:
            raise ConfigError("this SWA is not attached to an engine: pass the engine")
        return engine

    # -- checkpoints -----------------------------------------------------------------------------
    def _materialize(self, engine: Engine) -> None:
        """Create the averaged model from a loaded state (it needs the model, known only once attached)."""
        if self._pending_averaged is None:
            return
        saved, self._pending_averaged = self._pending_averaged, None
        self.averaged = AveragedModel(engine.model, device=self.device, use_buffers=self.use_buffers)
        try:
            self.averaged.load_state_dict(saved)
        except RuntimeError as exc:
            raise ConfigError(f"SWA state does not fit the model: {exc}") from exc

    def state_dict(self) -> dict[str, Any]:
        if self._pending_averaged is not None:
            averaged: dict[str, torch.Tensor] | None = dict(self._pending_averaged)
        else:
            averaged = None if self.averaged is None else dict(self.averaged.state_dict())
        scheduler = self._pending_scheduler
        if scheduler is None and self.scheduler is not None:
            scheduler = self.scheduler.state_dict()
        return {"averaged": averaged, "scheduler": scheduler, "last_unit": self._last_unit}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        last = state.get("last_unit")
        if isinstance(last, bool) or not isinstance(last, int) or last < -1:
            raise ConfigError(f"SWA state: last_unit must be an integer >= -1, got {last!r}")
        averaged, scheduler = state.get("averaged"), state.get("scheduler")
        if averaged is not None and not isinstance(averaged, Mapping):
            raise ConfigError("SWA state: 'averaged' must be an AveragedModel state_dict or None")
        if scheduler is not None and not isinstance(scheduler, Mapping):
            raise ConfigError("SWA state: 'scheduler' must be a SWALR state_dict or None")
        self._last_unit = last
        self.averaged, self._pending_averaged = None, None if averaged is None else dict(averaged)
        self.scheduler, self._pending_scheduler = None, None if scheduler is None else dict(scheduler)
        if self._engine is not None:
            self._materialize(self._engine)  # the averaged model is there at once; SWALR at TRAIN_START


__all__ = ["ANNEAL_STRATEGIES", "SWA"]
