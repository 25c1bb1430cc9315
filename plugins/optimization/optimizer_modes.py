"""Plugins for the optimizers that need the loop's help.

- ``ScheduleFreeModes`` puts optimizers with ``train()`` / ``eval()`` (schedule-free ones) in train
  mode for training steps and eval mode for evaluation, prediction and the final model;
- ``FusedBackward`` runs LOMO's backward, which updates the parameters as their gradients appear.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Event, Handle, Plugin, Priority

if TYPE_CHECKING:
    from trainbus.engine import Engine
    from trainbus.engine.events import Payload


def _set_mode(optimizer: Any, mode: str) -> bool:
    switch = getattr(optimizer, mode, None)
    if not callable(switch):
        return False
    switch()
    return True


class ScheduleFreeModes(Plugin):
    """Train mode for training steps, eval mode otherwise, for optimizers that have ``train()`` / ``eval()``.

    Schedule-free optimizers step from one point and evaluate at an average of the iterates: the
    parameters hold the first in train mode and the second in eval mode (their ``step`` refuses
    eval mode). As in HF, any optimizer with both methods is switched: to train mode at TRAIN_START
    and at the first step after an evaluation, to eval mode at EVAL_START and PREDICT_START. A
    checkpoint saved right after an evaluation thus holds the evaluated weights (as in HF), and
    resuming from it switches back through the optimizer's own state. Training ends in eval mode,
    before the best model is loaded, so the final model is the averaged one. Other optimizers are
    left alone; nothing runs per step.

    Example:
        >>> import torch, schedulefree
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = schedulefree.SGDScheduleFree(model.parameters(), lr=0.1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))]
        >>> engine = Engine(model, opt, train_data=data, max_epochs=1, loss_fn=torch.nn.MSELoss(),
        ...                 plugins=[ScheduleFreeModes()])
        >>> _ = engine.fit()  # SGDScheduleFree.step raises outside train mode
        >>> opt.param_groups[0]["train_mode"]
        False
    """

    # before LoadBestModelAtEnd (FIRST) at TRAIN_END, and before anything reads the weights
    priority = Priority.FIRST.before("*")

    def __init__(self) -> None:
        self._training = False
        self._back_to_train: Handle | None = None

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_START, self.train_start)
        self.on(engine, Event.TRAIN_END, self.train_end)
        self.on(engine, Event.EVAL_START, self.evaluation_start)
        self.on(engine, Event.PREDICT_START, self.evaluation_start)

    def detach(self, engine: Engine) -> None:
        self._cancel_switch_back()
        super().detach(engine)

    def train_start(self, ev: Payload) -> None:
        self._training = True
        self._cancel_switch_back()
        _set_mode(ev.engine.optimizer, "train")

    def train_end(self, ev: Payload) -> None:
        self._training = False
        self._cancel_switch_back()
        _set_mode(ev.engine.optimizer, "eval")

    def evaluation_start(self, ev: Payload) -> None:
        engine = ev.engine
        if _set_mode(engine.optimizer, "eval") and self._training and self._back_to_train is None:
            # registered only until the next step, so training pays nothing per step
            self._back_to_train = engine.on(
                Event.STEP_START, self.step_start, priority=self.priority, name=f"{self.name}.step_start"
            )

    def step_start(self, ev: Payload) -> None:
        self._cancel_switch_back()
        _set_mode(ev.engine.optimizer, "train")

    def _cancel_switch_back(self) -> None:
        if self._back_to_train is not None:
            self._back_to_train.remove()
            self._back_to_train = None


def _no_step(optimizer: torch.optim.Optimizer) -> None:
    # the update happened in backward; None counts as a step taken, so the scheduler steps. torch's
    # schedulers warn unless their wrapper of step() set this flag, and LOMO has no step() to wrap
    optimizer._opt_called = True  # type: ignore[attr-defined]


class FusedBackward(Plugin):
    """LOMO / AdaLomo: backward updates each parameter as its gradient appears; the step does nothing.

    Replaces the backward hook with ``optimizer.fused_backward(loss, lr)`` at the optimizer's
    current (scheduled) learning rate, as HF's Trainer does through accelerate. With LOMO's own
    ``clip_grad_norm`` (in ``optim_args``) it first runs LOMO's norm pass, a second backward.

    Example:
        >>> import torch
        >>> from lomo_optim import Lomo
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1))]
        >>> engine = Engine(model, Lomo(model, lr=0.1), train_data=data, max_epochs=1,
        ...                 loss_fn=torch.nn.MSELoss(), plugins=[FusedBackward()])
        >>> before = model.weight.detach().clone()
        >>> _ = engine.fit()
        >>> bool((model.weight != before).all())
        True
    """

    def attach(self, engine: Engine) -> None:
        self.wrap_hook(engine, "backward", lambda base: partial(_fused_backward, engine))
        self.wrap_hook(engine, "optimizer_step", lambda base: _no_step)
        self.on(engine, Event.TRAIN_START, self.check_optimizer)

    def check_optimizer(self, ev: Payload) -> None:
        optimizer = ev.engine.optimizer
        if not callable(getattr(optimizer, "fused_backward", None)):
            raise ConfigError(
                f"FusedBackward needs a LOMO optimizer (one with fused_backward), got {type(optimizer).__name__}"
            )


def _fused_backward(engine: Engine, loss: torch.Tensor) -> None:
    optimizer: Any = engine.optimizer
    if optimizer.clip_grad_norm:
        optimizer.grad_norm(loss)  # LOMO's first pass: the total norm its update then clips by
    optimizer.fused_backward(loss, optimizer.param_groups[0]["lr"])
