"""Several optimizers by name, and a step function of the user's own (a GAN, actor-critic, an embeddings optimizer).

``Engine(model, {"d": opt_d, "g": opt_g}, step=train_step)``: ``engine.optimizer`` is then a
``NamedOptimizers``, which checkpoints save and restore per name (``state_dict()`` holds each optimizer's own,
so tensors go to safetensors and the rest to JSON as for one optimizer), and ``engine.optimizers`` maps the
names to the optimizers. ``train_step(engine, batch)`` runs once per batch in place of the loop's forward,
loss, backward and optimizer step, as an ignite step function does, and steps the optimizers itself with
``engine.step_optimizer(name, loss)``: backward through the backward hook, BEFORE_OPTIMIZER_STEP (clipping,
a veto), the optimizer-step hook, OPTIMIZER_STEP (schedulers, EMA), each payload naming the optimizer. What
it returns (a dict of tensors) is published, detached, in ``engine.step_outputs`` for the step's handlers.

The loop's own hot path is untouched: ``fit()`` picks the epoch runner once per epoch. A step-function run's
trace per step is ``STEP_START BATCH_START (BEFORE_OPTIMIZER_STEP OPTIMIZER_STEP?)* STEP_END``: no LOSS or
BACKWARD_END (the losses are the function's), one batch per step (accumulate inside the function).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from trainbus.hooks import Hooks

from .errors import ConfigError, check_callable
from .events import (
    BatchStartEvent,
    EpochEndEvent,
    EpochStartEvent,
    Event,
    EventType,
    P,
    StepEndEvent,
    StepStartEvent,
)
from .inputs import check_optimizer
from .lifecycle import Lifecycle
from .payloads import NamedBeforeOptimizerStepEvent, NamedOptimizerStepEvent
from .signatures import describe_callable
from .state import Control, State

if TYPE_CHECKING:
    from .view import EngineView

_STEP_START = Event.STEP_START.index
_BATCH_START = Event.BATCH_START.index
_BEFORE_OPTIMIZER_STEP = Event.BEFORE_OPTIMIZER_STEP.index
_OPTIMIZER_STEP = Event.OPTIMIZER_STEP.index
_STEP_END = Event.STEP_END.index
_HOW = 'Engine(model, {"d": opt_d, "g": opt_g}, step=train_step), train_step(engine, batch) calling ' \
       'engine.step_optimizer("d", loss_d)'  # fmt: skip


class NamedOptimizers:
    """Several optimizers under the names the user gave, standing where ``engine.optimizer`` stands.

    ``step()`` / ``zero_grad()`` act on each in order (so the default loop steps them all on one loss: an
    embeddings optimizer beside the rest); ``param_groups`` is every group of every optimizer;
    ``state_dict()`` is ``{"named": {name: optimizer.state_dict()}}`` and ``load_state_dict`` refuses other
    names or group sizes before it loads any of them.
    """

    def __init__(self, optimizers: Mapping[str, Any]) -> None:
        if not optimizers:
            raise ConfigError(f"optimizer as a dict needs at least one named optimizer, got {{}}; e.g. {_HOW}")
        for name, optimizer in optimizers.items():
            if not isinstance(name, str) or not name:
                raise ConfigError(f"optimizer names must be non-empty str, got {name!r} ({type(name).__name__})")
            try:
                check_optimizer(optimizer)
            except ConfigError as exc:
                raise ConfigError(f"optimizer {name!r}: {exc}") from None
        self._optimizers = dict(optimizers)

    def __getitem__(self, name: str) -> Any:
        try:
            return self._optimizers[name]
        except KeyError:
            known = list(self._optimizers)
            raise ConfigError(f"no optimizer named {name!r}; this engine's optimizers: {known}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._optimizers)

    def __len__(self) -> int:
        return len(self._optimizers)

    def __repr__(self) -> str:
        return f"NamedOptimizers({', '.join(f'{n}={type(o).__name__}' for n, o in self._optimizers.items())})"

    def as_mapping(self) -> Mapping[str, Any]:
        return dict(self._optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for optimizer in self._optimizers.values() for group in optimizer.param_groups]

    def step(self) -> None:
        for optimizer in self._optimizers.values():
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self._optimizers.values():
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"named": {name: optimizer.state_dict() for name, optimizer in self._optimizers.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        named = state.get("named") if isinstance(state, Mapping) else None
        if not isinstance(named, Mapping):
            raise ConfigError(f"the saved optimizer state is one optimizer's, this engine has {self!r}")
        if sorted(named) != sorted(self._optimizers):
            own_names = sorted(self._optimizers)
            raise ConfigError(f"the saved optimizers are named {sorted(named)}, this engine's {own_names}")
        for name, saved in named.items():
            own = [len(g["params"]) for g in self._optimizers[name].param_groups]
            groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
            if isinstance(groups, list) and [len(g.get("params", ())) for g in groups] != own:
                raise ConfigError(f"optimizer {name!r}: parameters per group {[len(g['params']) for g in groups]} "
                                  f"saved, {own} in this optimizer")  # fmt: skip
        for name, saved in named.items():
            self._optimizers[name].load_state_dict(saved)


def engine_optimizer(optimizer: Any) -> Any:
    """What ``Engine(model, optimizer)`` keeps: the optimizer, or ``NamedOptimizers`` for a dict of them."""
    if isinstance(optimizer, Mapping):
        return NamedOptimizers(optimizer)
    if isinstance(optimizer, list | tuple):
        kinds = ", ".join(type(o).__name__ for o in optimizer)
        raise ConfigError(
            f"optimizer is a {type(optimizer).__name__} of {len(optimizer)} ({kinds}); give several optimizers by "
            f"name, so that plugins and checkpoints can tell them apart: {_HOW}"
        )
    check_optimizer(optimizer)
    return optimizer


def check_step_function(step: Any) -> Callable[[Any, Any], Any] | None:
    """``step`` must be None or callable as ``step(engine, batch)``."""
    check_callable("step", step, "a function step(engine, batch) that steps the optimizers")
    if step is None:
        return None
    try:
        inspect.signature(step).bind(None, None)
    except TypeError as exc:
        raise ConfigError(
            f"step is called as step(engine, batch); {describe_callable(step)} cannot take it ({exc})"
        ) from None
    except ValueError:  # no signature to read (a builtin): not checked
        pass
    return step  # type: ignore[no-any-return]


class UserStep(Lifecycle):
    """``step_optimizer`` and the epoch runner of a step-function Engine (mixed into ``Engine``, which provides
    the attributes below)."""

    hooks: Hooks
    optimizer: Any
    state: State
    control: Control
    bus: Any
    step_outputs: dict[str, Any]
    step_function: Callable[[Any, Any], Any] | None
    train_data: Any
    _stepped: bool
    _move_batches: bool

    @property
    def optimizers(self) -> Mapping[str, Any]:
        raise NotImplementedError  # Engine's property

    @property
    def device(self) -> torch.device:
        raise NotImplementedError  # Engine's property

    def _fire(self, event: EventType[P], make: Callable[[], P]) -> P | None:
        raise NotImplementedError  # Engine's

    def _side_effects(self) -> None:
        raise NotImplementedError  # Engine's

    def _finish_epoch(self, epoch: int, exhausted: bool, steps_per_epoch: int | None, depth: int) -> None:
        raise NotImplementedError  # Engine's

    def step_optimizer(self, name: str | None = None, loss: torch.Tensor | None = None) -> bool:
        """Step optimizer ``name`` on ``loss`` from a step function; returns whether it stepped.

        With a loss: its gradients are zeroed, ``loss`` goes through the backward hook. Then BEFORE_OPTIMIZER_STEP
        (clipping; a handler may veto), the optimizer-step hook (False: skipped), OPTIMIZER_STEP, both payloads
        naming the optimizer. ``name`` None: the engine's one optimizer. Without a loss, the gradients are stepped
        as they are (several ``backward()`` calls of your own). All of it runs outside autocast (MixedPrecision
        runs the step function under it: forwards only, as torch recommends).
        """
        if self.step_function is None:
            raise ConfigError(f"step_optimizer() is for a step function: {_HOW}")
        optimizer = self.optimizer if name is None else self.optimizers.get(name)
        if optimizer is None or (name is None and isinstance(optimizer, NamedOptimizers)):
            if not self.optimizers:
                raise ConfigError(f"step_optimizer({name!r}): this engine has one optimizer, without a name: call "
                                  "engine.step_optimizer(loss=loss)")  # fmt: skip
            raise ConfigError(f"step_optimizer({name!r}): this engine's optimizers are {list(self.optimizers)}")
        device_type = self.device.type
        if torch.is_autocast_enabled(device_type):
            with torch.autocast(device_type, enabled=False):
                return self._step_optimizer(name, optimizer, loss)
        return self._step_optimizer(name, optimizer, loss)

    def _step_optimizer(self, name: str | None, optimizer: Any, loss: torch.Tensor | None) -> bool:
        hooks, state, callers, engine = self.hooks, self.state, self.bus.callers, cast("EngineView", self)
        if loss is not None:
            hooks.zero_grad(optimizer)
            hooks.backward(loss)
        if call := callers[_BEFORE_OPTIMIZER_STEP]:
            check = NamedBeforeOptimizerStepEvent(engine, optimizer=name)
            call(check, state.global_step + 1)
            if check.skip:
                return False
        if hooks.optimizer_step(optimizer) is False:
            return False
        if not self._stepped:
            self._stepped = True
            state.optimizer_steps_taken += 1
        if call := callers[_OPTIMIZER_STEP]:
            call(NamedOptimizerStepEvent(engine, optimizer=name), state.optimizer_steps_taken)
        return True

    def _run_user_epoch(self, max_steps: int, steps_per_epoch: int | None) -> None:
        """One epoch of a step-function run: one batch per step, its events around ``step(engine, batch)``."""
        state, control, engine = self.state, self.control, cast("EngineView", self)
        epoch = state.epochs_completed
        control.should_epoch_stop = False
        depth = self._open(Event.EPOCH_END, lambda: EpochEndEvent(engine, epoch))
        self._fire(Event.EPOCH_START, lambda: EpochStartEvent(engine, epoch))
        assert self.train_data is not None
        batches = self.hooks.epoch_iterator(self.train_data, epoch, state.batches_in_epoch)
        batches_per_epoch = len(self.train_data) if steps_per_epoch else max_steps
        exhausted = True
        for batch in batches:
            self._user_window(batch, epoch, batches_per_epoch)
            if control.requested:
                if control.should_log or control.should_evaluate or control.should_save:
                    self._side_effects()
                if control.should_training_stop or control.should_epoch_stop:
                    exhausted = False
                    break
            if state.global_step >= max_steps:
                exhausted = False
                break
        self._finish_epoch(epoch, exhausted, steps_per_epoch, depth)

    def _user_window(self, batch: Any, epoch: int, batches_per_epoch: int) -> None:
        state, callers, outputs, engine = self.state, self.bus.callers, self.step_outputs, cast("EngineView", self)
        step = state.global_step + 1
        outputs.clear()
        if call := callers[_STEP_START]:
            call(StepStartEvent(engine, (batch,)), step)
        state.micro_steps += 1
        if call := callers[_BATCH_START]:
            started = BatchStartEvent(engine, batch, 0, 1)
            call(started, state.micro_steps)
            batch = started.batch
        if self._move_batches:
            batch = self.hooks.to_device(batch, self.device)
        self._stepped = False
        assert self.step_function is not None and self.optimizer is not None
        try:
            result = self.step_function(engine, batch)
        finally:
            self.hooks.zero_grad(self.optimizer)  # no half-stepped gradients carried into the next step
        if isinstance(result, Mapping):
            outputs.update({k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in result.items()})
        elif result is not None:
            outputs["output"] = result.detach() if isinstance(result, torch.Tensor) else result
        state.global_step = step
        state.epoch_step += 1
        state.batches_in_epoch += 1
        state.epoch = epoch + state.batches_in_epoch / batches_per_epoch
        if call := callers[_STEP_END]:
            call(StepEndEvent(engine, self._stepped), step)
