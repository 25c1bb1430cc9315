"""Which plugins a ``Trainer`` gets from its ``TrainingArguments``: the facade is only composition.

``build_plugins`` returns them in attach order; ``check_metric_for_best_model`` rejects at
construction a metric name that no evaluation can produce.
"""

from __future__ import annotations

import importlib.util
import random
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from trainbus.engine import ConfigError, Plugin

from ..checkpoints.checkpoint import Checkpointing, LoadBestModelAtEnd
from ..control.best_model import BestMetric, check_metric_key, expected_keys
from ..control.flow import FlowControl
from ..control.preemption import Preemption
from ..data.length_grouping import LengthGroupedOrder
from ..data.loading import ResumableData
from ..distributed.fsdp import fsdp_plugin
from ..distributed.plugin import Distributed
from ..evaluation.collector import EvalCollector
from ..evaluation.half_eval import HalfPrecisionEval
from ..observability.debug import UnderflowOverflowDebug
from ..observability.flos import FloCounter, has_flos_estimate
from ..observability.logging import SINKS, TrainLogger
from ..observability.memory import MemoryMetrics
from ..observability.progress import Printer, ProgressBars
from ..observability.sinks import SINKS as _SINKS  # noqa: F401  (importing sinks registers jsonl / csv / tensorboard)
from ..observability.trackers import TRACKERS  # importing trackers registers wandb / mlflow / trackio
from ..optimization.accumulation import GradientAccumulation
from ..optimization.clipping import GradientClipping
from ..optimization.device_settings import TF32, EmptyDeviceCache, tf32_setting
from ..optimization.liger import LigerKernel
from ..optimization.model_setup import GradientCheckpointing, TorchCompile
from ..optimization.optimizer_modes import FusedBackward, ScheduleFreeModes
from ..optimization.optimizer_names import optimizer_spec
from ..optimization.precision import MixedPrecision
from ..optimization.regularization import LabelSmoothing, NEFTune
from ..optimization.schedulers import LRScheduler
from .grad_norm import NAMES as GRAD_NORM_METHODS
from .grad_norm import ClippingThroughTrainer, check_grad_norm_overrides
from .log_save_evaluate import LogSaveEvaluate, StepEndLogger, check_step_end_override
from .loss_protocol import unwrap_model
from .model_folder import checkpoint_extras
from .subclass_state import subclass_state
from .subclass_surface import is_multi_label


class TrainOutput(NamedTuple):
    """What ``Trainer.train`` returns (HF's TrainOutput)."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


class Computed:
    """What the forward hook returns when a subclass's compute_loss / training_step produced the loss."""

    __slots__ = ("loss", "outputs")

    def __init__(self, loss: torch.Tensor, outputs: Any) -> None:
        self.loss = loss
        self.outputs = outputs

    @property
    def logits(self) -> Any:
        from trainbus.hooks import model_output

        return model_output(self.outputs)


def set_seed(seed: int) -> None:
    """Seed Python, numpy and torch (HF ``set_seed``)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


if TYPE_CHECKING:
    from .arguments import TrainingArguments


def build_plugins(
    trainer: Any, args: TrainingArguments, scheduler: Any, preprocess_logits_for_metrics: Any
) -> list[Plugin]:
    """The standard plugins for ``args``, in attach order (producers first, sinks last)."""
    distributed = getattr(trainer, "distributed", None)
    data = ResumableData(args.ignore_data_skip)
    plugins: list[Plugin] = [data] if distributed is None else [distributed, data]
    plugins += _model_plugins(args)
    plugins += _step_plugins(trainer, args, scheduler)
    plugins += _eval_and_save_plugins(trainer, args, preprocess_logits_for_metrics)
    plugins += _observability_plugins(trainer, args)
    own = subclass_state(trainer)  # what a subclass keeps on self, in checkpoints (subclass_state.py)
    return plugins if own is None else [*plugins, own]


def _model_plugins(args: TrainingArguments) -> list[Plugin]:
    """What sets up the model and the device: TF32, cache emptying, Liger, compile, checkpointing, precision."""
    plugins: list[Plugin] = []
    tf32 = tf32_setting(args.tf32, torch_compile=args.torch_compile, fp16=args.fp16)
    if tf32 is not None:
        plugins.append(TF32(tf32))
    if args.torch_empty_cache_steps is not None:
        plugins.append(EmptyDeviceCache(args.torch_empty_cache_steps))
    if args.use_liger_kernel:  # patch the model before it is compiled
        plugins.append(LigerKernel(args.liger_kernel_config))
    if args.torch_compile:
        compile_kwargs = {"backend": args.torch_compile_backend, "mode": args.torch_compile_mode}
        plugins.append(TorchCompile(**{k: v for k, v in compile_kwargs.items() if v is not None}))
    if args.gradient_checkpointing:
        plugins.append(GradientCheckpointing(args.gradient_checkpointing_kwargs))
    deepspeed = getattr(args, "deepspeed_plugin", None) is not None  # DeepSpeed owns precision and clipping
    if (args.fp16 or args.bf16) and not deepspeed:
        # fp16: transformers (through accelerate) steps the schedule on an overflowed step of a fused optimizer, its
        # default (GradScaler calls a fused step, which skips inside): keep_schedule does so with no host read
        plugins.append(MixedPrecision("fp16", keep_schedule=True) if args.fp16 else MixedPrecision("bf16"))
    if args.fp16_full_eval or args.bf16_full_eval:
        plugins.append(HalfPrecisionEval("fp16" if args.fp16_full_eval else "bf16"))
    return plugins


def _step_plugins(trainer: Any, args: TrainingArguments, scheduler: Any) -> list[Plugin]:
    """What shapes the optimizer step: accumulation, clipping, optimizer modes, regularisation, the schedule."""
    own_step = trainer.overrides("training_step")
    own_loss = own_step or trainer.overrides("compute_loss") or trainer.compute_loss_func is not None
    distributed = getattr(trainer, "distributed", None)
    deepspeed = getattr(args, "deepspeed_plugin", None) is not None  # DeepSpeed owns precision and clipping
    plugins: list[Plugin] = []
    # across processes accumulation also normalises a single micro-batch by the items on all ranks
    # (HF's average_tokens_across_devices), so uneven -100 padding still gives the 1-process gradient
    across = distributed is not None and args.average_tokens_across_devices
    if args.gradient_accumulation_steps > 1 or (across and not own_step):
        if own_step:
            # a custom training_step normalises its loss itself (HF's divides by the steps)
            trainer.accumulation_steps = args.gradient_accumulation_steps
        else:
            plugins.append(
                GradientAccumulation(
                    args.gradient_accumulation_steps,
                    count_items=trainer._count_items,  # what the model's loss averages over (loss_protocol)
                    across_processes=args.average_tokens_across_devices,
                    prescaled=trainer._loss_is_scaled_for_ga,  # asked at TRAIN_START (HF's loss_is_scaled_for_ga)
                )
            )
    optim = optimizer_spec(str(args.optim))
    clips = not optim.steps_in_backward and not deepspeed  # those leave no gradients to clip
    check_grad_norm_overrides(trainer, clips)
    if clips and any(trainer.overrides(name) for name in GRAD_NORM_METHODS):
        plugins.append(ClippingThroughTrainer(args.max_grad_norm))  # the subclass's _clip_grad_norm / _get_grad_norm
    elif clips:  # max_grad_norm=0: no clipping, but grad_norm is measured and logged, as transformers does
        plugins.append(GradientClipping(args.max_grad_norm, norm_when_off=True))
    plugins.append(ScheduleFreeModes())  # acts only on optimizers with train() / eval(), as in HF
    if optim.fused_backward:
        plugins.append(FusedBackward())
    if args.label_smoothing_factor and not own_loss and not is_multi_label(unwrap_model(trainer.model)):
        plugins.append(LabelSmoothing(args.label_smoothing_factor))
    if args.neftune_noise_alpha is not None:
        plugins.append(NEFTune(args.neftune_noise_alpha))
    plugins.append(
        LRScheduler(
            scheduler if scheduler is not None else str(args.lr_scheduler_type),
            num_warmup_steps=args.warmup_steps,
            warmup_ratio=args.warmup_ratio,
            scheduler_kwargs=args.lr_scheduler_kwargs,
            metric=args.metric_for_best_model or "loss",
        )
    )
    return plugins


def _eval_and_save_plugins(trainer: Any, args: TrainingArguments, preprocess_logits_for_metrics: Any) -> list[Plugin]:
    """Evaluation, the best metric, checkpoints and the flow control that decides when each happens."""
    plugins: list[Plugin] = []
    plugins.append(
        EvalCollector(
            trainer.compute_metrics,
            preprocess_logits_for_metrics,
            args.eval_accumulation_steps,
            args.prediction_loss_only,
            include_inputs="inputs" in args.include_for_metrics,
            include_losses="loss" in args.include_for_metrics,
            input_name=getattr(trainer.model, "main_input_name", "input_ids"),
            batch_eval_metrics=args.batch_eval_metrics,
            concat_batches=args.eval_do_concat_batches,
        )
    )
    if str(args.train_sampling_strategy) == "group_by_length":
        plugins.append(LengthGroupedOrder())  # the epoch's grouped order in checkpoints: a resume draws it again
    if args.metric_for_best_model is not None:
        plugins.append(BestMetric(args.metric_for_best_model, args.greater_is_better))
    # present with save_strategy="no" too: a callback's control.should_save still gets a checkpoint (HF)
    plugins.append(
        Checkpointing(
            args.output_dir,
            args.save_total_limit,
            args.metric_for_best_model,
            only_best_at_end=True,
            save_only_model=args.save_only_model,
            save_async=args.save_async,
            model_folder=checkpoint_extras(trainer),  # config.json, tokenizer, training_args.json (HF's folder)
        )
    )
    if args.load_best_model_at_end:
        plugins.append(LoadBestModelAtEnd())
    plugins.append(FlowControl.from_args(args))
    # SIGTERM / a first Ctrl-C: checkpoint at the next step, exit 143 / 130; the exit message in the Trainer's words
    # enable_jit_checkpoint (transformers): the same checkpoint, then train() returns, as there
    plugins.append(
        Preemption(
            resume_hint="trainer.train(resume_from_checkpoint=True)", return_after_stop=args.enable_jit_checkpoint
        )
    )
    return plugins


def _observability_plugins(trainer: Any, args: TrainingArguments) -> list[Plugin]:
    """The logger (its train-end metrics are what ``train()`` returns), progress, debugging, memory, sinks."""
    step_end = trainer.overrides("_maybe_log_save_evaluate")  # then the subclass's override logs the loss
    logger = StepEndLogger if step_end else TrainLogger
    trainer.train_logger = logger(
        args.logging_nan_inf_filter,
        str(args.include_num_input_tokens_seen),
        input_name=getattr(trainer.model, "main_input_name", "input_ids"),
    )
    plugins: list[Plugin] = [trainer.train_logger]
    if step_end or trainer.overrides("_get_learning_rate"):  # called where transformers calls them
        if step_end:
            check_step_end_override(type(trainer))
        plugins.append(LogSaveEvaluate(step_end, args.logging_nan_inf_filter))
    plugins.append(Printer() if args.disable_tqdm else ProgressBars())
    if "underflow_overflow" in args.debug:
        plugins.append(UnderflowOverflowDebug())
    if not args.skip_memory_metrics:  # the Trainer may have made it to measure its constructor ("init")
        plugins.append(getattr(trainer, "memory_metrics", None) or MemoryMetrics())
    plugins.extend(_sinks(args))
    return plugins


def distributed_plugin(args: TrainingArguments) -> Distributed | None:
    """Several processes (or DeepSpeed): DDP through accelerate, FSDP or DeepSpeed, and sharded loaders."""
    if args.world_size == 1 and args.deepspeed_plugin is None:
        return None
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"  # FSDP's mixed-precision policy
    return Distributed(
        find_unused_parameters=args.ddp_find_unused_parameters,
        bucket_cap_mb=args.ddp_bucket_cap_mb,
        broadcast_buffers=args.ddp_broadcast_buffers,
        static_graph=args.ddp_static_graph,
        fsdp=None if args.fsdp_plugin_args is None else fsdp_plugin(args.fsdp_plugin_args, precision),
        deepspeed=args.deepspeed_plugin,
    )


def flo_counter(trainer: Any) -> FloCounter | None:
    """The Trainer's FloCounter when there is an estimate to count (HF counts for transformers models): the
    model's own ``floating_point_ops`` or ``num_parameters``, or a subclass's ``floating_point_ops``."""
    if has_flos_estimate(trainer.model) or trainer.overrides("floating_point_ops") or trainer.overrides("store_flos"):
        return trainer.flo_counter  # type: ignore[no-any-return]
    return None


#: the library a sink needs, for report_to="all"
SINK_REQUIRES = {"tensorboard": "tensorboard", **{name: name for name in TRACKERS}}


def _sinks(args: TrainingArguments) -> list[Plugin]:
    names = list(args.report_to or [])
    if names == ["all"]:  # as in HF: every sink whose library is installed
        names = [
            n for n in SINKS if n != "console" and importlib.util.find_spec(SINK_REQUIRES.get(n, "json")) is not None
        ]
    unknown = [n for n in names if n not in SINKS]
    if unknown:
        raise ConfigError(f"report_to has unknown sinks {unknown}; available: {sorted(SINKS)} (or 'none', 'all')")
    return [SINKS[n](args) for n in names if not (n == "console" and args.disable_tqdm)]


def check_metric_for_best_model(trainer: Any, metric: str) -> None:
    """Raise at construction when ``metric`` cannot appear: no compute_metrics and no plugin adds metrics.

    Only the keys trainbus produces itself (``eval_loss``, ``eval_runtime``, ...) are known before an
    evaluation; a metric of compute_metrics or a metrics plugin is checked at the first evaluation
    (``MetricWatch``, before best tracking, early stopping or rotation act on it). User code is never
    called outside a real evaluation, as in HF.
    """
    if trainer.compute_metrics is None and not trainer.metric_plugins_added:
        check_metric_key(metric, expected_keys(trainer.eval_dataset, (), with_loss=True))  # names of a dict of sets


def args_snapshot(args: Any) -> dict[str, str]:
    """Every field of ``args`` as its repr: ``train()`` composes the plugins again when this changed (HF reads
    ``self.args`` in ``train()``, so a script or a search that edits them after construction is heard)."""
    import dataclasses

    snapshot = {f.name: repr(getattr(args, f.name, None)) for f in dataclasses.fields(args)}
    snapshot["<object>"] = str(id(args))  # trainer.args = other_args
    return snapshot


def check_train_dataset(dataset: Any, max_steps: int) -> None:
    """HF's checks of a train set at construction (its loader is made later, in ``train()``)."""
    if dataset is None:
        return
    if isinstance(dataset, str | bytes | int | float) or not (
        hasattr(dataset, "__len__") or hasattr(dataset, "__iter__") or hasattr(dataset, "__getitem__")
    ):
        raise ConfigError(
            f"train_dataset must be a dataset (a sized or iterable collection of samples), got {type(dataset).__name__}"
        )
    try:
        length: int | None = len(dataset)
    except TypeError:
        length = None
    if length == 0:
        raise ConfigError("train_dataset is empty (length 0); training needs at least one sample")
    if length is None and max_steps <= 0:
        raise ConfigError(
            "the train dataset has no length (an iterable dataset): set TrainingArguments.max_steps "
            "to a positive number"
        )
