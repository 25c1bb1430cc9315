"""TrainingArguments' schedule checks: step intervals and what load_best_model_at_end needs (``arguments.py``)."""

from __future__ import annotations

from typing import Any

from trainbus.engine import ConfigError

from ..control.strategies import IntervalStrategy, SaveStrategy


def check_steps(args: Any) -> None:
    """Step intervals: eval_steps falls back to logging_steps; a *_steps > 1 must be a whole number."""
    if args.eval_strategy == IntervalStrategy.STEPS and not args.eval_steps:
        if args.logging_steps > 0:
            args.eval_steps = args.logging_steps  # HF falls back to logging_steps
        else:
            raise ConfigError("eval_strategy='steps' needs eval_steps > 0 or logging_steps > 0")
    for name, strategy in (
        ("logging_steps", args.logging_strategy),
        ("eval_steps", args.eval_strategy),
        ("save_steps", args.save_strategy),
    ):
        value = getattr(args, name)
        if strategy != "steps":
            continue
        if value is None or not value > 0:
            raise ConfigError(f"{name} must be > 0 with {name.replace('steps', 'strategy')}='steps', got {value!r}")
        if value > 1:
            if value != int(value):
                raise ConfigError(f"{name} must be an integer when > 1 (a float < 1 is a ratio), got {value!r}")
            setattr(args, name, int(value))


def check_best_model(args: Any) -> None:
    """metric_for_best_model / greater_is_better defaults, and the schedules load_best_model_at_end needs."""
    if args.load_best_model_at_end and args.metric_for_best_model is None:
        args.metric_for_best_model = "loss"
    if args.greater_is_better is None and args.metric_for_best_model is not None:
        args.greater_is_better = not args.metric_for_best_model.endswith("loss")
    if args.save_strategy == SaveStrategy.BEST and args.metric_for_best_model is None:
        raise ConfigError(  # transformers' words first: scripts and tests match them
            "`args.metric_for_best_model` must be provided when using 'best' save_strategy: "
            "save_strategy='best' saves when that metric improves (e.g. metric_for_best_model='loss' or 'accuracy')"
        )
    if not args.load_best_model_at_end or args.save_strategy == SaveStrategy.BEST:
        return
    if args.eval_strategy == IntervalStrategy.NO:
        raise ConfigError("load_best_model_at_end=True needs an eval_strategy other than 'no'")
    evals, saves = IntervalStrategy(args.eval_strategy).value, SaveStrategy(args.save_strategy).value
    if evals != saves:
        raise ConfigError(
            "load_best_model_at_end requires the save and eval strategy to match (or save_strategy='best'), "
            f"got eval_strategy={evals!r}, save_strategy={saves!r}"
        )
    if args.eval_strategy == IntervalStrategy.STEPS:
        assert args.eval_steps is not None
        ratio = args.save_steps / args.eval_steps
        if abs(ratio - round(ratio)) > 1e-9 or round(ratio) < 1:
            raise ConfigError(
                "load_best_model_at_end requires save_steps to be a multiple of eval_steps, "
                f"got save_steps={args.save_steps}, eval_steps={args.eval_steps}"
            )
