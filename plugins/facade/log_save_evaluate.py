"""transformers' ``_maybe_log_save_evaluate`` (and ``_get_learning_rate``) on trainbus's Trainer, where a subclass
overrides them.

transformers calls ``_maybe_log_save_evaluate`` once per optimizer step, after the step's ``on_step_end``
callbacks, and once per epoch, after ``on_epoch_end``. Its arguments are the running training loss (a device
tensor summing the micro-batches' losses since the last log, which the method resets when it logs), the step's
gradient norm, the model, the trial, the epoch's index, the evaluation's ignore keys, the run's start time and
the learning rate of the step; its body logs when ``control.should_log``, evaluates when ``should_evaluate`` and
saves when ``should_save``. Subclasses override it to put values of their own in the logs, or to decide
themselves when to evaluate and save. trainbus's engine acts on the Control flags after STEP_END itself, so a
Trainer whose class does not override it builds nothing of this module and no step pays for it.

With an override, composition adds ``LogSaveEvaluate`` and uses ``StepEndLogger`` as the run's logger:

- each micro-batch's loss (LOSS, after accumulation scaled it: transformers' ``training_step`` value) is added on
  the device into ``trainer._tr_loss``; under ``logging_nan_inf_filter`` a NaN / Inf loss adds the running mean
  instead, decided on the device (no host read);
- each step reads its learning rate through ``_get_learning_rate()`` before the scheduler moves it (a float, as
  transformers': a learning rate kept as a tensor, torchao's, is read on the host then, as there);
- after STEP_END's other handlers, and after EPOCH_END's, the override runs with transformers' arguments. The
  flags it leaves set stay set until the epoch's call (transformers clears them only at the next step's start);
  the engine acts on none of them: the override's decisions are the run's.
- ``super()._maybe_log_save_evaluate`` is transformers' body in trainbus's terms: the loss since the last log
  (averaged over processes, read with the grad norm in one transfer; ``tr_loss`` reset), ``self.log``; the
  scheduled evaluation (``_evaluate`` / ``evaluate``: the best metric and ``save_strategy="best"`` are kept at
  EVAL_END); a SAVE (Checkpointing writes through ``_save_checkpoint``, then the callbacks' ``on_save``).

``train_loss`` is transformers' total: ``_total_loss_scalar`` plus what ``tr_loss`` holds at the end, over the
run's steps. Checkpoints carry ``tr_loss``, ``_total_loss_scalar`` and ``_globalstep_last_logged``, so a resumed
run logs what the uninterrupted one logs (as trainbus's own logger does; transformers starts the loss anew).

A subclass overriding only ``_get_learning_rate`` gets it called once per step, as transformers does, and the
learning rate its logs show is the one it returned.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping
from typing import Any

import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.payloads import SaveEvent

from ..control.best_model import BestMetric
from ..distributed.processes import all_reduce_sum, collective_device, world_size
from ..observability.logging import TrainLogger

#: the flags transformers' ``_maybe_log_save_evaluate`` reads (the rest, the stops, the loop reads itself)
_DECIDED = ("should_log", "should_evaluate", "should_save")
#: transformers' call: ``(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=)``
_ARGUMENTS = "tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None"


def check_step_end_override(cls: type) -> None:
    """An override that cannot take transformers' arguments would fail at the first step: refused now."""
    method = cls._maybe_log_save_evaluate  # type: ignore[attr-defined]
    try:
        inspect.signature(method).bind(None, *([None] * 7), learning_rate=None)
    except TypeError as error:
        raise ConfigError(
            f"{cls.__qualname__}._maybe_log_save_evaluate{inspect.signature(method)} cannot take transformers' "
            f"arguments ({_ARGUMENTS}), with which the Trainer calls it after every step: {error}"
        ) from None


class LogSaveEvaluate(Plugin):
    """Calls a subclass's ``_maybe_log_save_evaluate`` where transformers does (see the module docstring).

    Args:
        step_end: the class overrides ``_maybe_log_save_evaluate`` (else only ``_get_learning_rate``).
        nan_inf_filter: ``logging_nan_inf_filter``.
    """

    not_resumed = ("_start_time",)

    def __init__(self, step_end: bool, nan_inf_filter: bool = True) -> None:
        self.step_end = step_end
        self.nan_inf_filter = nan_inf_filter
        self._trainer: Any = None
        self._learning_rate: Any = None
        self._start_time = 0.0
        self._left: dict[str, bool] = {}  # the flags the step's call left set, for the epoch's call
        self._loaded: dict[str, Any] | None = None

    def attach(self, engine: Any) -> None:
        self._trainer = engine
        # after clipping and the callbacks' on_pre_optimizer_step; before OPTIMIZER_STEP moves the scheduler
        self.on(engine, Event.BEFORE_OPTIMIZER_STEP, self.read_learning_rate, priority=Priority.LAST, after="*")
        if not self.step_end:  # the logs show what _get_learning_rate returned
            self.on(engine, Event.LOG, self.logged_rate, priority=Priority.PRODUCER.after("TrainLogger.fill"))
            return
        self.on(engine, Event.TRAIN_START, self.train_start, priority=Priority.FIRST)
        self.on(engine, Event.LOSS, self.add_loss, priority=Priority.CONSUMER)
        self.on(engine, Event.STEP_END, self.after_step, priority=Priority.LAST, after="*")
        self.on(engine, Event.EPOCH_END, self.flags_left, priority=Priority.FIRST)
        self.on(engine, Event.EPOCH_END, self.after_epoch, priority=Priority.LAST, after="*")

    # -- per step --------------------------------------------------------------------------------
    def read_learning_rate(self, ev: Any) -> None:
        self._learning_rate = ev.engine._get_learning_rate()

    def logged_rate(self, ev: Any) -> None:
        if ev.window and "learning_rate" in ev.logs and self._learning_rate is not None:
            ev.logs["learning_rate"] = self._learning_rate

    def train_start(self, ev: Any) -> None:
        trainer = ev.engine
        loaded, self._loaded = self._loaded, None
        trainer._tr_loss = torch.zeros((), device=trainer.args.device)  # transformers' tr_loss (float32)
        if loaded is None:  # a fresh run: as transformers' train()
            trainer._total_loss_scalar, trainer._globalstep_last_logged = 0.0, trainer.state.global_step
        else:  # the checkpointed run goes on: its open window and totals
            trainer._tr_loss += torch.as_tensor(loaded["tr_loss"]).to(trainer._tr_loss.device)
            trainer._total_loss_scalar = float(loaded["total_loss_scalar"])
            trainer._globalstep_last_logged = int(loaded["globalstep_last_logged"])
        self._start_time = time.time()
        self._left, self._learning_rate = {}, None
        trainer.control.reset_side_effects()  # what an earlier train() left set is not this run's

    def add_loss(self, ev: Any) -> None:
        trainer = ev.engine
        total, loss = trainer._tr_loss, ev.loss.detach().reshape(())
        if self.nan_inf_filter:  # transformers: a NaN / Inf loss adds the mean of the window so far
            window = 1 + trainer.state.global_step - trainer._globalstep_last_logged
            loss = torch.where(torch.isfinite(loss), loss, total / window)
        total += loss

    def after_step(self, ev: Any) -> None:
        trainer = ev.engine
        self._call(trainer, trainer.state.epochs_completed)
        control = trainer.control
        self._left = {flag: getattr(control, flag) for flag in _DECIDED}
        control.reset_side_effects()  # the engine acts on none: the override decided

    def flags_left(self, ev: Any) -> None:
        """transformers clears the flags at the next step's start only: the epoch's on_epoch_end and call see
        what the last step's call left set."""
        control = ev.engine.control
        for flag, value in self._left.items():
            if value:
                setattr(control, flag, True)
        self._left = {}

    def after_epoch(self, ev: Any) -> None:
        self._call(ev.engine, ev.epoch)
        ev.engine.control.reset_side_effects()

    def _call(self, trainer: Any, epoch: int) -> None:
        logger = getattr(trainer, "train_logger", None)
        if isinstance(logger, StepEndLogger):
            logger.flush_tokens(trainer)  # state.num_input_tokens_seen is current, as in transformers' loop
        trainer._maybe_log_save_evaluate(
            trainer._tr_loss,
            trainer.step_outputs.get("grad_norm"),
            trainer.model_wrapped,
            trainer._trial,
            epoch,
            None,  # train(ignore_keys_for_eval=...) is refused by trainbus's train()
            self._start_time,
            learning_rate=self._learning_rate,
        )

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        if not self.step_end or trainer is None or getattr(trainer, "_tr_loss", None) is None:
            return {}
        return {
            "tr_loss": trainer._tr_loss.detach().clone(),  # a tensor: the checkpoint stores it, no read here
            "total_loss_scalar": float(trainer._total_loss_scalar),
            "globalstep_last_logged": int(trainer._globalstep_last_logged),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loaded = dict(state) if state else None


class StepEndLogger(TrainLogger):
    """The run's TrainLogger where a subclass's ``_maybe_log_save_evaluate`` logs the training loss: the
    subclass's ``tr_loss`` is the loss window, so this logger keeps none, and ``train_loss`` is transformers'
    total (``_total_loss_scalar`` and what ``tr_loss`` still holds)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.name = "TrainLogger"  # its handlers' names and its checkpoint key are the logger's

    def loss(self, ev: Any) -> None:
        super().loss(ev)
        assert self._window is not None
        self._window.pop()  # the step's loss went into the Trainer's tr_loss instead

    def fill(self, ev: Any) -> None:
        if not ev.window:  # the loss is logged by _maybe_log_save_evaluate, never at a logging point's record
            super().fill(ev)

    def flush_tokens(self, engine: Any) -> None:
        if self.tokens != "no" and self._window is not None:
            self._read(engine, extras_too=False)  # the window is empty: only the pending token count is read

    def train_end(self, ev: Any) -> None:
        trainer = ev.engine
        if self._window is not None and getattr(trainer, "_tr_loss", None) is not None:
            self._total_loss = trainer._total_loss_scalar + _mean_over_processes(trainer._tr_loss)
        super().train_end(ev)


def _mean_over_processes(value: torch.Tensor) -> float:
    if world_size() > 1:
        value = all_reduce_sum(value.detach().to(collective_device())) / world_size()
    return float(value)


class TrainerLogSaveEvaluate:
    """transformers' ``_maybe_log_save_evaluate`` and the helpers its copied bodies call (a mixin of ``Trainer``)."""

    # provided by Trainer / Engine
    args: Any
    state: Any
    control: Any
    get_plugin: Any
    _fire: Any
    _globalstep_last_logged: int
    _total_loss_scalar: float

    def _maybe_log_save_evaluate(
        self,
        tr_loss: torch.Tensor,
        grad_norm: Any,
        model: Any,
        trial: Any,
        epoch: float,
        ignore_keys_for_eval: list[str] | None,
        start_time: float,
        learning_rate: float | None = None,
    ) -> None:
        """Log the training loss since the last log, evaluate and save, as the Control flags ask (transformers').

        Called by trainbus only when a subclass overrides it (``log_save_evaluate.py``): this is its ``super()``.
        """
        control, state = self.control, self.state
        if control.should_log and state.global_step > self._globalstep_last_logged:
            self._log_training_loss(tr_loss, grad_norm, start_time, learning_rate)
        if control.should_evaluate:
            control.should_evaluate = False
            # _evaluate / evaluate(); BestMetric and save_strategy="best" (should_save) act at its EVAL_END
            self._scheduled_evaluation(trial, ignore_keys_for_eval)  # type: ignore[attr-defined]
        if control.should_save:
            control.should_save = False
            engine: Any = self
            self._fire(Event.SAVE, lambda: SaveEvent(engine))  # Checkpointing -> _save_checkpoint, then on_save

    def _log_training_loss(self, tr_loss: torch.Tensor, grad_norm: Any, start_time: float, rate: Any) -> None:
        """The loss per step since the last log (over processes), the grad norm and learning rate: one host read."""
        loss = tr_loss.detach().reshape(())
        if world_size() > 1:
            loss = all_reduce_sum(loss.to(collective_device())) / world_size()
        parts = [loss.to(torch.float64)]
        if isinstance(grad_norm, torch.Tensor):
            parts.append(grad_norm.detach().reshape(()).to(loss.device, torch.float64))
        values = torch.stack(parts).tolist()
        # the caller's tensor, which the loop goes on adding to; zeroed, so that an unfiltered NaN stays in its
        # window as with trainbus's logger (transformers' ``tr_loss -= tr_loss`` keeps a NaN for the rest of the run)
        tr_loss.zero_()
        logs: dict[str, Any] = {"loss": values[0] / (self.state.global_step - self._globalstep_last_logged)}
        if grad_norm is not None:
            logs["grad_norm"] = values[1] if isinstance(grad_norm, torch.Tensor) else grad_norm
        logs["learning_rate"] = rate if rate is not None else self._get_learning_rate()  # type: ignore[attr-defined]
        self._total_loss_scalar += values[0]
        self._globalstep_last_logged = self.state.global_step
        self.store_flos()  # type: ignore[attr-defined]
        self.log(logs, start_time)  # type: ignore[attr-defined]

    def _determine_best_metric(self, metrics: dict[str, float], trial: Any) -> bool:
        """Whether ``metrics``, the latest evaluation's, set a new best ``metric_for_best_model`` (transformers').

        The BestMetric plugin already kept ``state.best_metric`` / ``best_global_step`` when that evaluation
        ended, so this only answers (a copied ``_maybe_log_save_evaluate`` body calls it after ``_evaluate``)."""
        keeper = self.get_plugin(BestMetric)
        if keeper is None:
            return False
        if not isinstance(metrics, Mapping) or keeper.key not in metrics:
            raise KeyError(
                f"metric_for_best_model is {keeper.key!r}, which these metrics lack: "
                f"{sorted(metrics) if isinstance(metrics, Mapping) else metrics!r}"
            )
        return bool(keeper.improved) and metrics[keeper.key] == self.state.best_metric

    def _nested_gather(self, tensors: Any, name: str | None = None) -> Any:
        """``tensors`` gathered from every process, concatenated (transformers 4's; one process: as they are)."""
        if tensors is None or world_size() == 1:
            return tensors
        return self.accelerator.gather(tensors)  # type: ignore[attr-defined]
