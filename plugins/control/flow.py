"""FlowControl: turns logging / evaluation / save strategies into Control flags (HF DefaultFlowCallback).

It runs at priority PRODUCER on STEP_END and EPOCH_END, so handlers at DEFAULT (HF callbacks
through the adapter, user handlers) see the flags it set and may still change them.

``SaveSchedule`` is the one owner of *when to save*: FlowControl decides with one, and
``Checkpointing(save_strategy=...)`` on a bare Engine (a shortcut for an Engine without FlowControl)
asks one too; Checkpointing itself only writes on SAVE and rotates.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import ConfigTypeError, check_flag

from .strategies import IntervalStrategy, SaveStrategy, check_strategy

if TYPE_CHECKING:
    from trainbus.engine import Engine, EpochEndEvent, EvalEndEvent, EvalStartEvent, StepEndEvent, TrainStartEvent


def interval(value: float | None, max_steps: int) -> int:
    """An interval in optimizer steps: ``value``, or a float < 1 as a ratio of ``max_steps`` (rounded up, as HF)."""
    if value is None:
        return 0
    return max(1, math.ceil(max_steps * value)) if value < 1 else int(value)


class SaveSchedule:
    """When to save (HF's DefaultFlowCallback rules): sets ``control.should_save``; writes nothing.

    "steps": every ``every`` steps and at the last step; "epoch": at each epoch's end; "best": after
    an evaluation that changed the best metric (compared with the best at its EVAL_START).
    """

    def __init__(self, strategy: SaveStrategy) -> None:
        self.strategy = strategy
        self._best_before: Any = None

    def step_end(self, state: Any, control: Any, every: int) -> None:
        if self.strategy != SaveStrategy.STEPS:
            return
        step = state.global_step
        if (every > 0 and step % every == 0) or step >= state.max_steps:
            control.should_save = True

    def epoch_end(self, control: Any) -> None:
        if self.strategy == SaveStrategy.EPOCH:
            control.should_save = True

    def eval_start(self, state: Any) -> None:
        self._best_before = (state.best_metric, state.best_global_step)

    def eval_end(self, state: Any, control: Any) -> None:
        if self.strategy != SaveStrategy.BEST:
            return
        if state.global_step > 0 and (state.best_metric, state.best_global_step) != self._best_before:
            control.should_save = True  # a new best was just found


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


class FlowControl(Plugin):
    """Sets should_log / should_evaluate / should_save as HF's DefaultFlowCallback does.

    Args:
        logging_strategy, eval_strategy: "no" | "steps" | "epoch".
        save_strategy: "no" | "steps" | "epoch" | "best" (save after each evaluation with a new best metric).
        logging_steps, eval_steps, save_steps: intervals in optimizer steps; a float < 1 is a ratio of max_steps.
        logging_first_step: also log after step 1.
        eval_delay: no evaluation before this many steps (or epochs, with the epoch strategy).
        eval_on_start: evaluate once before the first step (a sanity check of the eval loop).

    At the last step (global_step == max_steps) a "steps" eval strategy evaluates and a "steps" save
    strategy saves, as HF does, so a run always ends with an evaluation and a checkpoint.

    Example:
        >>> from trainbus.plugins.control.flow import FlowControl
        >>> flow = FlowControl(logging_steps=10, eval_strategy="epoch", save_strategy="no")
    """

    priority = Priority.PRODUCER

    def __init__(
        self,
        *,
        logging_strategy: str = "steps",
        logging_steps: float = 500,
        logging_first_step: bool = False,
        eval_strategy: str = "no",
        eval_steps: float | None = None,
        eval_delay: float = 0,
        eval_on_start: bool = False,
        save_strategy: str = "steps",
        save_steps: float = 500,
    ) -> None:
        self.logging_strategy = check_strategy("logging_strategy", logging_strategy, IntervalStrategy)
        self.eval_strategy = check_strategy("eval_strategy", eval_strategy, IntervalStrategy)
        self.save_strategy = check_strategy("save_strategy", save_strategy, SaveStrategy)
        if eval_steps is None and self.eval_strategy == IntervalStrategy.STEPS:
            eval_steps = logging_steps
        for name, value, strategy in (
            ("logging_steps", logging_steps, self.logging_strategy),
            ("eval_steps", eval_steps, self.eval_strategy),
            ("save_steps", save_steps, self.save_strategy),
        ):
            if value is not None and not _is_number(value):
                raise ConfigTypeError(
                    f"{name} must be a number of steps (a float < 1: a ratio of max_steps), got {value!r}"
                )
            if strategy == "steps" and (value is None or not value > 0):
                raise ConfigError(f"{name} must be > 0 with a 'steps' strategy, got {value!r}")
        if not _is_number(eval_delay) or eval_delay < 0:
            raise ConfigError(
                f"eval_delay must be a number >= 0 (steps, or epochs with eval_strategy='epoch'), got {eval_delay!r}"
            )
        check_flag("logging_first_step", logging_first_step)
        check_flag("eval_on_start", eval_on_start)
        self.logging_steps = logging_steps
        self.logging_first_step = logging_first_step
        self.eval_steps = eval_steps
        self.eval_delay = eval_delay
        self.eval_on_start = eval_on_start
        self.save_steps = save_steps
        self.saves = SaveSchedule(self.save_strategy)

    @classmethod
    def from_args(cls, args: Any) -> FlowControl:
        """Build from a ``TrainingArguments`` (or anything with its field names)."""
        return cls(
            logging_strategy=args.logging_strategy,
            logging_steps=args.logging_steps,
            logging_first_step=args.logging_first_step,
            eval_strategy=args.eval_strategy,
            eval_steps=args.eval_steps,
            eval_delay=args.eval_delay,
            eval_on_start=args.eval_on_start,
            save_strategy=args.save_strategy,
            save_steps=args.save_steps,
        )

    def schedules(self) -> set[str]:
        """The Control requests this flow makes: "log" / "evaluate" / "save" unless that strategy is "no"."""
        wanted = {"log": self.logging_strategy, "evaluate": self.eval_strategy, "save": self.save_strategy}
        return {request for request, strategy in wanted.items() if strategy != "no"} | (
            {"evaluate"} if self.eval_on_start else set()
        )

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_START, self.train_start)
        self.on(engine, Event.STEP_END, self.step_end)
        self.on(engine, Event.EPOCH_END, self.epoch_end)
        if self.save_strategy == SaveStrategy.BEST:
            self.on(engine, Event.EVAL_START, self.eval_start)
            # after the best-metric keeper has updated state.best_metric
            self.on(engine, Event.EVAL_END, self.eval_end, priority=Priority.LAST)

    def train_start(self, ev: TrainStartEvent) -> None:
        state = ev.engine.state
        state.logging_steps = interval(self.logging_steps, state.max_steps)
        # without eval_steps HF's TrainerState keeps its default, 500 (in trainer_state.json too)
        state.eval_steps = interval(self.eval_steps, state.max_steps) if self.eval_steps is not None else 500
        state.save_steps = interval(self.save_steps, state.max_steps)
        if self.eval_on_start and ev.engine.eval_data is not None:
            ev.engine.control.should_evaluate = True

    def step_end(self, ev: StepEndEvent) -> None:
        state, control = ev.engine.state, ev.engine.control
        step = state.global_step
        if step == 1 and self.logging_first_step:
            control.should_log = True
        if self.logging_strategy == IntervalStrategy.STEPS and step % state.logging_steps == 0:
            control.should_log = True
        eval_every = state.eval_steps or 0
        steps_eval = self.eval_strategy == IntervalStrategy.STEPS and self.eval_delay <= step
        if steps_eval and step % eval_every == 0:
            control.should_evaluate = True
        self.saves.step_end(state, control, state.save_steps)
        if step >= state.max_steps:
            control.should_training_stop = True
            if steps_eval and step % eval_every != 0:
                control.should_evaluate = True

    def epoch_end(self, ev: EpochEndEvent) -> None:
        state, control = ev.engine.state, ev.engine.control
        if self.logging_strategy == IntervalStrategy.EPOCH:
            control.should_log = True
        if self.eval_strategy == IntervalStrategy.EPOCH and self.eval_delay <= state.epoch:
            control.should_evaluate = True
        self.saves.epoch_end(control)

    def eval_start(self, ev: EvalStartEvent) -> None:
        self.saves.eval_start(ev.engine.state)

    def eval_end(self, ev: EvalEndEvent) -> None:
        self.saves.eval_end(ev.engine.state, ev.engine.control)  # save_strategy="best"
