"""HF ``Trainer`` internals that subclasses and copied method bodies touch, over trainbus's engine.

transformers' own example trainers (``QuestionAnsweringTrainer``, ``QuestionAnsweringSeq2SeqTrainer``) and
``training_step`` / ``evaluate`` overrides copied from HF's bodies use more than the public methods:
``self._memory_tracker``, ``self._prepare_inputs``, ``self._move_model_to_device``, ``self.is_in_train``,
``self.current_gradient_accumulation_steps``, ``self.accelerator.backward``, ``self.callback_handler.on_*``,
``self.control``, ``self.compute_metrics = None`` around ``self.evaluation_loop``. This mixin gives each its
HF meaning (docs/hf_surface.md lists them with their tests).

An overridden ``evaluate`` drives the run as in HF: the evaluation the schedule asks for calls it, and
the metrics it returns decide the best checkpoint, early stopping and a plateau schedule. It runs inside
one evaluation of the engine (EVAL_START, the batches of its ``evaluation_loop`` as EVAL_BATCH_END, then
EVAL_END carrying the returned metrics with ``reported=True``: the override logged them and called
``on_evaluate`` itself, so the logger and the callback adapter leave them alone).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainbus.engine import ConfigError, Event
from trainbus.engine.payloads import EvalBatchEndEvent, EvalEndEvent, EvalStartEvent

from ..evaluation.collector import EvalCollector, EvalLoopOutput
from .memory_tracker import MemoryTracker as MemoryTracker  # re-exported: HF's TrainerMemoryTracker (memory_tracker.py)


def _can_return_loss(model: Any) -> bool:
    """transformers' rule (``can_return_loss``): the forward has a ``return_loss`` parameter defaulting to True."""
    try:
        parameter = inspect.signature(model.forward).parameters.get("return_loss")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is True


def is_multi_label(model: Any) -> bool:
    """transformers' rule: label smoothing is off for a model whose config says multi-label classification."""
    return getattr(getattr(model, "config", None), "problem_type", None) == "multi_label_classification"


class LabelSmoother:
    """transformers' ``LabelSmoother`` call (``self.label_smoother(outputs, labels, shift_labels, num_items_in_batch)``)
    for a ``compute_loss`` copied from transformers' body; the loss is trainbus's ``label_smoothed_loss``."""

    def __init__(self, epsilon: float = 0.1, ignore_index: int = -100) -> None:
        self.epsilon, self.ignore_index = epsilon, ignore_index

    def __call__(
        self, model_output: Any, labels: torch.Tensor, shift_labels: bool = False, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        from ..optimization.regularization import label_smoothed_loss

        logits = model_output["logits"] if isinstance(model_output, Mapping) else model_output[0]
        loss = label_smoothed_loss(logits, labels, self.epsilon, self.ignore_index, shift_labels)
        if num_items_in_batch is None:
            return loss
        # transformers divides by the window's items instead of this batch's active labels
        active = labels[..., 1:] if shift_labels else labels
        return loss * active.ne(self.ignore_index).sum() / num_items_in_batch


class TrainerInternals:
    """HF's internal attributes that subclasses use (a mixin of ``Trainer``)."""

    # provided by Trainer / Engine
    args: Any
    model: torch.nn.Module
    optimizer: Any
    hooks: Any
    label_names: Any
    label_names_arg: list[str]
    distributed: Any
    _model_for_columns: Any
    _prediction_loss_only: bool
    _ignore_keys: list[str] | None
    get_plugin: Any
    overrides: Any
    on: Any
    _fire: Any
    _open: Any
    _close: Any
    _fail: Any
    _with: Any
    callback_handler: Any
    _signature_columns: list[str] | None  # TrainerData's (transformers': set by _set_signature_columns_if_needed)
    _set_signature_columns_if_needed: Any

    #: HF attributes a copied body reads; trainbus has no apex, no model parallelism, no hub search backend
    use_apex = False
    is_model_parallel = False
    place_model_on_device = True
    hp_search_backend: Any = None
    _trial: Any = None
    _evaluation_open = False
    is_in_train = False  # HF: True between train()'s entry and exit
    #: the RNG states from before the batch fetched ahead was made (checkpoints keep them: a resume makes it again)
    rng_in_flight: Any = None

    def _set_hf_attributes(self, preprocess_logits_for_metrics: Any) -> None:
        """The attributes a constructed transformers Trainer has, with transformers' values (a copied body reads
        them); where trainbus has no such feature (XLA FSDP, tensor parallel meshes, the Hub) the value is
        transformers' value for "off"."""
        from .loss_protocol import loss_shifts_labels, unwrap_model

        args, model = self.args, unwrap_model(self.model)
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.neftune_noise_alpha = args.neftune_noise_alpha
        smoothing = args.label_smoothing_factor != 0 and not is_multi_label(model)
        if args.label_smoothing_factor != 0 and not smoothing:  # transformers' words, at construction
            warnings.warn(
                "Label smoothing is not compatible with multi-label classification. "
                "Disabling label smoothing for this training run.",
                UserWarning,
                stacklevel=3,
            )
        self.label_smoother = LabelSmoother(args.label_smoothing_factor) if smoothing else None
        self.can_return_loss = _can_return_loss(model)
        self._loss_shifts_labels = loss_shifts_labels(model)  # trainbus's count (GPT-2 included: see loss_protocol)
        self.deepspeed = None  # transformers: the DeepSpeed engine after train() prepared it
        self.hp_name = None
        self.hub_model_id = None
        self._created_lr_scheduler = False
        self._loggers_initialized = False
        self._mixed_mesh_grads = None  # transformers' "not looked at yet"
        self.is_distributed_loading_by_transformers = False
        self.is_tp_enabled = False  # transformers 4.x: tensor parallelism (trainbus has none)
        self.use_cpu_amp = False  # transformers 4.x: CPU autocast is the MixedPrecision plugin's
        self.is_fsdp_xla_enabled = self.is_fsdp_xla_v1_enabled = self.is_fsdp_xla_v2_enabled = False

    @property
    def gather_function(self) -> Any:
        """accelerate's ``gather_for_metrics`` (transformers' evaluation loop gathers through it)."""
        return self.accelerator.gather_for_metrics  # type: ignore[attr-defined]

    def _note_in_flight(self, states: Any) -> None:
        self.rng_in_flight = states

    # -- the eval loaders: made when first needed, as HF makes them in evaluate() ------------------------
    @property
    def eval_data(self) -> Any:
        data = self.__dict__.get("_eval_data")
        dataset = self.__dict__.get("eval_dataset")
        if data is None and dataset is not None:
            data = self.__dict__["_eval_data"] = self._eval_loaders(dataset)  # type: ignore[attr-defined]
        return data

    @eval_data.setter
    def eval_data(self, data: Any) -> None:
        self.__dict__["_eval_data"] = data

    @property
    def has_eval_data(self) -> bool:
        """Whether there is eval data, without making the loaders (HF makes them at the first evaluation)."""
        return self.__dict__.get("_eval_data") is not None or self.__dict__.get("eval_dataset") is not None

    # -- compute_metrics: HF scripts set it to None around an evaluation loop ----------------------
    @property
    def compute_metrics(self) -> Any:
        return self.__dict__.get("_compute_metrics")

    @compute_metrics.setter
    def compute_metrics(self, fn: Any) -> None:
        """``self.compute_metrics = None`` (trainer_qa.py) turns metrics off for the loops that follow, as in HF."""
        self.__dict__["_compute_metrics"] = fn
        collector = self.get_plugin(EvalCollector) if "plugins" in self.__dict__ else None
        if collector is not None:
            collector.compute_metrics = fn

    @property
    def preprocess_logits_for_metrics(self) -> Any:
        return self.__dict__.get("_preprocess_logits_for_metrics")

    @preprocess_logits_for_metrics.setter
    def preprocess_logits_for_metrics(self, fn: Any) -> None:
        """Set after construction, it applies to the evaluations that follow, as in transformers."""
        self.__dict__["_preprocess_logits_for_metrics"] = fn
        if "_given" in self.__dict__:  # the plugins built again after args change take it too
            self.__dict__["_given"] = (self.__dict__["_given"][0], fn)
        collector = self.get_plugin(EvalCollector) if "plugins" in self.__dict__ else None
        if collector is not None:
            collector.preprocess_logits_for_metrics = fn

    # -- inputs and devices ------------------------------------------------------------------------
    def _prepare_input(self, data: Any) -> Any:
        """A tensor (or nested dict / list / tuple of them) on ``args.device`` (HF)."""
        if isinstance(data, Mapping):
            return type(data)({k: self._prepare_input(v) for k, v in data.items()})
        if isinstance(data, tuple | list):
            return type(data)(self._prepare_input(v) for v in data)
        if isinstance(data, torch.Tensor):
            return data.to(device=self.args.device)
        return data

    def _prepare_inputs(self, inputs: Any) -> Any:
        """The batch on the device; an empty one is a ValueError naming the columns the model takes (HF)."""
        inputs = self._prepare_input(inputs)
        if len(inputs) == 0:
            self._set_signature_columns_if_needed()
            raise ValueError(
                "The batch received was empty, your model won't be able to train on it. Double-check that your "
                f"training dataset contains keys expected by the model: {','.join(self._signature_columns or [])}."
            )
        return inputs

    def _move_model_to_device(self, model: torch.nn.Module, device: Any) -> None:
        """Move ``model`` to ``device`` unless it is spread over several devices already (HF)."""
        if getattr(model, "hf_device_map", None) is not None:
            return
        model.to(device)

    def _prepare_context_parallel_inputs(self, model: torch.nn.Module, inputs: Any) -> tuple[Callable[[], Any], Any]:
        """No context parallelism in trainbus: an empty context and the inputs as they are (HF's shape)."""
        return contextlib.nullcontext, inputs

    @property
    def is_deepspeed_enabled(self) -> bool:
        return getattr(self.args, "deepspeed_plugin", None) is not None

    @property
    def is_fsdp_enabled(self) -> bool:
        return getattr(self.args, "fsdp_plugin_args", None) is not None

    def _get_learning_rate(self) -> float:
        """The learning rate of the first parameter group (HF's, for logging and LOMO)."""
        if self.optimizer is None:
            raise ConfigError("the Trainer has no optimizer yet: call create_optimizer() or train() first")
        return float(self.optimizer.param_groups[0]["lr"])

    def _backward_through_hooks(self, accelerator: Any) -> Any:
        """``accelerator.backward(loss)`` in a copied ``training_step`` goes through trainbus's backward hook,
        so mixed precision's scaler and the other plugins see it (one process; several processes use
        accelerate's own, which the Distributed plugin prepared)."""
        hooks_owner = self

        def backward(loss: torch.Tensor, **kwargs: Any) -> None:
            hooks_owner.hooks.backward(loss)

        accelerator.backward = backward
        return accelerator

    # -- an overridden evaluate() is one evaluation of the engine -------------------------------------
    def _install_evaluate_override(self) -> None:
        owner = next(k for k in type(self).__mro__ if "evaluate" in vars(k))
        loop_owner = next(k for k in type(self).__mro__ if "evaluation_loop" in vars(k))
        # Trainer's or Seq2SeqTrainer's own evaluate and loop: the engine's evaluation as it is. A subclass's
        # evaluation_loop alone: trainbus's evaluate runs transformers' body, which calls the loop
        if all(k.__module__.startswith("trainbus.plugins.facade.") for k in (owner, loop_owner)):
            return
        override = type(self).evaluate.__get__(self)  # type: ignore[attr-defined]

        @functools.wraps(override)
        def evaluate(*args: Any, **kwargs: Any) -> Any:
            if self._evaluation_open:  # the override calls itself, or evaluate() within: one evaluation
                return override(*args, **kwargs)
            prefix = kwargs.get("metric_key_prefix", "eval")
            return self._one_evaluation(str(prefix), lambda: override(*args, **kwargs))

        self.evaluate = evaluate  # the schedule (engine) and the script both call it through here

    def _evaluate(
        self, trial: Any = None, ignore_keys_for_eval: list[str] | None = None, skip_scheduler: bool = False
    ) -> Any:
        """HF's scheduled evaluation: ``evaluate()``, its metrics returned (a plateau schedule steps on them in the
        LRScheduler plugin at EVAL_END)."""
        return self.evaluate(ignore_keys=ignore_keys_for_eval)  # type: ignore[attr-defined]

    def _scheduled_evaluation(self, trial: Any = None, ignore_keys_for_eval: list[str] | None = None) -> None:
        """Every evaluation the schedule asks for goes through ``self._evaluate`` when a subclass overrides it or a
        test patches it on the instance (transformers' own tests do): the metrics it returns decide the best
        checkpoint, save_strategy="best" and early stopping. (The arguments: a ``_maybe_log_save_evaluate``'s.)"""
        patched = "_evaluate" in self.__dict__ or type(self)._evaluate is not TrainerInternals._evaluate
        if not patched:
            keys = {} if ignore_keys_for_eval is None else {"ignore_keys": ignore_keys_for_eval}
            self.evaluate(**keys)  # type: ignore[attr-defined]
            return
        self._one_evaluation("eval", lambda: self._evaluate(trial, ignore_keys_for_eval))

    def _one_evaluation(self, prefix: str, body: Callable[[], Any]) -> Any:
        """EVAL_START, ``body()`` (its loops fire the batches), EVAL_END with the metrics ``body`` returned."""
        engine: Any = self
        result: dict[str, Any] = {}
        self._evaluation_open = True
        depth = self._open(Event.EVAL_END, lambda: EvalEndEvent(engine, dict(result), prefix, reported=True))
        try:
            # the override makes its own loader (get_eval_dataloader): none is made here for the payload
            self._fire(Event.EVAL_START, lambda: EvalStartEvent(engine, None, prefix))
            metrics = body()
            if isinstance(metrics, Mapping):
                result.update(metrics)
            self._evaluation_open = False
            self._close(depth)
        except BaseException as error:
            self._evaluation_open = False
            self._fail(error, depth, "evaluate")
            raise
        return metrics

    def _loop_in_evaluation(
        self, dataloader: Any, loss_only: bool, ignore_keys: list[str] | None, prefix: str
    ) -> EvalLoopOutput:
        """HF's evaluation_loop inside an open evaluation: the batches fire EVAL_BATCH_END, and the collector
        gives this loop's predictions and ``{prefix}_*`` metrics (no EVAL_END: the evaluation is still open)."""
        engine: Any = self
        collector = self.get_plugin(EvalCollector)
        hooks, model = self.hooks, self.model
        data = hooks.eval_data(dataloader)
        was_training = model.training
        model.eval()
        collector.start_pass(data, prefix)
        try:

            def run() -> None:
                with torch.inference_mode():
                    for batch in data:
                        batch = hooks.to_device(batch, engine.device)
                        loss, logits, labels = hooks.prediction_step(
                            model, batch, hooks.forward, hooks.compute_loss, self.label_names
                        )
                        self._fire(
                            Event.EVAL_BATCH_END,
                            lambda: EvalBatchEndEvent(engine, batch, loss, logits, labels, prefix),
                        )

            self._with(loss_only, ignore_keys, run)
            return collector.finish_pass(engine)  # type: ignore[no-any-return]
        finally:
            model.train(was_training)

    def _evaluate_as_hf(
        self, eval_dataset: Any, ignore_keys: list[str] | None, metric_key_prefix: str
    ) -> dict[str, Any]:
        """HF's evaluate() body, inside an evaluation a subclass's override opened (``super().evaluate()``):
        the loop, the speed metrics, ``self.log`` and ``on_evaluate``; the metrics are returned."""
        trainer: Any = self
        if isinstance(eval_dataset, Mapping):
            merged: dict[str, Any] = {}
            for name, subset in eval_dataset.items():
                merged.update(self._evaluate_as_hf(subset, ignore_keys, f"{metric_key_prefix}_{name}"))
            return merged
        if eval_dataset is None and isinstance(trainer.eval_dataset, Mapping):
            return self._evaluate_as_hf(trainer.eval_dataset, ignore_keys, metric_key_prefix)
        loader = trainer.get_eval_dataloader(eval_dataset)
        start = time.time()
        output = trainer.evaluation_loop(
            loader,
            description="Evaluation",
            prediction_loss_only=True if self.compute_metrics is None else None,
            ignore_keys=ignore_keys,
            metric_key_prefix=metric_key_prefix,
        )
        self._add_speed_metrics(output, metric_key_prefix, start)
        trainer.log(output.metrics)
        trainer.control = self.callback_handler.on_evaluate(self.args, trainer.state, trainer.control, output.metrics)
        return dict(output.metrics)

    def _predict_as_hf(self, loader: Any, ignore_keys: list[str] | None, metric_key_prefix: str) -> Any:
        """HF's predict() body, for a subclass's ``evaluation_loop``: the loop, the speed metrics, on_predict."""
        from ..evaluation.collector import PredictionOutput

        trainer: Any = self
        start = time.time()
        output = trainer.evaluation_loop(
            loader, description="Prediction", ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix
        )
        self._add_speed_metrics(output, metric_key_prefix, start)
        trainer.control = self.callback_handler.on_predict(self.args, trainer.state, trainer.control, output.metrics)
        return PredictionOutput(output.predictions, output.label_ids, output.metrics)

    def _add_speed_metrics(self, output: EvalLoopOutput, metric_key_prefix: str, start: float) -> None:
        """HF's ``{prefix}_runtime`` / ``_samples_per_second`` / ``_steps_per_second`` for one loop."""
        runtime = time.time() - start
        steps = math.ceil(output.num_samples / max(self.args.eval_batch_size * self.args.world_size, 1))
        output.metrics.update(
            {
                f"{metric_key_prefix}_runtime": round(runtime, 4),
                f"{metric_key_prefix}_samples_per_second": round(output.num_samples / runtime, 3) if runtime else 0.0,
                f"{metric_key_prefix}_steps_per_second": round(steps / runtime, 3) if runtime else 0.0,
            }
        )
