"""The step hooks of the ``Trainer``: HF's overridable ``compute_loss`` / ``training_step`` /
``prediction_step`` and how the engine's step goes through them.

A mixin of ``Trainer``. ``_install_step_hooks`` sets the engine's ``forward`` / ``compute_loss`` /
``backward`` / ``prediction_step`` hooks so that a subclass's overrides run where HF runs them, and
routes a logging point's record through an overridden ``log``. ``num_items_in_batch`` (the items of
the step's whole accumulation window) comes from ``engine.step_outputs``, where the accumulation
plugin publishes it at STEP_START.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from trainbus.engine import Event, LogEvent, Priority, StepStartEvent
from trainbus.hooks import forward as default_forward
from trainbus.hooks import get_labels, to_device

from ..data.batch_samples import WindowsFromBatchSamples
from ..distributed.processes import all_reduce_sum, collective_device, world_size
from ..evaluation.collector import hf_prediction_step
from ..optimization.accumulation import GradientAccumulation
from .composition import Computed as _Computed
from .loss_protocol import counted_by_transformers, divides_by_items
from .trainer_checks import compute_loss as trainer_compute_loss
from .trainer_checks import loss_from_outputs


class TrainerStepHooks:
    """HF's step methods and the engine hooks that call them (a mixin of ``Trainer``)."""

    #: HF: whether compute_loss's loss is already normalised over the accumulation window (None: only
    #: when a compute_loss_func made it from num_items_in_batch); a subclass with its own loss may set it
    loss_is_scaled_for_ga: bool | None = None
    #: whether this window's loss comes back divided by num_items_in_batch (``_window_protocol``)
    _window_scaled = False
    #: the measured answer of this run's model (``loss_protocol.divides_by_items``); None: not measured yet
    _model_divides: bool | None = None

    # provided by Trainer / Engine
    args: Any
    model: torch.nn.Module
    hooks: Any
    label_names: Any
    step_outputs: dict[str, Any]
    compute_loss_func: Any
    model_accepts_loss_kwargs: bool
    _count_items: Any
    _prediction_loss_only: bool
    _ignore_keys: list[str] | None
    overrides: Any
    set_hook: Any
    on: Any
    log: Any
    current_gradient_accumulation_steps: int

    def _install_step_hooks(self) -> None:
        self.set_hook("compute_loss", trainer_compute_loss)  # its no-loss error speaks to a Trainer user
        if self.overrides("training_step"):
            # HF divides the loss by the window being trained (the last of an epoch may be shorter)
            self.on(Event.STEP_START, self._window_started, name="Trainer.current_gradient_accumulation_steps")
            self.set_hook("forward", self._forward_training_step)
            self.set_hook("compute_loss", lambda outputs, batch: outputs.loss)
            base_backward = self.hooks.backward
            self.set_hook("backward", lambda loss: base_backward(loss) if loss.requires_grad else None)
        elif self.overrides("compute_loss") or self.compute_loss_func is not None:
            self.set_hook("forward", self._forward_compute_loss)
            self.set_hook("compute_loss", lambda outputs, batch: outputs.loss)
        elif self.model_accepts_loss_kwargs:
            self.set_hook("forward", self._forward_with_loss_kwargs)
        self.set_hook("prediction_step", self._prediction_step_hook)
        if self.overrides("_prepare_inputs") or self.overrides("_prepare_input"):
            # HF moves each training and evaluation batch with self._prepare_inputs (training_step, prediction_step)
            self.set_hook("to_device", lambda batch, device: self._prepare_inputs(batch))
        if self.overrides("compute_loss_context_manager") or self.overrides("autocast_smart_context_manager"):
            # HF runs each micro-batch's compute_loss, and each evaluation batch's forward, in this context
            self.wrap_hook("forward", self._in_loss_context)  # type: ignore[attr-defined]
        # before GradientAccumulation weighs the window (PRODUCER): whether its loss comes back normalised
        self.on(Event.TRAIN_START, self._plan_protocol, name="Trainer.loss_protocol")
        if self.overrides("get_batch_samples"):
            # outside the one-batch-ahead reader _compose adds: wrapped when training starts, once
            self.on(Event.TRAIN_START, self._windows_from_batch_samples, name="Trainer.get_batch_samples")
        if any(self.overrides(n) for n in ("training_step", "_get_num_items_in_batch", "get_batch_samples")):
            self.on(Event.STEP_START, self._publish_window_items, name="Trainer._get_num_items_in_batch")
        if self.overrides("log"):
            # after TrainLogger filled a logging point's record, before history and sinks read it
            self.on(Event.LOG, self._log_through_override, priority=Priority.PRODUCER.after("*"), name="Trainer.log")

    _window_handle: Any = None
    _accumulation: Any = None  # this run's GradientAccumulation plugin, found once per run (_plan_protocol)

    def _plan_protocol(self, ev: Any) -> None:
        """Each run: whether a window's loss may come back normalised, so that its weighing depends on it.
        Only then does a handler look at every window (an accumulation plugin's, or a training_step
        override's, of a model taking loss kwargs); the default run pays nothing per step."""
        self._model_divides = None  # measured again: train() may have a new model (model_init)
        self._window_scaled = False
        self._accumulation = accumulation = self.get_plugin(GradientAccumulation)  # type: ignore[attr-defined]
        weighs = accumulation is not None or self.overrides("training_step")
        needed = weighs and self.model_accepts_loss_kwargs and self.loss_is_scaled_for_ga is None
        if needed and self.compute_loss_func is None and self._window_handle is None:
            name = "Trainer.loss_protocol_window"
            self._window_handle = self.on(Event.STEP_START, self._window_protocol, priority=Priority.FIRST, name=name)
        elif not needed and self._window_handle is not None:
            self._window_handle.remove()
            self._window_handle = None
        if accumulation is not None:  # it asked _loss_is_scaled_for_ga already, maybe before this reset
            accumulation.prescaled = self._loss_is_scaled_for_ga()

    def _window_protocol(self, ev: StepStartEvent) -> None:
        """Whether this window's loss comes back divided by ``num_items_in_batch``: transformers' rule (the
        model takes loss kwargs and transformers counts the window's labels), with the model's division
        measured once per run (``divides_by_items``) where transformers assumes it. The accumulation plugin
        then weighs the micro-batches' losses unless they are normalised already."""
        if self.loss_is_scaled_for_ga is not None or self.compute_loss_func is not None:
            return  # declared by the subclass, or a compute_loss_func divides (HF)
        first = ev.batches[0]
        scaled = bool(self.model_accepts_loss_kwargs) and counted_by_transformers(first)
        accumulation = self._accumulation  # per step: no lookup over the plugins
        weighs = accumulation is not None or (self.overrides("training_step") and len(ev.batches) > 1)
        if scaled and weighs:
            if self._model_divides is None:
                measured = None
                for batch in ev.batches:  # the first micro-batch with items tells
                    moved = to_device(batch, self.device)  # not a _prepare_inputs override: no extra call
                    measured = divides_by_items(self.model, moved, self._count_items(moved))
                    if measured is not None:
                        break
                self._model_divides = True if measured is None else measured  # unmeasurable: HF's assumption
            scaled = self._model_divides
        self._window_scaled = scaled
        if accumulation is not None:
            accumulation.prescaled = scaled

    _batch_samples: WindowsFromBatchSamples | None = None

    def _windows_from_batch_samples(self, ev: Any) -> None:
        if self._batch_samples is None:
            self._batch_samples = WindowsFromBatchSamples(self, self.get_batch_samples)
            self.wrap_hook("epoch_iterator", self._batch_samples)  # type: ignore[attr-defined]
        self._batch_samples.items.clear()

    def _publish_window_items(self, ev: StepStartEvent) -> None:
        """``num_items_in_batch`` from ``get_batch_samples`` / ``_get_num_items_in_batch`` (a subclass's override),
        after the accumulation plugin published its count; with a training_step override (no plugin counts the
        window), HF's count."""
        if self._batch_samples is not None:  # the count get_batch_samples returned with this window's batches
            self.step_outputs["num_items_in_batch"] = self._batch_samples.take()
        elif self.overrides("_get_num_items_in_batch") or self.get_plugin(GradientAccumulation) is None:  # type: ignore[attr-defined]
            self.step_outputs["num_items_in_batch"] = self._get_num_items_in_batch(list(ev.batches), self.device)

    def get_batch_samples(self, epoch_iterator: Iterator[Any], num_batches: int, device: Any = None) -> Any:
        """HF's: up to ``num_batches`` batches from ``epoch_iterator`` and their ``_get_num_items_in_batch``."""
        batches = list(itertools.islice(epoch_iterator, num_batches))
        return batches, self._get_num_items_in_batch(batches, device)

    def _get_num_items_in_batch(self, batch_samples: list[Any], device: Any) -> Any:
        """HF's: the items of a window's batches (what the model's loss averages over, labels not -100), or
        None where transformers counts nothing (no ``labels`` tensor; a model without loss kwargs and no
        compute_loss_func). Summed over the processes with ``average_tokens_across_devices``."""
        if not batch_samples or not counted_by_transformers(batch_samples[0]):
            return None
        if not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            return None
        counts = [self._count_items(batch) for batch in batch_samples]
        items = torch.as_tensor(sum(counts[1:], counts[0]))
        if world_size() > 1 and self.args.average_tokens_across_devices:
            items = all_reduce_sum(items.to(collective_device()))
        return items.to(device) if device is not None else items

    def _in_loss_context(self, forward: Any) -> Any:
        def forward_in_context(model: torch.nn.Module, batch: Any) -> Any:
            with self.compute_loss_context_manager():  # type: ignore[attr-defined]
                return forward(model, batch)

        return forward_in_context

    _eval_num_items: Any = None
    _eval_wants_loss = False

    def _eval_counts_items(self) -> bool:
        """Whether an evaluation batch's count reaches user code (else it would only cost a kernel per batch)."""
        return (
            self.overrides("_get_num_items_in_batch")
            or self.overrides("compute_loss")
            or self.compute_loss_func is not None
        )

    def _window_started(self, ev: StepStartEvent) -> None:
        self.current_gradient_accumulation_steps = len(ev.batches)

    def _log_through_override(self, ev: LogEvent) -> None:
        """A logging point's record goes through the subclass's ``log`` (HF calls ``self.log(logs, start_time)``)."""
        if not ev.window or not ev.logs:
            return
        logs = {k: v for k, v in ev.logs.items() if k not in ("epoch", "num_input_tokens_seen")}  # log() adds them
        ev.logs.clear()  # this payload is dropped; self.log fires the record anew
        self.log(logs, None)

    def _forward_compute_loss(self, model: torch.nn.Module, batch: Any) -> Any:
        if not model.training and get_labels(batch, tuple(self.label_names)) is None and not self._eval_wants_loss:
            return default_forward(model, batch)  # HF's prediction_step: no labels, no compute_loss
        items = self._num_items_in_batch(batch) if model.training else self._eval_num_items
        result = self.compute_loss(model, batch, return_outputs=True, num_items_in_batch=items)
        loss, outputs = result if isinstance(result, tuple) else (result, None)
        return _Computed(loss, outputs)

    def _forward_with_loss_kwargs(self, model: torch.nn.Module, batch: Any) -> Any:
        """HF's call: a training forward with labels also gets ``num_items_in_batch`` (the window's items; in
        evaluation the batch's, where ``_get_num_items_in_batch`` counted it for user code).

        Passed where the accumulation plugin counted the window (on the host, before the batch moved):
        a window of one micro-batch in one process needs no count, the model's own mean is that loss,
        and counting the batch here would add kernels on its device to every step.
        """
        items = self.step_outputs.get("num_items_in_batch") if model.training else self._eval_num_items
        if items is not None and counted_by_transformers(batch):
            return model(**batch, num_items_in_batch=items)
        return default_forward(model, batch)

    def _num_items_in_batch(self, batch: Any) -> Any:
        """HF's ``num_items_in_batch``: the items (labels not -100) of this step's whole accumulation window.

        The accumulation plugin counts them once per window (across processes with
        average_tokens_across_devices) into ``step_outputs``; without one, the items of this batch.
        None where transformers counts nothing: no ``labels`` tensor, or a model without loss kwargs
        and no compute_loss_func (``_get_num_items_in_batch``).
        """
        if not counted_by_transformers(batch) or not (self.model_accepts_loss_kwargs or self.compute_loss_func):
            return None
        if "num_items_in_batch" in self.step_outputs:  # the window's, published at STEP_START
            return self.step_outputs["num_items_in_batch"]
        return self._count_items(batch)

    def _loss_is_scaled_for_ga(self) -> bool:
        """Whether the loss is already normalised over the window (HF's ``loss_is_scaled_for_ga``).

        It is when a compute_loss_func made it (with num_items_in_batch), or when the model is passed
        ``num_items_in_batch`` and divides by it (``_window_protocol`` measures, each run). Unlike HF, a
        ``**kwargs`` forward that ignores the count (BERT's heads, T5) returns its own mean, which
        accumulation still weights.
        """
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        if self.compute_loss_func is not None:
            return True
        return self._window_scaled

    def _forward_training_step(self, model: torch.nn.Module, batch: Any) -> Any:
        if model.training and torch.is_grad_enabled():
            return _Computed(self.training_step(model, batch, self._num_items_in_batch(batch)), None)
        if self.overrides("compute_loss") or self.compute_loss_func is not None:
            return self._forward_compute_loss(model, batch)
        return _Computed(*TrainerStepHooks.compute_loss(self, model, batch, return_outputs=True))

    def _prediction_step_hook(
        self, model: torch.nn.Module, batch: Any, forward: Any, compute_loss: Any, label_names: Any
    ) -> tuple[Any, Any, Any]:
        return self.prediction_step(model, batch, self._prediction_loss_only, self._ignore_keys)

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: Any,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """The model's loss (or ``compute_loss_func(outputs, labels, num_items_in_batch=...)``)."""
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None and isinstance(inputs, Mapping):
            inputs = {**inputs, "num_items_in_batch": num_items_in_batch}  # HF: the model normalises by it
        if self.compute_loss_func is None:
            outputs = default_forward(model, inputs)
            loss = loss_from_outputs(outputs, inputs)
        else:
            labels = get_labels(inputs, tuple(self.label_names))
            if isinstance(inputs, Mapping):
                inputs = {k: v for k, v in inputs.items() if k not in self.label_names}
            outputs = default_forward(model, inputs)
            loss = self.compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """Forward, loss divided by the accumulation steps, backward; returns the detached loss (HF)."""
        model.train()
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if isinstance(loss, tuple):
            loss = loss[0]
        if not self._loss_is_scaled_for_ga():
            loss = loss / self.current_gradient_accumulation_steps
        self.hooks.backward(loss)
        return loss.detach()

    def prediction_step(
        self, model: torch.nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[Any, Any, Any]:
        """(loss, logits, labels) for one batch; logits are every model output but the loss (HF)."""
        computed: dict[str, Any] = {}
        names = tuple(self.label_names)
        has_labels = bool(names) and isinstance(inputs, Mapping) and all(inputs.get(k) is not None for k in names)
        asked = inputs.get("return_loss") if isinstance(inputs, Mapping) else None
        self._eval_wants_loss = not names and bool(getattr(self, "can_return_loss", False) if asked is None else asked)
        self._eval_num_items = None
        if (has_labels or self._eval_wants_loss) and self._eval_counts_items():
            # HF counts the batch's items and hands them to compute_loss (a subclass's count, a compute_loss_func)
            self._eval_num_items = self._get_num_items_in_batch([inputs], self.device)

        def forward(m: torch.nn.Module, b: Any) -> Any:
            out = self.hooks.forward(m, b)
            if isinstance(out, _Computed):
                computed["loss"] = out.loss
                return out.outputs
            return out

        def loss_of(out: Any, b: Any) -> Any:
            return computed["loss"] if "loss" in computed else self.hooks.compute_loss(out, b)

        step = hf_prediction_step(ignore_keys, bool(getattr(self, "can_return_loss", False)))
        loss, logits, labels = step(model, inputs, forward, loss_of, self.label_names)
        if loss is not None:
            loss = loss.detach().mean()
        return (loss, None, None) if prediction_loss_only else (loss, logits, labels)
