"""The Hugging Face style facade: ``Trainer`` is an Engine composed of the standard plugins from TrainingArguments.

Porting a script means changing the import::

    from trainbus.plugins import Trainer, TrainingArguments

Subclass overrides of transformers' methods are honoured where HF calls them (``hf_names.py`` lists them).

The methods live with their ideas, as mixins: the step hooks and HF's step methods (``step_hooks.py``),
``_maybe_log_save_evaluate`` (``log_save_evaluate.py``), ``_clip_grad_norm`` (``grad_norm.py``), the dataloaders
(``dataloaders.py``), the optimizer and scheduler (``optimizer_setup.py``), the script helpers (``utilities.py``),
the process side (``trainer_processes.py``); ``save_model`` is ``saving.py``, the plugins are ``composition.py``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainbus.engine import ConfigError, Engine, Plugin, State

from ..checkpoints import checkpoint as ckpt
from ..checkpoints.resuming import resume_after_restart
from ..data.loading import (
    DataCollatorWithPadding,
    default_data_collator,
    fetch_one_ahead,
)
from ..distributed.batch_size import train_with_executable_batch_size
from ..evaluation.collector import PredictionOutput
from ..observability.flos import FloCounter
from ..observability.memory import MemoryMetrics
from ..optimization.schedulers import LRScheduler
from .arguments import TrainingArguments
from .callbacks import CallbackAdapter
from .checkpoint_methods import TrainerCheckpointing
from .composition import (
    TrainOutput,
    args_snapshot,
    build_plugins,
    check_metric_for_best_model,
    check_train_dataset,
    distributed_plugin,
    flo_counter,
    set_seed,
)
from .dataloaders import TrainerData, pads_batches
from .grad_norm import TrainerGradNorm
from .hf_names import REFUSED, check_overrides, check_sharded_overrides, refusing_method
from .log_save_evaluate import TrainerLogSaveEvaluate
from .loss_protocol import accepts_loss_kwargs, default_label_names, item_counter
from .model_card import write_model_card
from .model_folder import align_special_tokens, applies_use_cache
from .optimizer_setup import TrainerOptimizers
from .saving import save_model as save_final_model
from .search import hyperparameter_search as _hyperparameter_search
from .step_hooks import TrainerStepHooks
from .subclass_state import TrainerScriptState
from .subclass_surface import MemoryTracker, TrainerInternals
from .trainer_checks import check_eval_set, check_model, check_train_kwargs, check_trainer_arguments, model_from_init
from .trainer_processes import TrainerProcesses
from .utilities import FlosThroughTrainer, TrainerUtilities, log_training_plan


class Trainer(
    TrainerScriptState,
    TrainerProcesses,
    TrainerCheckpointing,
    TrainerInternals,
    TrainerStepHooks,
    TrainerLogSaveEvaluate,
    TrainerGradNorm,
    TrainerData,
    TrainerOptimizers,
    TrainerUtilities,
    Engine,
):
    """HF's ``Trainer`` API over a trainbus Engine; every feature is a plugin chosen from ``args``.

    Args mirror ``transformers.Trainer``. ``callbacks`` may mix HF-style callbacks (instances or
    classes) and trainbus plugins. ``optimizers=(optimizer, scheduler)`` replaces the built ones.
    ``plugins`` are trainbus plugins attached after the ones built from ``args`` (``add_plugin`` each).

    Example:
        >>> import torch
        >>> from trainbus.plugins.facade.trainer import Trainer
        >>> from trainbus.plugins.facade.arguments import TrainingArguments
        >>> class Reg(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__(); self.lin = torch.nn.Linear(2, 1)
        ...     def forward(self, x, labels=None):
        ...         out = self.lin(x).squeeze(-1)
        ...         return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}
        >>> data = [{"x": torch.randn(2), "labels": torch.tensor(1.0)} for _ in range(8)]
        >>> args = TrainingArguments("/tmp/tb_doc", max_steps=3, save_strategy="no", disable_tqdm=True,
        ...                          logging_steps=1, report_to="none", use_cpu=True)
        >>> Trainer(Reg(), args, train_dataset=data).train().global_step  # doctest: +ELLIPSIS
        {...
        3
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable[[], torch.nn.Module] | None = None,
        compute_loss_func: Callable[..., torch.Tensor] | None = None,
        compute_metrics: Callable[[Any], dict[str, float]] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
        plugins: list[Plugin] | None = None,
    ) -> None:
        check_overrides(type(self))  # an override trainbus would never call is an error now, not silence
        self.args = args if args is not None else TrainingArguments()
        if not isinstance(self.args, TrainingArguments):
            raise ConfigError(f"args must be trainbus TrainingArguments, got {type(self.args).__name__}")
        args = self.args
        check_sharded_overrides(type(self), args)
        check_trainer_arguments(model, model_init, optimizers, optimizer_cls_and_kwargs, data_collator)  # HF's types
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.flo_counter = (FlosThroughTrainer if self.overrides("store_flos") else FloCounter)(self.floating_point_ops)
        self.memory_metrics = None if args.skip_memory_metrics else MemoryMetrics()
        self._memory_tracker = MemoryTracker(self.memory_metrics)  # HF's, for subclasses copying its bodies
        self._memory_tracker.start()  # HF measures the constructor as the "init" stage
        model = self._prepare_model(model, model_init)
        self.processing_class = processing_class
        self.compute_loss_func = compute_loss_func
        self.compute_metrics = compute_metrics
        self._set_data(train_dataset, eval_dataset, data_collator)
        # several processes: made before the train loader, so the plan below counts global batches
        self.distributed = distributed_plugin(args)
        self._train_batch_size = args.train_batch_size  # auto_find_batch_size may lower it
        max_epochs, max_steps = self._plan_length(None)
        super().__init__(
            model, optimizers[0], train_data=None, max_epochs=max_epochs, max_steps=max_steps, device=args.device,
            label_names=self.label_names_arg,
        )  # fmt: skip
        self.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # HF: the window being trained
        self._prediction_loss_only, self._ignore_keys = args.prediction_loss_only, None
        self._install_step_hooks()
        self._install_evaluate_override()  # a subclass's evaluate() is what the schedule runs (HF)
        self._given = (optimizers[1], preprocess_logits_for_metrics)  # what composing again reuses
        self._set_hf_attributes(preprocess_logits_for_metrics)
        self._compose(callbacks or [], plugins or [])
        self._memory_tracker.stop_and_update_metrics()
        self.callback_handler.init_end(self)

    # -- composition helpers ----------------------------------------------------------------------
    def _set_data(self, train_dataset: Any, eval_dataset: Any, data_collator: Callable[..., Any] | None) -> None:
        """The datasets and the collator (HF's default for the processing class), both sets checked now."""
        args, processing_class = self.args, self.processing_class
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.data_collator = data_collator or (
            DataCollatorWithPadding(processing_class) if pads_batches(processing_class) else default_data_collator
        )
        if args.eval_strategy != "no" and eval_dataset is None:
            raise ConfigError(f"eval_strategy={args.eval_strategy.value!r} needs an eval_dataset; none was given")
        check_train_dataset(train_dataset, args.max_steps)  # the loader itself is made by train(), as in HF
        check_eval_set(eval_dataset)  # an empty one fails now, not at the first evaluation

    def _prepare_model(self, model: torch.nn.Module | None, model_init: Callable[..., Any] | None) -> torch.nn.Module:
        """Log level, seeds, the model (from ``model_init`` if none), checked and on the device (HF's order),
        and what the facade reads from it: label names, loss kwargs, the items its loss averages over."""
        args = self.args
        args.apply_log_level()  # HF: log_level / _replica, on trainbus's logger and transformers'
        set_seed(args.seed)
        if args.full_determinism:
            torch.use_deterministic_algorithms(True)
        if model is None:  # HF's call_model_init: a 1-argument one gets the trial (hyperparameter_search's)
            model = model_from_init(model_init, self._trial)  # type: ignore[arg-type]
        self.model_init = model_init
        check_model(model)
        model = model.to(args.device)
        if getattr(model, "config", None) is not None and applies_use_cache():
            model.config.use_cache = args.use_cache  # as HF 5: no KV cache in training / evaluation outputs
        # transformers' rule: find_labels of the model's class unless label_names is given ([] honoured as empty)
        self.label_names_arg = list(args.label_names) if args.label_names is not None else default_label_names(model)
        self._model_for_columns = model
        #: HF's: the forward takes loss kwargs, so training passes it ``num_items_in_batch``
        self.model_accepts_loss_kwargs = accepts_loss_kwargs(model)
        self._count_items = item_counter(model, self.label_names_arg)  # what the model's loss averages over
        return model

    def _compose(self, callbacks: list[Any], plugins: list[Plugin]) -> None:
        """Attach the plugins built from args, the plugins among the callbacks, ``plugins``, the HF callbacks."""
        args = self.args
        hf_callbacks = [cb for cb in callbacks if not _is_plugin(cb)]
        self.callback_handler = CallbackAdapter(hf_callbacks, args, self.processing_class)
        self.callback_handler.insert_defaults(bool(args.disable_tqdm))  # stand-ins for FlowControl and progress
        self._built_plugins = build_plugins(self, args, *self._given)
        for plugin in self._built_plugins:
            self.add_plugin(plugin)
        for cb in callbacks:
            if _is_plugin(cb):
                self.add_plugin(cb() if isinstance(cb, type) else cb)
        for plugin in plugins:
            self.add_plugin(plugin)
        # a trainbus plugin among the callbacks may add eval metrics: then only the first evaluation knows
        self.metric_plugins_added = any(_is_plugin(cb) for cb in callbacks) or bool(plugins)
        if args.metric_for_best_model is not None and self.eval_dataset is not None:
            check_metric_for_best_model(self, args.metric_for_best_model)
        self.add_plugin(self.callback_handler)
        # as accelerate's loader under HF: batch i+1 is made before step i runs, so a random collator's
        # draws (masked LM) come in the same order relative to the step's dropout
        self.wrap_hook("epoch_iterator", lambda inner: lambda *a: fetch_one_ahead(inner(*a), self._note_in_flight))
        counter = flo_counter(self)  # last: its FIRST handlers run after those registered before it
        if counter is not None:
            self.add_plugin(counter)
        self._composed_for = args_snapshot(args)

    def _compose_again(self) -> None:
        """``train()`` on arguments changed since the plugins were built (HF reads ``self.args`` in ``train()``):
        the plugins built from the old arguments are replaced by those of the new ones, in the same places;
        plugins the script added (callbacks, ``plugins=``, ``add_callback``) stay as they are."""
        args = self.args
        standins = self.callback_handler.standin_types  # FlowControl / progress an add_callback put back: built again
        kept = [p for p in self.plugins if not any(p is b for b in self._built_plugins) and type(p) not in standins]
        for plugin in reversed(list(self.plugins)):
            self.pop_plugin(plugin)
        self.accumulation_steps = 1  # the new accumulation plugin (if any) sets it again
        if self._composed_for.get("per_device_train_batch_size") != repr(args.per_device_train_batch_size):
            self._train_batch_size = args.train_batch_size  # else what auto_find_batch_size found stays
        self.current_gradient_accumulation_steps = args.gradient_accumulation_steps
        self._prediction_loss_only = args.prediction_loss_only
        self.callback_handler.args = args
        self.eval_data = None  # made again from the new arguments when first needed
        removed = self.callback_handler.removed_plugins()  # a default callback the script took out stays out
        built = [p for p in build_plugins(self, args, *self._given) if type(p) not in removed]
        if any(isinstance(p, LRScheduler) for p in kept):  # the script installed its own (self.lr_scheduler = ...)
            built = [p for p in built if not isinstance(p, LRScheduler)]
        self._built_plugins = built
        for plugin in built + kept:
            self.add_plugin(plugin)
        if args.metric_for_best_model is not None and self.eval_dataset is not None:
            check_metric_for_best_model(self, args.metric_for_best_model)
        self._composed_for = args_snapshot(args)

    def overrides(self, method: str) -> bool:
        """Whether this Trainer's class replaces ``Trainer.<method>`` (composition asks, to pick plugins)."""
        return getattr(type(self), method) is not getattr(Trainer, method)

    # -- train / evaluate / predict -------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> TrainOutput:  # type: ignore[override]
        """Train; ``resume_from_checkpoint`` is a checkpoint path or True for the latest in output_dir."""
        check_train_kwargs(kwargs)  # HF's trial / ignore_keys_for_eval: None only
        if self.train_dataset is None:
            raise ConfigError("Trainer.train() needs a train_dataset")
        # a worker torchrun restarted goes on from its launch's last checkpoint
        resume_from_checkpoint = resume_after_restart(resume_from_checkpoint, self.args.output_dir)
        self.is_in_train = True
        try:
            self._prepare_run()
            if self.args.auto_find_batch_size:  # halve the batch on out-of-memory and start over (HF)
                self.create_optimizer()  # every attempt starts from its state
                resume, start = resume_from_checkpoint, self._train_batch_size
                if resume:  # HF: a resume starts from the batch size the checkpoint trained with
                    path, saved = ckpt.resumed_batch_size(resume, self.args.output_dir)
                    resume, start = str(path), saved or start
                return train_with_executable_batch_size(
                    self, start, self._use_train_batch_size, lambda: self._train(resume)
                )
            return self._train(resume_from_checkpoint)
        finally:
            self.is_in_train = False

    def _prepare_run(self) -> None:
        """What HF's ``train()`` reads anew each time: a fresh model from ``model_init`` and ``self.args`` as they
        are now (the plugins built from them are composed again when they changed)."""
        fresh_model = self.model_init is not None
        # HF: every train() starts from model_init's model, seeded, with a new optimizer
        if fresh_model and not self.__dict__.pop("_model_just_made", False):
            self.model = self._prepare_model(None, self.model_init)
            self.optimizer = None
        if fresh_model or args_snapshot(self.args) != self._composed_for:
            self._compose_again()
        self._rebuild_named_schedule()  # HF drops a schedule it built at every train(): the new run gets its own

    def _train(self, resume_from_checkpoint: str | bool | None) -> TrainOutput:
        # HF makes the train dataloader here, in train(): a subclass's get_train_dataloader sees the
        # attributes it set after super().__init__, and the batch size of the arguments as they are now
        loader = self.get_train_dataloader()
        self.max_epochs, self.max_steps = self._plan_length(loader)
        self.train_data = loader
        log_training_plan(self, loader)
        return self._train_prepared(resume_from_checkpoint)

    def _train_prepared(self, resume_from_checkpoint: str | bool | None) -> TrainOutput:
        align_special_tokens(self.model, self.processing_class)
        if self.overrides("create_scheduler") or self.overrides("create_optimizer_and_scheduler"):
            self.create_optimizer_and_scheduler(num_training_steps=self._plan()[0])  # HF: a subclass's runs
        else:
            self.create_optimizer()
        if self.distributed is not None:
            self.distributed.prepare_optimizer(self)  # DeepSpeed builds its engine before a resume loads into it
        self.state = State()
        self.state.train_batch_size = self._train_batch_size
        with ckpt.claim_run(self, resume_from_checkpoint):  # output_dir locked; a fresh run keeps others' checkpoints
            if resume_from_checkpoint:
                ckpt.resume(self, resume_from_checkpoint, self.args.output_dir)
                self.state.train_batch_size = self._train_batch_size  # what this run trains with, for its checkpoints
            state = self.fit()
        metrics = dict(self.train_logger.train_metrics)  # the logger composition built
        if self.memory_metrics is not None:  # skip_memory_metrics=False: HF returns the deltas too
            metrics.update(self.memory_metrics.metrics.get("train", {}))
        if state.epoch is not None:
            metrics["epoch"] = state.epoch  # HF's log() adds it to the very dict TrainOutput returns
        # HF's progress / printer callback pops total_flos from that dict: log_history keeps it, train() does not
        metrics.pop("total_flos", None)
        return TrainOutput(state.global_step, float(metrics.get("train_loss", 0.0)), metrics)

    def evaluate(  # type: ignore[override]
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, Any]:
        """Evaluate on ``eval_dataset`` (or the Trainer's); a dict of sets gives ``{prefix}_{name}_*`` keys."""
        if self._evaluation_open:  # super().evaluate() from a subclass's evaluate(): HF's body, in its evaluation
            return self._evaluate_as_hf(eval_dataset, ignore_keys, metric_key_prefix)
        # HF asks get_eval_dataloader at every evaluate() (persistent workers: the loader made first is kept)
        persistent = eval_dataset is None and self.args.dataloader_persistent_workers
        dataset = self.eval_dataset if eval_dataset is None else eval_dataset
        data = self.eval_data if persistent else (None if dataset is None else self._eval_loaders(dataset))
        if data is None:
            raise ConfigError("Trainer.evaluate() needs an eval_dataset (none was given to the Trainer)")
        only = self.args.prediction_loss_only or self.compute_metrics is None
        return self._with(only, ignore_keys, lambda: Engine.evaluate(self, data, prefix=metric_key_prefix))

    def predict(  # type: ignore[override]
        self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"
    ) -> PredictionOutput:
        """Predictions, label_ids and ``{metric_key_prefix}_*`` metrics for ``test_dataset``."""
        loader = self.get_test_dataloader(test_dataset)
        if self.overrides("evaluation_loop"):  # HF's predict calls the loop: a subclass's runs
            return self._predict_as_hf(loader, ignore_keys, metric_key_prefix)  # type: ignore[no-any-return]
        out = self._with(self.args.prediction_loss_only, ignore_keys, lambda: Engine.predict(self, loader))
        if metric_key_prefix != "test":
            renamed = {
                f"{metric_key_prefix}_{k[5:]}" if k.startswith("test_") else k: v for k, v in out.metrics.items()
            }
            out = PredictionOutput(out.predictions, out.label_ids, renamed)
        return out  # type: ignore[no-any-return]

    def _with(self, loss_only: bool, ignore_keys: list[str] | None, run: Callable[[], Any]) -> Any:
        saved = (self._prediction_loss_only, self._ignore_keys)
        self._prediction_loss_only, self._ignore_keys = loss_only, ignore_keys
        try:
            return run()
        finally:
            self._prediction_loss_only, self._ignore_keys = saved

    hyperparameter_search = _hyperparameter_search  # HF's ``Trainer.hyperparameter_search`` on optuna (search.py)

    def create_model_card(self, **kwargs: Any) -> None:
        """Write ``README.md`` about this run next to the saved model in output_dir (HF's, without the hub)."""
        if self.args.should_save:
            write_model_card(self, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save a loadable final model (``save_pretrained`` for HF models) and its model card to output_dir.

        The main process writes. A plugin may put other weights in the model while it is saved (``saving.py``):
        with an ``EMA`` plugin the averaged weights are saved (its ``save_averaged=False`` keeps the training ones).
        """
        save_final_model(self, output_dir)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Log ``logs`` (adds ``epoch``, appends to ``state.log_history``, calls on_log)."""
        super().log(logs)

    def add_callback(self, callback: Any) -> None:
        if _is_plugin(callback):
            self.add_plugin(callback() if isinstance(callback, type) else callback)
        else:
            self.callback_handler.add_callback(callback)

    def pop_callback(self, callback: Any) -> Any:
        if _is_plugin(callback):
            return self.pop_plugin(callback)
        return self.callback_handler.pop_callback(callback)

    def remove_callback(self, callback: Any) -> None:
        self.pop_callback(callback)


# transformers' methods trainbus does not have: calling one says what to use (an override is refused earlier)
for _name in REFUSED:
    if not hasattr(Trainer, _name):
        setattr(Trainer, _name, refusing_method(_name))


def _is_plugin(obj: Any) -> bool:
    return isinstance(obj, Plugin) or (isinstance(obj, type) and issubclass(obj, Plugin))
