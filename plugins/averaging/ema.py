"""An exponential moving average (EMA) of the weights as a plugin.

After every optimizer step really taken (OPTIMIZER_STEP: a vetoed step or an fp16 overflow never
fires it) the averages move towards the weights with one ``torch._foreach_lerp_`` over all the
averaged tensors, on their device. The decay of an update is a Python float computed from Python
ints (the number of updates), so an update reads no tensor value: no host sync, one kernel launch
per tensor group, one aten op per update.

What is averaged: the parameters the optimizer steps (without an optimizer, those that require
grad), each average in its parameter's dtype and on its device. Buffers are not averaged by default:
the averaged weights use the model's own buffers, i.e. the buffers are *copied*, as they are at
the moment the averages are used (BatchNorm running statistics are running averages already).
``average_buffers=True`` averages the floating-point persistent buffers too, with the same decay,
in the same foreach op; integer buffers (``num_batches_tracked``) are always the model's.

Evaluation with the averages (``eval_with_ema=True``) swaps them into the model at EVAL_START and
the training weights back at EVAL_END. A swap exchanges the parameters' ``.data`` (no copy, no
extra memory): the training tensors themselves come back, so they are bit for bit what they were.
The swap runs before ``HalfPrecisionEval`` casts the model and the restore after it restores it. The
restore is a cleanup handler of EVAL_END, so it also runs when the evaluation fails (the engine fires
EVAL_END with ``payload.error`` before the exception reaches the caller): the training weights are
back whatever raised. ``predict()`` uses the training weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import check_positive_int

if TYPE_CHECKING:
    from trainbus.engine import Engine
    from trainbus.engine.events import EvalEndEvent, EvalStartEvent, OptimizerStepEvent, TrainStartEvent

#: the warmup's ramp, as torch-ema's ``ExponentialMovingAverage(use_num_updates=True)`` and
#: TensorFlow's ``tf.train.ExponentialMovingAverage(num_updates=...)`` compute it
WARMUP_FORMULA = "min(decay, (1 + t) / (10 + t)) at update t = 1, 2, ..."


def _check_flag(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


def check_decay(decay: object) -> float:
    """``decay`` as a float in (0, 1), or a ConfigError naming the value."""
    if isinstance(decay, bool) or not isinstance(decay, int | float) or not (0.0 < decay < 1.0):
        raise ConfigError(f"EMA decay must be a number in the open interval (0, 1), e.g. 0.999, got {decay!r}")
    return float(decay)


class EMA(Plugin):
    """Keep an exponential moving average of the weights; optionally evaluate with it.

    Update ``t`` (``t = 1, 2, ...``; the t-th optimizer step taken when ``every=1``) does
    ``average = d_t * average + (1 - d_t) * weight`` (as ``lerp(average, weight, 1 - d_t)``), the
    averages starting as a copy of the weights at the first TRAIN_START. Without warmup
    ``d_t = decay``. With warmup ``d_t = min(decay, (1 + t) / (10 + t))``: the ramp of torch-ema's
    ``ExponentialMovingAverage(use_num_updates=True)`` (and TensorFlow's
    ``ExponentialMovingAverage(num_updates=t)``), so the first updates follow the weights closely
    (``d_1 = 2/11``) and the average forgets its starting point; ``decay`` takes over from
    ``t = (10 * decay - 1) / (1 - decay)`` on (890 updates for 0.99, 8,990 for 0.999).

    Args:
        decay: the decay, in (0, 1).
        warmup: ramp the decay up as above (True), or use ``decay`` from the first update (False).
        every: update after every ``every``-th optimizer step taken (steps ``every``, ``2 * every``,
            ... of ``state.optimizer_steps_taken``, so the cadence survives a resume); the decay is
            per update, not per step.
        eval_with_ema: evaluate (``evaluate()``, also inside ``fit``) with the averaged weights.
        average_buffers: average the floating-point buffers too (default: use the model's own).
        save_averaged: ``Trainer.save_model`` writes the averaged weights (default) or the training ones.
        optimizer: with several optimizers (``Engine(model, {"d": ..., "g": ...})``), the name of the one whose
            parameters this averages, updated after its steps only; named ``EMA[g]``. Required with a step
            function stepping several.

    The state (the averages and ``num_updates``) is in ``state_dict()``, so checkpoints carry it
    (the averages go to the safetensors file) and a resume continues bit for bit. For saving the
    averaged model: ``averaged_state_dict()``, or ``with ema.swapped(): ...`` around any code that
    should see the averaged weights in the model.

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(8)]
        >>> ema = EMA(decay=0.9)
        >>> engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data,
        ...                 max_epochs=1, loss_fn=torch.nn.MSELoss(), plugins=[ema])
        >>> _ = engine.fit()
        >>> ema.num_updates, round(ema.decay_at(1), 4), round(ema.decay_at(100), 4)
        (8, 0.1818, 0.9)
        >>> sorted(ema.averages), torch.equal(ema.averages["weight"], model.weight)
        (['bias', 'weight'], False)
        >>> with ema.swapped():
        ...     torch.equal(ema.averages["weight"], model.weight)
        True
    """

    priority = Priority.DEFAULT

    def __init__(
        self,
        decay: float = 0.999,
        *,
        warmup: bool = True,
        every: int = 1,
        eval_with_ema: bool = False,
        average_buffers: bool = False,
        save_averaged: bool = True,
        optimizer: str | None = None,
    ) -> None:
        self.decay = check_decay(decay)
        if optimizer is not None and (not isinstance(optimizer, str) or not optimizer):
            raise ConfigError(f"EMA optimizer must name one of the engine's optimizers (a str), got {optimizer!r}")
        #: with several optimizers, the one whose parameters this averages, after its steps (named ``EMA[g]``)
        self.optimizer = optimizer
        if optimizer is not None:
            self.name = f"EMA[{optimizer}]"
        _check_flag("save_averaged", save_averaged)
        self.save_averaged = save_averaged
        if not isinstance(warmup, bool):
            raise ConfigError(
                f"EMA warmup must be True (the decay ramps as {WARMUP_FORMULA}, as torch-ema) "
                f"or False (the constant decay from the first update), got {warmup!r}"
            )
        check_positive_int("EMA every (optimizer steps between updates)", every)
        _check_flag("eval_with_ema", eval_with_ema)
        _check_flag("average_buffers", average_buffers)
        self.warmup = warmup
        self.every = every
        self.eval_with_ema = eval_with_ema
        self.average_buffers = average_buffers
        #: updates done so far (the t of the warmup); a Python int, never a tensor
        self.num_updates = 0
        self._names: list[str] | None = None  # what is averaged, in order; None until bound
        self._averaged: list[torch.Tensor] = []  # the averages, aligned with _names
        self._sources: list[torch.Tensor] = []  # the model's live tensors, aligned with _names
        self._pending: dict[str, torch.Tensor] | None = None  # loaded before the averages existed
        self._training_data: list[torch.Tensor] | None = None  # the training tensors while swapped
        self._swapped_for_eval = False  # swapped in by EVAL_START, so EVAL_END puts them back
        self._engine: Engine | None = None

    # -- the decay -------------------------------------------------------------------------------
    def decay_at(self, update: int) -> float:
        """The decay of update number ``update`` (1-based), a Python float."""
        if self.warmup:
            return min(self.decay, (1 + update) / (10 + update))
        return self.decay

    # -- wiring ----------------------------------------------------------------------------------
    def attach(self, engine: Engine) -> None:
        self._engine = engine
        # last: optimizer plugins (FIRST) and model set-up (compile, adapters) have run
        self.on(engine, Event.TRAIN_START, self._bind_at_start, priority=Priority.LAST)
        step = Event.OPTIMIZER_STEP if self.every == 1 else Event.OPTIMIZER_STEP(every=self.every)
        if self.optimizer is None and engine.step_function is not None and len(engine.optimizers) > 1:
            raise ConfigError(f"EMA with several optimizers {list(engine.optimizers)} and a step function: give "
                              "EMA(optimizer=name), one per optimizer whose parameters it averages")  # fmt: skip
        # the one-optimizer path keeps its handler as it was; a named EMA looks at the payload's optimizer
        update = self.update if self.optimizer is None else self.named_update
        self.on(engine, step, update, priority=Priority.LAST)  # after anything that edits the weights
        if self.eval_with_ema:
            # swap before HalfPrecisionEval casts (FIRST) and restore after it restored (LAST)
            self.on(engine, Event.EVAL_START, self._eval_start, priority=Priority.FIRST, before="HalfPrecisionEval")
            self.on(
                engine, Event.EVAL_END, self._eval_end, priority=Priority.LAST.after("HalfPrecisionEval"), cleanup=True
            )

    def detach(self, engine: Engine) -> None:
        self.restore(force=True)
        super().detach(engine)
        self._engine = None

    # -- binding the averages to the model -------------------------------------------------------
    def _tracked(self, engine: Engine) -> dict[str, torch.Tensor]:
        """Name -> live tensor of what is averaged: the optimizer's parameters (+ float buffers)."""
        model = engine.model
        named = dict(model.named_parameters())
        optimizer = engine.optimizer
        if self.optimizer is not None:
            if self.optimizer not in engine.optimizers:
                raise ConfigError(f"EMA(optimizer={self.optimizer!r}): this engine's optimizers are "
                                  f"{list(engine.optimizers)}")  # fmt: skip
            optimizer = engine.optimizers[self.optimizer]
        if optimizer is not None:
            stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
            tensors = {n: p for n, p in named.items() if id(p) in stepped}
        else:
            tensors = {n: p for n, p in named.items() if p.requires_grad}
        if self.average_buffers:
            persistent = model.state_dict(keep_vars=True).keys()
            tensors.update({n: b for n, b in model.named_buffers() if n in persistent and b.is_floating_point()})
        return tensors

    def _bind(self, engine: Engine) -> None:
        """Create the averages (a copy of the weights, or the loaded state) or re-find their tensors."""
        if self._names is None:
            tracked = self._tracked(engine)
            if not tracked:
                raise ConfigError("EMA found nothing to average: the model has no parameter the optimizer steps")
            if self._pending is not None:
                _check_fits(self._pending, tracked)
                averaged = [self._pending[n].to(device=t.device, copy=True) for n, t in tracked.items()]
                self._pending = None
            else:
                averaged = [t.detach().clone() for t in tracked.values()]
            self._names, self._sources, self._averaged = list(tracked), list(tracked.values()), averaged
            return
        # bound before (an earlier fit): the model's tensors are found again by name
        named = dict(engine.model.named_parameters())
        if self.average_buffers:
            named.update(dict(engine.model.named_buffers()))
        missing = [n for n in self._names if n not in named]
        if missing:
            raise ConfigError(f"EMA averages {missing} no longer exist in the model; its tensors are {sorted(named)}")
        self._sources = [named[n] for n in self._names]
        for i, (name, source) in enumerate(zip(self._names, self._sources)):
            if source.shape != self._averaged[i].shape or source.dtype != self._averaged[i].dtype:
                raise ConfigError(
                    f"EMA average {name!r} is {tuple(self._averaged[i].shape)} {self._averaged[i].dtype} but the "
                    f"model's tensor is {tuple(source.shape)} {source.dtype}"
                )
            if source.device != self._averaged[i].device:  # the model moved: the average follows it
                self._averaged[i] = self._averaged[i].to(source.device)

    def _bind_at_start(self, ev: TrainStartEvent) -> None:
        self._bind(ev.engine)

    def _engine_or(self, engine: Engine | None) -> Engine:
        if engine is None:
            engine = self._engine
        if engine is None:
            raise ConfigError("this EMA is not attached to an engine: pass the engine")
        return engine

    # -- the update (hot path) -------------------------------------------------------------------
    def update(self, ev: OptimizerStepEvent) -> None:
        """One EMA update: ``lerp(average, weight, 1 - d_t)`` over every tensor in one foreach op."""
        if self._names is None:
            self._bind(ev.engine)  # fired by hand, without TRAIN_START
        self.num_updates += 1
        weight = 1.0 - self.decay_at(self.num_updates)  # Python numbers only: nothing read from the device
        with torch.no_grad():
            torch._foreach_lerp_(self._averaged, self._sources, weight)

    def named_update(self, ev: OptimizerStepEvent) -> None:
        """Update after this EMA's optimizer stepped (or after the loop's step of all of them)."""
        if ev.optimizer is None or ev.optimizer == self.optimizer:
            self.update(ev)

    # -- the averaged weights in the model -------------------------------------------------------
    @property
    def averages(self) -> dict[str, torch.Tensor]:
        """Name -> the live averaged tensor (empty before the first TRAIN_START)."""
        return dict(zip(self._names or [], self._averaged))

    def _swap_in(self, engine: Engine) -> None:
        self._bind(engine)
        self._training_data = [source.data for source in self._sources]
        for source, average in zip(self._sources, self._averaged):
            source.data = average

    def restore(self, force: bool = False) -> bool:
        """Put the training weights back if the averages are swapped in; True when none are swapped now.

        Without ``force`` nothing happens while another plugin has swapped its own tensors in on top
        of the averages (``HalfPrecisionEval``): its restore comes first, then this one.
        """
        if self._training_data is None:
            return True
        on_top = any(
            source.data_ptr() != average.data_ptr() or source.dtype != average.dtype
            for source, average in zip(self._sources, self._averaged)
        )
        if on_top and not force:
            return False
        for source, data in zip(self._sources, self._training_data):
            source.data = data
        self._training_data = None
        return True

    @contextmanager
    def swapped(self, engine: Engine | None = None) -> Iterator[torch.nn.Module]:
        """``with ema.swapped(): ...``: the model holds the averaged weights inside, the training ones after.

        Yields the model. Nested in an evaluation that already swapped them in, it changes nothing.
        """
        engine = self._engine_or(engine)
        if self._training_data is not None:  # swapped in already
            yield engine.model
            return
        self._swap_in(engine)
        try:
            yield engine.model
        finally:
            self.restore(force=True)

    def weights_to_save(self, engine: Engine) -> AbstractContextManager[Any] | None:
        """The save-model protocol (``Trainer.save_model`` enters what plugins offer): with ``save_averaged``
        the model holds the averaged weights while the final model is written."""
        return self.swapped(engine) if self.save_averaged else None

    def averaged_state_dict(self, engine: Engine | None = None) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()`` with the averages in place of the weights, for saving.

        Tied weights and buffers come out as the model has them; the tensors alias the live
        averages (clone them to keep a snapshot while training goes on).
        """
        engine = self._engine_or(engine)
        with self.swapped(engine) as model:
            return dict(model.state_dict())

    # -- evaluation ------------------------------------------------------------------------------
    def _eval_start(self, ev: EvalStartEvent) -> None:
        if self._training_data is not None:
            return  # swapped in already (an evaluation inside ``with ema.swapped()``): it restores
        if self._names is None and self._pending is None:
            return  # never trained, nothing loaded: the average is the weights
        self._swap_in(ev.engine)
        self._swapped_for_eval = True

    def _eval_end(self, ev: EvalEndEvent) -> None:
        if self._swapped_for_eval:  # a cleanup handler: also after a failed pass
            self._swapped_for_eval = False
            self.restore(force=ev.error is not None)  # failed: whatever is still on top goes too

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        averaged = self.averages if self._names is not None else self._pending and dict(self._pending)
        return {"num_updates": self.num_updates, "averaged": averaged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        updates = state.get("num_updates")
        if isinstance(updates, bool) or not isinstance(updates, int) or updates < 0:
            raise ConfigError(f"EMA state: num_updates must be an integer >= 0, got {updates!r}")
        averaged = state.get("averaged")
        if averaged is not None and not (
            isinstance(averaged, Mapping) and all(isinstance(t, torch.Tensor) for t in averaged.values())
        ):
            raise ConfigError("EMA state: 'averaged' must map names to tensors")
        self.num_updates = updates
        if averaged is None:  # a state from before the first TRAIN_START: the averages start from the weights there
            self.restore(force=True)
            self._names, self._sources, self._averaged, self._pending = None, [], [], None
            return
        if self._names is None:
            self._pending = dict(averaged)  # the averages are created on the model's device at TRAIN_START
            return
        _check_fits(averaged, dict(zip(self._names, self._averaged)))
        with torch.no_grad():
            for name, average in zip(self._names, self._averaged):
                average.copy_(averaged[name])


def _check_fits(saved: Mapping[str, torch.Tensor], tracked: Mapping[str, torch.Tensor]) -> None:
    """Raise ConfigError unless ``saved`` holds exactly the tracked names, with their shapes and dtypes."""
    missing, unexpected = sorted(set(tracked) - set(saved)), sorted(set(saved) - set(tracked))
    if missing or unexpected:
        raise ConfigError(
            f"EMA state does not fit the model: missing averages {missing}, unexpected {unexpected} "
            "(was average_buffers or the set of trained parameters different?)"
        )
    for name, tensor in tracked.items():
        got = saved[name]
        if got.shape != tensor.shape or got.dtype != tensor.dtype:
            raise ConfigError(
                f"EMA state: average {name!r} is {tuple(got.shape)} {got.dtype}, "
                f"the model's tensor is {tuple(tensor.shape)} {tensor.dtype}"
            )


__all__ = ["EMA", "WARMUP_FORMULA", "check_decay"]
