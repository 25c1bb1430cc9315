"""trainbus.plugins: every feature as a plugin, and the Hugging Face style facade.

Names are imported lazily (on first access), so ``import trainbus.plugins`` stays cheap and a
plugin whose optional dependency is missing only fails when it is used::

    from trainbus.plugins import Trainer, TrainingArguments          # the facade
    from trainbus.plugins import GradientAccumulation, LRScheduler   # plugins for a bare Engine
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, tuple[str, ...]] = {
    # the facade
    "facade.arguments": ("TrainingArguments", "IntervalStrategy", "SaveStrategy"),
    "facade.argument_processes": ("ParallelMode",),
    "facade.trainer": ("Trainer",),
    "facade.seq2seq": ("Seq2SeqTrainer", "Seq2SeqTrainingArguments"),
    "facade.search": ("BestRun", "hyperparameter_search", "default_compute_objective"),
    "facade.model_card": ("write_model_card",),
    "facade.composition": ("TrainOutput", "build_plugins", "set_seed"),
    "facade.callbacks": ("TrainerCallback", "CallbackAdapter"),
    "facade.early_stopping_callback": ("EarlyStoppingCallback",),
    # data
    "data.length_grouping": ("LengthGroupedEpochSampler", "train_sampler"),
    "data.loading": (
        "default_data_collator",
        "DataCollatorWithPadding",
        "RemoveColumnsCollator",
        "EpochSampler",
        "ResumableData",
        "build_dataloader",
        "skip_first_batches",
        "remove_unused_columns",
    ),
    # optimization
    "optimization.optimizers": (
        "create_optimizer",
        "get_decay_parameter_names",
        "count_trainable_parameters",
        "OptimizerSetup",
        "OPTIMIZER_NAMES",
    ),
    "optimization.optimizer_modes": ("ScheduleFreeModes", "FusedBackward"),
    "optimization.schedulers": ("create_scheduler", "LRScheduler", "SCHEDULER_NAMES"),
    "optimization.accumulation": ("GradientAccumulation", "count_items"),
    "optimization.clipping": ("GradientClipping",),
    "optimization.precision": ("MixedPrecision",),
    "optimization.nonfinite": ("SkipNonFinite",),
    "evaluation.half_eval": ("HalfPrecisionEval",),
    "optimization.regularization": ("LabelSmoothing", "NEFTune"),
    "optimization.model_setup": ("GradientCheckpointing", "TorchCompile"),
    "optimization.device_settings": ("TF32", "EmptyDeviceCache"),
    "optimization.liger": ("LigerKernel",),
    # processes
    "distributed.plugin": ("Distributed",),
    "distributed.sharding": ("ShardedBatchSampler", "shard_train_loader", "shard_eval_loader"),
    # adapters
    "adapters.peft": ("AdapterSwitch", "adapter_names", "adapter_parameters", "prepare_qlora"),
    # weight averaging
    "averaging.ema": ("EMA",),
    "averaging.swa": ("SWA",),
    # evaluation
    "evaluation.collector": ("EvalCollector", "EvalPrediction", "PredictionOutput", "EvalLoopOutput"),
    "evaluation.metrics": ("IgniteMetrics",),
    "control.best_model": ("BestMetric",),
    "control.early_stopping": ("EarlyStopping",),
    # run control and observability
    "control.flow": ("FlowControl",),
    "control.preemption": ("Preemption", "TrainingInterrupted"),
    "observability.logging": ("TrainLogger", "ConsoleSink"),
    "observability.memory": ("MemoryMetrics",),
    "observability.debug": ("UnderflowOverflowDebug",),
    "observability.progress": ("ProgressBars", "Printer"),
    "observability.plots": ("PlotCurves", "plot_run"),
    "observability.sinks": ("JsonlSink", "CsvSink", "TensorBoardSink"),
    "observability.trackers": ("WandbSink", "MLflowSink", "TrackioSink"),
    # checkpoints
    "checkpoints.checkpoint": (
        "Checkpointing",
        "CheckpointWriteError",
        "LoadBestModelAtEnd",
        "save_checkpoint",
        "load_checkpoint",
        "resume",
        "latest_checkpoint",
        "list_checkpoints",
        "save_model",
        "load_model_weights",
    ),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'trainbus.plugins' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
