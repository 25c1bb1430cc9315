"""The Hugging Face style facade: ``Trainer`` is an Engine composed of the standard plugins from TrainingArguments.

Porting a script means changing the import::

    from trainbus.plugins import Trainer, TrainingArguments

Subclass overrides of ``compute_loss``, ``training_step``, ``prediction_step``, ``evaluate`` and
``log`` are honoured as in HF: the engine's step hooks call the overriding methods.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainbus.engine import ConfigError, Engine, Event, LogEvent, Plugin, Priority, State
from trainbus.hooks import forward as default_forward
from trainbus.hooks import get_labels

from ..checkpoints import checkpoint as ckpt
from ..data.length_grouping import main_input_name_of, train_sampler
from ..data.loading import (
    DataCollatorWithPadding,
    RemoveColumnsCollator,
    build_dataloader,
    default_data_collator,
    fetch_one_ahead,
    is_tokenizer_like,
    remove_unused_columns,
    signature_columns,
)
from ..distributed.batch_size import train_with_executable_batch_size
from ..distributed.fsdp import fsdp_plugin
from ..distributed.plugin import Distributed
from ..evaluation.collector import PredictionOutput, hf_prediction_step
from ..observability.flos import FloCounter
from ..observability.logging import TrainLogger
from ..observability.memory import MemoryMetrics
from ..optimization.optimizers import create_optimizer, fused_adamw_supported, parameter_groups
from ..optimization.schedulers import LRScheduler, create_scheduler
from .arguments import TrainingArguments
from .callbacks import CallbackAdapter
from .composition import Computed as _Computed
from .composition import TrainOutput, build_plugins, check_metric_for_best_model, flo_counter, set_seed
from .loss_protocol import accepts_loss_kwargs, honours_num_items, item_counter
from .model_card import write_model_card
from .model_folder import align_special_tokens, applies_use_cache
from .saving import save_model as save_final_model
from .search import hyperparameter_search as _hyperparameter_search
from .search import takes_trial
from .trainer_checks import check_model, loss_from_outputs
from .trainer_checks import compute_loss as trainer_compute_loss
from .utilities import TrainerUtilities


class Trainer(TrainerUtilities, Engine):
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

    #: HF: whether compute_loss's loss is already normalised over the accumulation window (None: only
    #: when a compute_loss_func made it from num_items_in_batch); a subclass with its own loss may set it
    loss_is_scaled_for_ga: bool | None = None

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
        self.args = args if args is not None else TrainingArguments()
        if not isinstance(self.args, TrainingArguments):
            raise ConfigError(f"args must be trainbus TrainingArguments, got {type(self.args).__name__}")
        args = self.args
        if optimizer_cls_and_kwargs is not None and optimizers[0] is not None:
            raise ConfigError("pass either optimizers=(optimizer, scheduler) or optimizer_cls_and_kwargs, not both")
        self.optimizer_cls_and_kwargs = optimizer_cls_and_kwargs
        self.flo_counter = FloCounter(self.floating_point_ops)  # a subclass's floating_point_ops counts (HF)
        self.memory_metrics = None if args.skip_memory_metrics else MemoryMetrics()
        if self.memory_metrics is not None:
            self.memory_metrics.start("init")  # HF measures the constructor as the "init" stage
        logging.getLogger("trainbus").setLevel(args.get_process_log_level())  # HF: log_level / _replica
        set_seed(args.seed)
        if args.full_determinism:
            torch.use_deterministic_algorithms(True)
        if model is None:
            if model_init is None:
                raise ConfigError("Trainer needs a model (or model_init)")
            model = model_init(None) if takes_trial(model_init) else model_init()  # HF: a 1-argument one gets the trial
        self.model_init = model_init
        check_model(model)
        model = model.to(args.device)
        if getattr(model, "config", None) is not None and applies_use_cache():
            model.config.use_cache = args.use_cache  # as HF 5: no KV cache in training / evaluation outputs
        self.processing_class = processing_class
        self.compute_loss_func = compute_loss_func
        self.compute_metrics = compute_metrics
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.label_names_arg = list(args.label_names) if args.label_names else ["labels"]
        self.data_collator = data_collator or (
            DataCollatorWithPadding(processing_class) if is_tokenizer_like(processing_class) else default_data_collator
        )
        if args.eval_strategy != "no" and eval_dataset is None:
            raise ConfigError(f"eval_strategy={args.eval_strategy.value!r} needs an eval_dataset; none was given")
        self._model_for_columns = model
        #: HF's: the forward takes loss kwargs, so training passes it ``num_items_in_batch``
        self.model_accepts_loss_kwargs = accepts_loss_kwargs(model)
        self._count_items = item_counter(model, self.label_names_arg)  # what the model's loss averages over
        # several processes: DDP through accelerate, sharded loaders (made before the train loader,
        # so the plan below counts global batches)
        precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"  # FSDP's mixed-precision policy
        self.distributed = (
            Distributed(
                find_unused_parameters=args.ddp_find_unused_parameters,
                bucket_cap_mb=args.ddp_bucket_cap_mb,
                broadcast_buffers=args.ddp_broadcast_buffers,
                static_graph=args.ddp_static_graph,
                fsdp=None if args.fsdp_plugin_args is None else fsdp_plugin(args.fsdp_plugin_args, precision),
                deepspeed=args.deepspeed_plugin,
            )
            if args.world_size > 1 or args.deepspeed_plugin is not None
            else None
        )
        self._train_batch_size = args.train_batch_size  # auto_find_batch_size may lower it
        train_loader = self.get_train_dataloader() if train_dataset is not None else None
        max_epochs, max_steps = self._plan_length(train_loader)
        super().__init__(
            model,
            optimizers[0],
            train_data=train_loader,
            max_epochs=max_epochs,
            max_steps=max_steps,
            device=args.device,
            label_names=self.label_names_arg,
        )
        self.eval_data = self._eval_loaders(eval_dataset) if eval_dataset is not None else None
        self._prediction_loss_only = args.prediction_loss_only
        self._ignore_keys: list[str] | None = None
        self._install_step_hooks()
        hf_callbacks = [cb for cb in callbacks or [] if not _is_plugin(cb)]
        self.callback_handler = CallbackAdapter(hf_callbacks, args, processing_class)
        for plugin in build_plugins(self, args, optimizers[1], preprocess_logits_for_metrics):
            self.add_plugin(plugin)
        for cb in callbacks or []:
            if _is_plugin(cb):
                self.add_plugin(cb() if isinstance(cb, type) else cb)
        for plugin in plugins or []:
            self.add_plugin(plugin)
        # a trainbus plugin among the callbacks may add eval metrics: then only the first evaluation knows
        self.metric_plugins_added = any(_is_plugin(cb) for cb in callbacks or []) or bool(plugins)
        if args.metric_for_best_model is not None and self.eval_data is not None:
            check_metric_for_best_model(self, args.metric_for_best_model)
        self.add_plugin(self.callback_handler)
        # as accelerate's loader under HF: batch i+1 is made before step i runs, so a random collator's
        # draws (masked LM) come in the same order relative to the step's dropout
        self.wrap_hook("epoch_iterator", lambda inner: lambda *a: fetch_one_ahead(inner(*a)))
        counter = flo_counter(self)  # last: its FIRST handlers run after those registered before it
        if counter is not None:
            self.add_plugin(counter)
        if self.memory_metrics is not None:
            self.memory_metrics.stop("init")
        self.callback_handler.init_end(self)

    # -- composition helpers ----------------------------------------------------------------------
    def _plan_length(self, loader: Any) -> tuple[int | None, int | None]:
        args = self.args
        if args.max_steps > 0:
            return None, args.max_steps
        if loader is None:
            return max(1, math.ceil(args.num_train_epochs)), None
        try:
            batches = len(loader)
        except TypeError:
            raise ConfigError(
                "the train dataset has no length (an iterable dataset): set TrainingArguments.max_steps"
            ) from None
        if float(args.num_train_epochs).is_integer():
            return int(args.num_train_epochs), None
        per_epoch = math.ceil(batches / args.gradient_accumulation_steps)
        return None, max(1, math.ceil(args.num_train_epochs * per_epoch))  # fractional epochs, as HF

    def _install_step_hooks(self) -> None:
        cls = type(self)
        self.set_hook("compute_loss", trainer_compute_loss)  # its no-loss error speaks to a Trainer user
        if cls.training_step is not Trainer.training_step:
            self.set_hook("forward", self._forward_training_step)
            self.set_hook("compute_loss", lambda outputs, batch: outputs.loss)
            base_backward = self.hooks.backward
            self.set_hook("backward", lambda loss: base_backward(loss) if loss.requires_grad else None)
        elif cls.compute_loss is not Trainer.compute_loss or self.compute_loss_func is not None:
            self.set_hook("forward", self._forward_compute_loss)
            self.set_hook("compute_loss", lambda outputs, batch: outputs.loss)
        elif self.model_accepts_loss_kwargs:
            self.set_hook("forward", self._forward_with_loss_kwargs)
        self.set_hook("prediction_step", self._prediction_step_hook)
        if cls.log is not Trainer.log:
            # after TrainLogger filled a logging point's record, before history and sinks read it
            self.on(Event.LOG, self._log_through_override, priority=Priority.PRODUCER.after("*"), name="Trainer.log")

    def _log_through_override(self, ev: LogEvent) -> None:
        """A logging point's record goes through the subclass's ``log`` (HF calls ``self.log(logs, start_time)``)."""
        if not ev.window or not ev.logs:
            return
        logs = {k: v for k, v in ev.logs.items() if k not in ("epoch", "num_input_tokens_seen")}  # log() adds them
        ev.logs.clear()  # this payload is dropped; self.log fires the record anew
        self.log(logs, None)

    def _forward_compute_loss(self, model: torch.nn.Module, batch: Any) -> Any:
        if not model.training and get_labels(batch, tuple(self.label_names)) is None:
            return default_forward(model, batch)  # HF's prediction_step: no labels, no compute_loss
        items = self._num_items_in_batch(batch) if model.training else None
        result = self.compute_loss(model, batch, return_outputs=True, num_items_in_batch=items)
        loss, outputs = result if isinstance(result, tuple) else (result, None)
        return _Computed(loss, outputs)

    def _forward_with_loss_kwargs(self, model: torch.nn.Module, batch: Any) -> Any:
        """HF's call: a training forward with labels also gets ``num_items_in_batch`` (the window's items)."""
        if model.training and isinstance(batch, Mapping) and "labels" in batch:
            return model(**batch, num_items_in_batch=self._num_items_in_batch(batch))
        return default_forward(model, batch)

    def _num_items_in_batch(self, batch: Any) -> Any:
        """HF's ``num_items_in_batch``: the items (labels not -100) of this step's whole accumulation window.

        The accumulation plugin counts them once per window (across processes with
        average_tokens_across_devices) into ``step_outputs``; without one, the items of this batch.
        """
        items = self.step_outputs.get("num_items_in_batch")
        return items if items is not None else self._count_items(batch)

    def _loss_is_scaled_for_ga(self) -> bool:
        """Whether the loss is already normalised over the window (HF's ``loss_is_scaled_for_ga``).

        It is when a compute_loss_func made it (with num_items_in_batch), or when the model divides
        by the ``num_items_in_batch`` it is passed. Unlike HF, a ``**kwargs`` forward that ignores
        the count (BERT's heads, T5) returns its own mean, which accumulation still weights.
        """
        if self.loss_is_scaled_for_ga is not None:
            return bool(self.loss_is_scaled_for_ga)
        if self.compute_loss_func is not None:
            return True
        return "labels" in self.label_names and honours_num_items(self.model)

    def _forward_training_step(self, model: torch.nn.Module, batch: Any) -> Any:
        if model.training and torch.is_grad_enabled():
            return _Computed(self.training_step(model, batch, self._num_items_in_batch(batch)), None)
        if type(self).compute_loss is not Trainer.compute_loss or self.compute_loss_func is not None:
            return self._forward_compute_loss(model, batch)
        return _Computed(*Trainer.compute_loss(self, model, batch, return_outputs=True))

    def _prediction_step_hook(
        self, model: torch.nn.Module, batch: Any, forward: Any, compute_loss: Any, label_names: Any
    ) -> tuple[Any, Any, Any]:
        return self.prediction_step(model, batch, self._prediction_loss_only, self._ignore_keys)

    def overrides(self, method: str) -> bool:
        """Whether this Trainer's class replaces ``Trainer.<method>`` (composition asks, to pick plugins)."""
        return getattr(type(self), method) is not getattr(Trainer, method)

    # -- HF's overridable step methods ------------------------------------------------------------
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
            loss = loss / self.args.gradient_accumulation_steps
        self.hooks.backward(loss)
        return loss.detach()

    def prediction_step(
        self, model: torch.nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[Any, Any, Any]:
        """(loss, logits, labels) for one batch; logits are every model output but the loss (HF)."""
        computed: dict[str, Any] = {}

        def forward(m: torch.nn.Module, b: Any) -> Any:
            out = self.hooks.forward(m, b)
            if isinstance(out, _Computed):
                computed["loss"] = out.loss
                return out.outputs
            return out

        def loss_of(out: Any, b: Any) -> Any:
            return computed["loss"] if "loss" in computed else self.hooks.compute_loss(out, b)

        loss, logits, labels = hf_prediction_step(ignore_keys)(model, inputs, forward, loss_of, self.label_names)
        if loss is not None:
            loss = loss.detach().mean()
        return (loss, None, None) if prediction_loss_only else (loss, logits, labels)

    # -- data -----------------------------------------------------------------------------------
    def _collator_for(self, dataset: Any) -> Callable[[list[Any]], Any]:
        if not self.args.remove_unused_columns:
            return self.data_collator
        keep = signature_columns(self._model_for_columns, self.label_names_arg)
        if hasattr(dataset, "column_names"):
            return self.data_collator  # datasets.Dataset columns are removed on the dataset itself
        return RemoveColumnsCollator(self.data_collator, keep, self._model_for_columns)

    def _loader(self, dataset: Any, batch_size: int, shuffle: bool, drop_last: bool) -> Any:
        args = self.args
        seed = args.data_seed if args.data_seed is not None else args.seed
        sampler = None
        if shuffle:  # the train set: HF's train_sampling_strategy, lengths read before columns are removed
            sampler = train_sampler(
                dataset,
                str(args.train_sampling_strategy),
                seed=seed,
                group_size=args.train_batch_size * args.gradient_accumulation_steps * args.world_size,
                length_column_name=args.length_column_name,
                model_input_name=main_input_name_of(self.processing_class),
            )
        if args.remove_unused_columns:
            dataset = remove_unused_columns(dataset, self._model_for_columns, self.label_names_arg)
        return build_dataloader(
            dataset,
            batch_size=batch_size,
            collate_fn=self._collator_for(dataset),
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory and args.device.type == "cuda",
            persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            sampler=sampler,
        )

    def get_train_dataloader(self) -> Any:
        if self.train_dataset is None:
            raise ConfigError("Trainer: training requires a train_dataset")
        args = self.args
        loader = self._loader(self.train_dataset, self._train_batch_size, True, args.dataloader_drop_last)
        return loader if self.distributed is None else self.distributed.shard_train(loader)

    def _use_train_batch_size(self, batch_size: int) -> None:
        """Train with this per-device batch size from now on (auto_find_batch_size)."""
        self._train_batch_size = batch_size
        self.train_data = self.get_train_dataloader()
        self.max_epochs, self.max_steps = self._plan_length(self.train_data)
        scheduler = self.get_plugin(LRScheduler)
        if isinstance(scheduler, LRScheduler) and scheduler.scheduler_name is not None:
            scheduler.scheduler = None  # built again at TRAIN_START for the new number of steps (HF)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ConfigError("Trainer: evaluation requires an eval_dataset")
        return self._loader(dataset, self.args.eval_batch_size, False, self.args.dataloader_drop_last)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return self._loader(test_dataset, self.args.eval_batch_size, False, self.args.dataloader_drop_last)

    def _eval_loaders(self, dataset: Any) -> Any:
        if isinstance(dataset, Mapping):
            return {name: self.get_eval_dataloader(d) for name, d in dataset.items()}
        return self.get_eval_dataloader(dataset)

    def num_examples(self, dataloader: Any) -> int:
        """Examples in a dataloader's dataset (HF)."""
        dataset = getattr(dataloader, "dataset", dataloader)
        return len(dataset)

    def num_tokens(self, train_dl: Any, max_steps: int | None = None) -> int:
        """Input tokens in ``train_dl`` (``input_ids`` elements), over at most ``max_steps`` batches."""
        batches = itertools.islice(train_dl, max_steps)
        return sum(int(b["input_ids"].numel()) for b in batches if isinstance(b, Mapping) and "input_ids" in b)

    # -- optimizer and scheduler ------------------------------------------------------------------
    @property
    def lr_scheduler(self) -> Any:
        plugin = self.get_plugin(LRScheduler)
        return getattr(plugin, "scheduler", None)

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        """HF code assigns ``self.lr_scheduler = ...`` (in create_scheduler): the LRScheduler plugin steps it."""
        old = self.pop_plugin(LRScheduler)
        if scheduler is not None:
            self.add_plugin(LRScheduler(scheduler, metric=getattr(old, "metric", "loss")))

    def create_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None and (
            self.optimizer_cls_and_kwargs is not None or self.overrides("get_optimizer_cls_and_kwargs")
        ):
            self.optimizer = self._optimizer_from_cls_and_kwargs()
        if self.optimizer is None:
            args = self.args
            name = args.optim
            if name == "adamw_torch_fused" and not fused_adamw_supported(self.model):
                name = "adamw_torch"
            total_steps = self._plan()[0] if self.train_data is not None else 0  # for schedule-free warmup
            self.optimizer = create_optimizer(
                self.model, name, args.learning_rate, args.weight_decay, args.adam_beta1, args.adam_beta2,
                args.adam_epsilon, args.optim_args, optim_target_modules=args.optim_target_modules,
                warmup_steps=args.get_warmup_steps(total_steps),
            )  # fmt: skip
        return self.optimizer

    def _optimizer_from_cls_and_kwargs(self) -> torch.optim.Optimizer:
        """HF's path for ``optimizer_cls_and_kwargs`` or an overridden ``get_optimizer_cls_and_kwargs``:
        the class gets the weight-decay groups, unless the kwargs bring ``params`` or ``model`` (GaLore, LOMO)."""
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, self.model)
        kwargs = dict(kwargs)
        params: Any = parameter_groups(self.model, self.args.weight_decay)
        for key in ("params", "model"):
            if key in kwargs:
                params = kwargs.pop(key)
        return optimizer_cls(params, **kwargs)  # type: ignore[no-any-return]

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Build the scheduler now (HF); the LRScheduler plugin then steps this instance."""
        if self.lr_scheduler is None:
            args = self.args
            scheduler = create_scheduler(
                str(args.lr_scheduler_type), optimizer or self.create_optimizer(), num_training_steps,
                args.warmup_steps, args.warmup_ratio, args.lr_scheduler_kwargs,
            )  # fmt: skip
            self.lr_scheduler = scheduler
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.create_optimizer()
        self.create_scheduler(num_training_steps, self.optimizer)

    # -- train / evaluate / predict -------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> TrainOutput:  # type: ignore[override]
        """Train; ``resume_from_checkpoint`` is a checkpoint path or True for the latest in output_dir."""
        if kwargs:
            raise ConfigError(f"train() got unexpected arguments {sorted(kwargs)}; it takes resume_from_checkpoint")
        if self.train_data is None:
            raise ConfigError("Trainer.train() needs a train_dataset")
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

    def _train(self, resume_from_checkpoint: str | bool | None) -> TrainOutput:
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
        logger = self.get_plugin(TrainLogger)
        metrics = dict(getattr(logger, "train_metrics", {}))
        memory = self.get_plugin("MemoryMetrics", None)  # skip_memory_metrics=False: HF returns the deltas too
        metrics.update(getattr(memory, "metrics", {}).get("train", {}))
        if state.epoch is not None:
            metrics["epoch"] = state.epoch  # HF's log() adds it to the very dict TrainOutput returns
        # HF's progress / printer callback pops total_flos from that dict: log_history keeps it, train() does not
        metrics.pop("total_flos", None)
        return TrainOutput(state.global_step, float(metrics.get("train_loss", 0.0)), metrics)

    def evaluate(  # type: ignore[override]
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, Any]:
        """Evaluate on ``eval_dataset`` (or the Trainer's); a dict of sets gives ``{prefix}_{name}_*`` keys."""
        data = self.eval_data if eval_dataset is None else self._eval_loaders(eval_dataset)
        if data is None:
            raise ConfigError("Trainer.evaluate() needs an eval_dataset (none was given to the Trainer)")
        only = self.args.prediction_loss_only or self.compute_metrics is None
        return self._with(only, ignore_keys, lambda: Engine.evaluate(self, data, prefix=metric_key_prefix))

    def predict(  # type: ignore[override]
        self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"
    ) -> PredictionOutput:
        """Predictions, label_ids and ``{metric_key_prefix}_*`` metrics for ``test_dataset``."""
        loader = self.get_test_dataloader(test_dataset)
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

    #: HF's ``Trainer.hyperparameter_search`` on optuna (plugins/facade/search.py)
    hyperparameter_search = _hyperparameter_search

    def create_model_card(self, **kwargs: Any) -> None:
        """Write ``README.md`` about this run next to the saved model in output_dir (HF's, without the hub)."""
        if self.args.should_save:
            write_model_card(self, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save a loadable final model (``save_pretrained`` for HF models) and its model card to output_dir.

        The main process writes. A plugin may put other weights in the model while it is saved (the
        save-model protocol, ``saving.py``): with an ``EMA`` plugin the averaged weights are saved (its
        ``save_averaged=False`` keeps the training weights).
        """
        save_final_model(self, output_dir)

    @property
    def accelerator(self) -> Any:
        """accelerate's ``Accelerator`` (HF scripts call its is_main_process, gather_for_metrics, print, ...).

        Under several processes it is the one the Distributed plugin runs; in one process one is made
        on first use (the Trainer itself does not need it there).
        """
        if self.distributed is not None:
            return self.distributed.accelerator_for(self)
        if "_accelerator" not in self.__dict__:
            from accelerate import Accelerator

            self.__dict__["_accelerator"] = Accelerator(cpu=self.args.device.type == "cpu")
        return self.__dict__["_accelerator"]

    @property
    def model_wrapped(self) -> torch.nn.Module:
        """The model as training runs it: its DDP wrapper or DeepSpeed engine, else the model itself (HF)."""
        distributed = self.distributed
        zero = None if distributed is None or distributed.zero is None else distributed.zero.ds_engine
        wrapper = None if distributed is None else distributed.ddp or zero
        return self.model if wrapper is None else wrapper

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Log ``logs`` (adds ``epoch``, appends to ``state.log_history``, calls on_log)."""
        super().log(logs)

    # -- callbacks (HF names) -------------------------------------------------------------------
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


def _is_plugin(obj: Any) -> bool:
    return isinstance(obj, Plugin) or (isinstance(obj, type) and issubclass(obj, Plugin))
