"""Whether a composition can ever record a best checkpoint for LoadBestModelAtEnd (#28 item 6).

A checkpoint is marked best when it is saved at the step of the best evaluation, after that
evaluation (``save_checkpoint`` compares ``state.best_global_step`` with the step). The loop
evaluates before it saves at the same point, but an evaluation at an epoch's end comes after the
save of that epoch's last step: with evaluations per epoch and saves every N steps, or evaluations
every E steps and saves per epoch, or E and N that are not multiples of each other (as transformers
refuses them), a best is never (or only by chance) recorded; the end then loads nothing and
rotation deletes the best step's checkpoint. transformers refuses such arguments
(``load_best_model_at_end requires the save and eval strategy to match``); a bare Engine refuses
the same compositions when fit() starts, naming both schedules and the remedies, instead of saving
at each new best behind the user's back: the save schedule stays the one written, and
``save_strategy="best"`` or ``BestMetric(save_on_best=True)`` is the one-argument remedy.

Only what the built-in plugins declare is judged (FlowControl's strategies, Checkpointing's
``save_strategy`` shortcut, BestMetric's ``save_on_best``); a plugin of the user's own that
schedules saves or evaluations may make up for anything, so then nothing is refused.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from trainbus.engine import ConfigError, Plugin

from ..control.best_model import BestMetric
from ..control.flow import FlowControl

__all__ = ["check_best_schedule"]

#: (strategy, interval in steps or None, who says so) of one evaluation or save schedule
Schedule = tuple[str, Any, str]


def _is(plugin: Plugin, name: str) -> bool:
    """By class name (Checkpointing's module imports this one)."""
    return any(cls.__name__ == name for cls in type(plugin).__mro__)


def _schedules(plugins: Sequence[Plugin]) -> tuple[list[Schedule], list[Schedule], list[Plugin]]:
    """The evaluation and save schedules the built-in plugins declare, and the other plugins that schedule."""
    evals: list[Schedule] = []
    saves: list[Schedule] = []
    others: list[Plugin] = []
    for plugin in plugins:
        if isinstance(plugin, FlowControl):
            if plugin.eval_strategy != "no":
                evals.append((str(plugin.eval_strategy), plugin.eval_steps, "FlowControl eval_strategy"))
            if plugin.save_strategy != "no":
                saves.append((str(plugin.save_strategy), plugin.save_steps, "FlowControl save_strategy"))
        elif _is(plugin, "Checkpointing"):
            if plugin.save_strategy != "no":  # type: ignore[attr-defined]
                saves.append((plugin.save_strategy, plugin.save_steps, "Checkpointing save_strategy"))  # type: ignore[attr-defined]
        elif isinstance(plugin, BestMetric):
            if plugin.save_on_best:
                saves.append(("best", None, "BestMetric save_on_best"))
        elif set(plugin.schedules()) & {"save", "evaluate"}:
            others.append(plugin)
    return evals, saves, others


def _steps(value: Any) -> int | None:
    """An interval in whole steps, or None (a ratio of max_steps is not known before fit(): not judged)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 1 and float(value).is_integer():
        return int(value)
    return None


def _records_a_best(evaluation: Schedule, save: Schedule) -> bool:
    """Whether saves on ``save`` happen right after evaluations on ``evaluation`` (at least once per save or eval)."""
    if save[0] == "best" or evaluation[0] == save[0] == "epoch":
        return True
    if evaluation[0] == save[0] == "steps":
        every, saved = _steps(evaluation[1]), _steps(save[1])
        return every is None or saved is None or saved % every == 0 or every % saved == 0
    return False


def _describe(schedule: Schedule) -> str:
    strategy, every, who = schedule
    when = {"epoch": "at each epoch's end", "steps": f"every {every} steps", "best": "at each new best"}[strategy]
    return f"{when} ({who}={strategy!r})"


def check_best_schedule(plugins: Sequence[Plugin], scheduled: Collection[str]) -> list[str]:
    """A ConfigError when no evaluation schedule and save schedule can meet; the warnings of what is missing."""
    evals, saves, others = _schedules(plugins)
    problems = []
    if not any(isinstance(p, BestMetric) for p in plugins):
        problems.append(
            "no BestMetric is attached, so no step is recorded as the best (state.best_global_step) unless a "
            "handler of yours sets it; attach BestMetric('loss') (or the metric to pick the best by)"
        )
    if not evals and "evaluate" not in scheduled:
        problems.append(
            "nothing schedules an evaluation, so no best is ever found; attach FlowControl(eval_strategy='epoch' "
            "or 'steps')"
        )
    if others or not evals or not saves or any(_records_a_best(e, s) for e in evals for s in saves):
        return problems
    raise ConfigError(
        "LoadBestModelAtEnd can never load a best checkpoint: evaluations run "
        f"{' and '.join(_describe(e) for e in evals)} but checkpoints are saved {' and '.join(map(_describe, saves))}, "
        "never right after an evaluation (the checkpoint of an epoch's last step is written before that epoch's "
        "evaluation), so no checkpoint is marked best and rotation deletes the best step's. Save when evaluations "
        "run (the same strategy; with 'steps', save_steps a multiple of eval_steps or the reverse), or at each new "
        "best: save_strategy='best' (FlowControl or Checkpointing) or BestMetric(save_on_best=True)"
    )
