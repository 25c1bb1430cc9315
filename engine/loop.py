"""The Engine: fit / evaluate / predict over micro-batch windows, firing typed events.

The engine knows no feature. It groups micro-batches into windows of ``accumulation_steps``
(set by an accumulation plugin; 1 by default), calls the step functions in ``engine.hooks``,
fires the events of ``events.py`` and acts on ``Control`` at the points documented there.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from trainbus.hooks import Hooks, loss_with

from .assembly import Assembly, HookWrapper
from .bus import EventBus, Handle, Order, Priority, Targets
from .errors import ConfigError, check_positive_int
from .events import (
    BackwardEndEvent,
    BatchStartEvent,
    BeforeOptimizerStepEvent,
    EpochEndEvent,
    EpochStartEvent,
    Event,
    EventType,
    FilteredEvent,
    LogEvent,
    LossEvent,
    OptimizerStepEvent,
    P,
    SaveEvent,
    StepEndEvent,
    StepStartEvent,
    TrainEndEvent,
    TrainStartEvent,
)
from .inputs import (
    check_data,
    check_device,
    check_engine_arguments,
    check_label_names,
    check_optimizer,
    check_plugins,
)
from .lifecycle import Lifecycle, OpenEnd
from .passes import Passes
from .plugin import Plugin
from .state import Control, State
from .user_step import NamedOptimizers, UserStep, check_step_function, engine_optimizer

logger = logging.getLogger("trainbus.engine")

# handler-table slots of the hot events, looked up once instead of per step
_STEP_START = Event.STEP_START.index
_BATCH_START = Event.BATCH_START.index
_LOSS = Event.LOSS.index
_BACKWARD_END = Event.BACKWARD_END.index
_BEFORE_OPTIMIZER_STEP = Event.BEFORE_OPTIMIZER_STEP.index
_OPTIMIZER_STEP = Event.OPTIMIZER_STEP.index
_STEP_END = Event.STEP_END.index


def _windows(batches: Iterator[Any], k: int) -> Iterator[tuple[Any, ...]]:
    """Consecutive windows of ``k`` batches; the last one may be shorter."""
    while window := tuple(itertools.islice(batches, k)):
        yield window


def data_length(data: Any) -> int | None:
    """len(data), or None for data without a length (iterable datasets, generators)."""
    try:
        return len(data)
    except TypeError:
        return None


class Engine(Passes, Assembly, UserStep, Lifecycle):
    """A training loop that fires events; features are plugins.

    fit, evaluate and predict always close what they open: on a failure EXCEPTION fires, then the
    ENDs still open (with ``payload.error``), then the exception reaches the caller (``lifecycle.py``).

    Args:
        model: the ``torch.nn.Module`` to train.
        optimizer: its optimizer (may be set later, before ``fit``; an optimizer plugin may set it), or several
            by name, ``{"d": opt_d, "g": opt_g}`` (``engine.optimizers``; see ``user_step.py``).
        train_data: an iterable of batches (a DataLoader); required by ``fit``.
        eval_data: an iterable of batches, or a dict of named ones, for ``evaluate``.
        max_epochs: epochs to train; ignored when ``max_steps`` is given.
        max_steps: optimizer steps (windows) to train; wins over ``max_epochs`` as in HF.
        loss_fn: ``loss_fn(prediction, labels)``, e.g. ``nn.CrossEntropyLoss()``; without it the
            model's own loss (``outputs.loss`` / ``outputs[0]``) is used.
        hooks: replacement step functions (see ``trainbus.hooks.Hooks``).
        plugins: plugins to attach, in order.
        device: where batches go; defaults to the model's device.
        label_names: batch keys holding labels.
        trace: record (event, handler) for every handler call in ``engine.bus.trace``.
        step: ``step(engine, batch)`` run per batch instead of forward, loss, backward and optimizer step; it
            steps the optimizers with ``engine.step_optimizer(name, loss)`` (a GAN: ``user_step.py``).

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine, Event
        >>> model = torch.nn.Linear(3, 1)
        >>> data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(5)]
        >>> engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data,
        ...                 max_epochs=2, loss_fn=torch.nn.MSELoss())
        >>> steps = []
        >>> _ = engine.on(Event.STEP_END, lambda ev: steps.append(ev.engine.state.global_step))
        >>> engine.fit().global_step, steps[-1]
        (10, 10)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer] | None = None,
        *,
        train_data: Iterable[Any] | None = None,
        eval_data: Iterable[Any] | Mapping[str, Iterable[Any]] | None = None,
        max_epochs: int | None = None,
        max_steps: int | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        hooks: Hooks | None = None,
        plugins: Sequence[Plugin] = (),
        device: torch.device | str | None = None,
        label_names: Sequence[str] = ("labels",),
        trace: bool = False,
        step: Callable[[Engine, Any], Any] | None = None,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        check_positive_int("max_epochs", max_epochs, allow_none=True)
        check_positive_int("max_steps", max_steps, allow_none=True)
        if hooks is not None and not isinstance(hooks, Hooks):
            raise ConfigError(f"hooks must be a trainbus.hooks.Hooks, got {type(hooks).__name__}")
        self.optimizer = engine_optimizer(optimizer)
        self.step_function = check_step_function(step)
        self._stepped = False
        check_engine_arguments(loss_fn, trace, eval_data, hooks)
        plugins = check_plugins(plugins)
        self.model = model
        self.max_epochs = max_epochs
        self.max_steps = max_steps
        self.label_names = check_label_names(label_names)
        self.train_data = train_data
        self.eval_data = eval_data
        if device is None:
            first = next(itertools.chain(model.parameters(), model.buffers()), None)
            device = first.device if first is not None else torch.device("cpu")
        self._device = check_device(device)
        base = hooks or Hooks()
        if loss_fn is not None:
            base = replace(base, compute_loss=loss_with(loss_fn, self.label_names))
        self._base_hooks = base
        self._wrappers: list[tuple[object, str, HookWrapper]] = []
        self._compose_hooks()
        self.bus = EventBus()
        self.state = State()
        self.control = Control()
        self._accumulation_steps = 1
        #: values plugins publish for the current step (e.g. "grad_norm" as a device tensor);
        #: cleared at every STEP_START, read by loggers at STEP_END / LOG without a host sync
        self.step_outputs: dict[str, Any] = {}
        self.plugins: list[Plugin] = []
        self._open_ends: list[OpenEnd] = []
        self._announced: BaseException | None = None
        self._log_warned = False
        if trace:
            self.bus.enable_trace()
        for plugin in plugins:
            self.add_plugin(plugin)

    # -- configuration -------------------------------------------------------------------------
    @property
    def train_data(self) -> Iterable[Any] | None:
        return self._train_data

    @train_data.setter
    def train_data(self, data: Iterable[Any] | None) -> None:
        if data is not None:
            check_data("train_data", data)
            length = data_length(data)
            if length == 0:
                raise ConfigError("train_data is empty (length 0); it must yield at least one batch")
            if length is None and self.max_steps is None:
                raise ConfigError("train_data has no length (an iterable dataset): set max_steps")
            if self.max_epochs is None and self.max_steps is None:
                raise ConfigError("set max_epochs or max_steps: both are missing, so the run has no end")
        self._train_data = data

    @property
    def has_eval_data(self) -> bool:
        """Whether evaluate() has data, asked without making it (a facade builds its eval loaders lazily)."""
        return self.eval_data is not None

    @property
    def device(self) -> torch.device:
        """Where batches go (the model's device by default)."""
        return self._device

    @device.setter
    def device(self, device: torch.device | str) -> None:
        self._device = check_device(device)
        self._compose_hooks()

    @property
    def state(self) -> State:
        return self._state

    @state.setter
    def state(self, state: State) -> None:
        self._state = state
        self.bus.counts = state.event_counts  # filters count occurrences in the state, so they survive a resume

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (the window size). Set by an accumulation plugin."""
        return self._accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, k: int) -> None:
        check_positive_int("accumulation_steps", k)
        if k > 1 and self.step_function is not None:
            raise ConfigError(f"accumulation_steps={k}: a step function takes one batch per step; accumulate in it "
                              "(backward per part of a larger batch, then engine.step_optimizer(name))")  # fmt: skip
        self._accumulation_steps = k

    @property
    def optimizers(self) -> Mapping[str, Any]:
        """The optimizers by name (``Engine(model, {"d": ..., "g": ...})``); empty for one unnamed optimizer."""
        return self.optimizer.as_mapping() if isinstance(self.optimizer, NamedOptimizers) else {}

    # -- handlers ------------------------------------------------------------------------------
    def on(
        self,
        event: EventType[P] | FilteredEvent[P] | str,
        handler: Callable[[P], None],
        *,
        priority: int | Order = Priority.DEFAULT,
        name: str | None = None,
        cleanup: bool = False,
        before: Targets = (),
        after: Targets = (),
        reads: Targets = (),
        writes: Targets = (),
    ) -> Handle:
        """Register a handler; returns a handle whose ``remove()`` unregisters it.

        ``priority`` is its phase; ``before`` / ``after`` name handlers (or plugins, or ``"*"``) of the
        event it runs before / after inside it; ``reads`` / ``writes`` the payload fields it reads and
        writes (writers run before readers). ``cleanup=True`` (END events): run also when the block
        failed. See ``EventBus.on``.
        """
        return self.bus.on(event, handler, priority=priority, name=name, cleanup=cleanup, before=before, after=after,
                           reads=reads, writes=writes)  # fmt: skip

    # -- firing --------------------------------------------------------------------------------
    def _fire(self, event: EventType[P], make: Callable[[], P]) -> P | None:
        """Count the occurrence; build the payload and dispatch only when someone listens."""
        bus = self.bus
        n = bus.count(event)
        if not bus.has_handlers(event):
            return None
        payload = make()
        bus.dispatch(event, payload, n)
        return payload

    def log(self, logs: dict[str, float]) -> None:
        """Emit a log record (HF ``Trainer.log``): fires LOG with ``window=False``.

        With no LOG handler (no logger attached) the record is not lost: it is kept in
        ``state.log_history`` with its step, as HF's ``Trainer.log`` keeps it, and a warning says so once.
        """
        if self._fire(Event.LOG, lambda: LogEvent(self, logs, False)) is None and logs:
            self.state.log_history.append({**logs, "step": self.state.global_step})
            if not self._log_warned:
                self._log_warned = True
                logger.warning(
                    "engine.log(): no LOG handler is attached, so records are only kept in state.log_history; "
                    "attach a TrainLogger or a sink to write them out"
                )

    def _scheduled_evaluation(self) -> None:
        """The evaluation the flags ask for during training (a facade may route it, as HF's ``_evaluate``)."""
        self.evaluate()

    def _side_effects(self) -> None:
        """Act on the Control flags in the order LOG, EVAL, SAVE; each is reset before it runs."""
        control = self.control
        if control.should_log:
            control.should_log = False
            self._fire(Event.LOG, lambda: LogEvent(self, {}, True))
        if control.should_evaluate:
            control.should_evaluate = False
            self._scheduled_evaluation()
        if control.should_save:
            control.should_save = False
            self._fire(Event.SAVE, lambda: SaveEvent(self))

    # -- fit -----------------------------------------------------------------------------------
    def _plan(self) -> tuple[int, int | None, float]:
        """(max_steps, steps_per_epoch or None, number of epochs or inf)."""
        k = self.accumulation_steps
        n_batches = data_length(self.train_data)
        steps_per_epoch = None if n_batches is None else math.ceil(n_batches / k)
        if self.max_steps is not None:
            return self.max_steps, steps_per_epoch, math.inf
        assert self.max_epochs is not None and steps_per_epoch is not None  # checked by the train_data setter
        return self.max_epochs * steps_per_epoch, steps_per_epoch, self.max_epochs

    def fit(self) -> State:
        """Train until max_steps / max_epochs or a stop request; returns the state.

        Starting from a state with ``global_step > 0`` (a resume) continues where it stopped:
        the epoch ``state.epochs_completed`` from batch ``state.batches_in_epoch``.
        """
        if self.train_data is None:
            raise ConfigError("fit() needs train_data: pass it to the Engine")
        if self.optimizer is None:
            raise ConfigError("fit() needs an optimizer: pass it to the Engine or add an optimizer plugin")
        check_optimizer(self.optimizer)  # it may have been set after construction
        # re-validate: plugins may have changed accumulation or limits since construction
        self.train_data = self.train_data
        self.check_composition()  # names that order nothing, plugins that would do nothing
        state, control, hooks = self.state, self.control, self.hooks
        max_steps, steps_per_epoch, num_epochs = self._plan()
        state.max_steps = max_steps
        state.steps_per_epoch = steps_per_epoch
        state.num_train_epochs = (
            int(num_epochs) if num_epochs != math.inf else math.ceil(max_steps / (steps_per_epoch or max_steps))
        )
        control.should_training_stop = False
        self.model.train()
        hooks.zero_grad(self.optimizer)
        depth = self._open(Event.TRAIN_END, lambda: TrainEndEvent(self))
        try:  # one try per run, none per step: the failure path closes what is open (lifecycle.py)
            self._fire(Event.TRAIN_START, lambda: TrainStartEvent(self))
            self._side_effects()
            run_epoch = self._run_epoch if self.step_function is None else self._run_user_epoch
            while (
                state.epochs_completed < num_epochs
                and state.global_step < max_steps
                and not control.should_training_stop
            ):
                run_epoch(max_steps, steps_per_epoch)
            self._close(depth)
        except BaseException as error:
            self._fail(error, depth, "fit")
            raise
        return state

    def _run_epoch(self, max_steps: int, steps_per_epoch: int | None) -> None:
        """One epoch: windows of micro-batches until the data ends, a stop request or max_steps.

        The window body below is the hot path, written out in this one frame on purpose: every
        Python operation here runs once per step, and a step of a small model is ~200 us. An
        event's payload is only built when the event has handlers (``callers`` is the bus's live
        list of per-event callers, None where nobody listens, so a handler registered mid-run is
        seen at once). The occurrence number filters see comes from counters the loop keeps anyway
        (``global_step + 1`` for the window's step events, ``micro_steps`` for micro-batch events,
        ``optimizer_steps_taken`` for OPTIMIZER_STEP), so nothing is counted per event. Nothing
        here reads a tensor's value: no host sync. The model and optimizer are read once per epoch,
        after EPOCH_START (a handler there may replace them); hooks are read again at any window
        after ``engine.hooks`` changed.
        """
        state, control, bus = self.state, self.control, self.bus
        epoch = state.epochs_completed
        control.should_epoch_stop = False
        depth = self._open(Event.EPOCH_END, lambda: EpochEndEvent(self, epoch))  # closed by fit() on failure
        self._fire(Event.EPOCH_START, lambda: EpochStartEvent(self, epoch))
        model, optimizer = self.model, self.optimizer  # after EPOCH_START: its handlers may replace them
        assert optimizer is not None and self.train_data is not None
        batches = self.hooks.epoch_iterator(self.train_data, epoch, state.batches_in_epoch)
        k = self.accumulation_steps
        # data without a length (an iterable dataset) counts max_steps windows as its epoch, as HF does
        batches_per_epoch = data_length(self.train_data) if steps_per_epoch else max_steps * k
        windows = zip(batches) if k == 1 else _windows(batches, k)  # zip builds the 1-tuples in C
        callers, step_outputs = bus.callers, self.step_outputs
        hooks = None
        exhausted = True
        for window in windows:
            if self.hooks is not hooks:  # first window, or a plugin (re)composed the hooks since the last
                hooks = self.hooks
                forward, compute_loss, backward = hooks.forward, hooks.compute_loss, hooks.backward
                optimizer_step, zero_grad = hooks.optimizer_step, hooks.zero_grad
                move = self._move_batches
            size = len(window)
            step = state.global_step + 1
            if step_outputs:
                step_outputs.clear()
            if call := callers[_STEP_START]:
                call(StepStartEvent(self, window), step)
            first = state.micro_steps + 1  # micro_index = micro_steps - first, computed only for payloads
            stepped = False
            try:
                for batch in window:
                    state.micro_steps += 1
                    if call := callers[_BATCH_START]:
                        started = BatchStartEvent(self, batch, state.micro_steps - first, size)
                        call(started, state.micro_steps)
                        batch = started.batch
                    if move:
                        batch = hooks.to_device(batch, self._device)
                    outputs = forward(model, batch)
                    loss = compute_loss(outputs, batch)
                    if call := callers[_LOSS]:
                        scored = LossEvent(self, batch, outputs, loss, state.micro_steps - first, size)
                        call(scored, state.micro_steps)
                        loss = scored.loss
                        del scored
                    # free this micro-batch's outputs before its backward, as a hand-written
                    # ``loss = model(**batch).loss`` does: an LLM's logits alone can take gigabytes, and
                    # backward needs only the graph. ``loss`` stays until the next micro-batch's replaces it,
                    # as in a loop written by hand: after backward its graph is bare nodes, and holding
                    # them keeps the parameters' AccumulateGrad nodes, which the next forward then
                    # reuses instead of building anew (1% of the instructions of the benchmark MLP's step)
                    del outputs
                    backward(loss)
                    if call := callers[_BACKWARD_END]:
                        call(BackwardEndEvent(self, loss, state.micro_steps - first, size), state.micro_steps)
                vetoed = False
                if call := callers[_BEFORE_OPTIMIZER_STEP]:
                    check = BeforeOptimizerStepEvent(self)
                    call(check, step)
                    vetoed = check.skip
                # the hook returns False when it skipped the step (AMP overflow); None counts as stepped
                if not vetoed and optimizer_step(optimizer) is not False:
                    stepped = True
                    state.optimizer_steps_taken += 1
                    if call := callers[_OPTIMIZER_STEP]:
                        call(OptimizerStepEvent(self), state.optimizer_steps_taken)
            finally:
                zero_grad(optimizer)  # a failed window leaves no half-accumulated gradients behind
            state.global_step = step
            state.epoch_step += 1
            state.batches_in_epoch += size
            if batches_per_epoch:  # as HF: the share of the epoch's micro-batches done (not of its steps)
                state.epoch = epoch + state.batches_in_epoch / batches_per_epoch
            if call := callers[_STEP_END]:
                call(StepEndEvent(self, stepped), step)
            # after the window: act on Control (one attribute tells whether any flag is set)
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

    def _finish_epoch(self, epoch: int, exhausted: bool, steps_per_epoch: int | None, depth: int) -> None:
        """Count the epoch when it ended (its data ran out, an epoch stop, its steps), fire EPOCH_END."""
        state, control = self.state, self.control
        if exhausted and state.batches_in_epoch == 0:
            raise ConfigError(f"train_data yielded no batches in epoch {epoch}")
        finished = (
            exhausted
            or control.should_epoch_stop
            or (steps_per_epoch is not None and state.epoch_step >= steps_per_epoch)
        )
        if finished:
            state.epochs_completed += 1
            state.epoch = float(state.epochs_completed)
            state.batches_in_epoch = 0
            state.epoch_step = 0
        self._close(depth)
        self._side_effects()
