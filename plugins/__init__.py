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
    "arguments": ("TrainingArguments", "IntervalStrategy", "SaveStrategy"),
    "trainer": ("Trainer",),
    "composition": ("TrainOutput", "build_plugins", "set_seed"),
    "callbacks": ("TrainerCallback", "CallbackAdapter", "EarlyStoppingCallback"),
    # data
    "data": (
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
    "optimizers": (
        "create_optimizer",
        "get_decay_parameter_names",
        "count_trainable_parameters",
        "OptimizerSetup",
        "OPTIMIZER_NAMES",
    ),
    "schedulers": ("create_scheduler", "LRScheduler", "SCHEDULER_NAMES"),
    "accumulation": ("GradientAccumulation", "count_items"),
    "clipping": ("GradientClipping",),
    "precision": ("MixedPrecision",),
    "half_eval": ("HalfPrecisionEval",),
    "regularization": ("LabelSmoothing", "NEFTune"),
    "model_setup": ("GradientCheckpointing", "TorchCompile"),
    # evaluation
    "evaluation": ("EvalCollector", "EvalPrediction", "PredictionOutput", "EvalLoopOutput"),
    "metrics": ("IgniteMetrics",),
    "best_model": ("BestMetric",),
    "early_stopping": ("EarlyStopping",),
    # run control and observability
    "flow": ("FlowControl",),
    "logging": ("TrainLogger", "ConsoleSink"),
    "progress": ("ProgressBars", "Printer"),
    "sinks": ("JsonlSink", "CsvSink", "TensorBoardSink"),
    # checkpoints
    "checkpoint": (
        "Checkpointing",
        "LoadBestModelAtEnd",
        "save_checkpoint",
        "load_checkpoint",
        "resume",
        "latest_checkpoint",
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
