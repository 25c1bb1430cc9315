"""What ``Checkpointing`` checks: its arguments at construction, and at ``fit()`` that something asks it to save."""

from __future__ import annotations

from typing import Any

from trainbus.engine import Composition, ConfigError
from trainbus.engine.errors import ConfigTypeError, check_callable, check_flag

from .output_dir_check import check_output_dir

SAVE_STRATEGIES = ("no", "steps", "epoch", "best")


def _valid_save_steps(save_steps: Any) -> bool:
    if isinstance(save_steps, bool):
        return False
    if isinstance(save_steps, int):
        return save_steps >= 1
    return isinstance(save_steps, float) and (0 < save_steps < 1 or (save_steps.is_integer() and save_steps >= 1))


def check_checkpointing_arguments(
    output_dir: Any, save_total_limit: Any, save_safetensors: Any, save_strategy: Any, save_steps: Any
) -> str:
    """Raise ConfigError naming the first bad argument; returns the save strategy's name ("no" for None)."""
    check_output_dir(output_dir)
    if save_total_limit is not None and (
        isinstance(save_total_limit, bool) or not isinstance(save_total_limit, int) or save_total_limit < 1
    ):
        raise ConfigError(f"save_total_limit must be an integer >= 1 or None, got {save_total_limit!r}")
    if save_safetensors is not True:
        raise ConfigError("save_safetensors must be True: trainbus checkpoints are safetensors + JSON, never pickle")
    strategy = getattr(save_strategy, "value", save_strategy) or "no"
    if strategy not in SAVE_STRATEGIES:
        raise ConfigError(f"save_strategy must be one of {SAVE_STRATEGIES}, got {save_strategy!r}")
    if strategy == "steps" and not _valid_save_steps(save_steps):
        raise ConfigError(f"save_steps must be an integer >= 1 or a float in (0, 1), got {save_steps!r}")
    return str(strategy)


def check_checkpointing_options(
    best_metric_key: Any, only_best_at_end: Any, save_only_model: Any, model_folder: Any, save_async: Any = False
) -> None:
    """Checkpointing's other arguments: a ConfigError naming the first one of the wrong kind."""
    if best_metric_key is not None and (not isinstance(best_metric_key, str) or not best_metric_key):
        raise ConfigTypeError(
            f"best_metric_key must be a metric name (e.g. 'eval_loss') or None, got {best_metric_key!r}"
        )
    check_flag("only_best_at_end", only_best_at_end)
    check_flag("save_only_model", save_only_model)
    check_flag("save_async", save_async)
    check_callable("model_folder", model_folder, "a function model_folder(checkpoint_path) writing the model's files")


def unscheduled_saves(composition: Composition) -> list[str] | None:
    """The composition problem of a Checkpointing that nothing asks to save (None when something does)."""
    if "save" in composition.scheduled:
        return None
    return [
        "nothing schedules a save, so it never writes a checkpoint: pass save_strategy='steps' or 'epoch' here, "
        "attach FlowControl(save_strategy=...), or a plugin whose schedules() has 'save'"
    ]
