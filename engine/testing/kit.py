"""The kit's loop tools: record events, check the grammar, generate loop configs, build toy engines
(re-exported by ``trainbus.engine.testing``, whose docstring shows them at work)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from ..bus import Priority
from ..events import END_EVENTS, Event
from ..loop import Engine
from ..payloads import NamedBeforeOptimizerStepEvent, NamedOptimizerStepEvent
from ..plugin import Plugin


class EventRecorder(Plugin):
    """Records the name of every event fired (and optionally the payloads).

    Runs first at every event (priority FIRST + 1) so it sees the order of firing.
    """

    priority = Priority.FIRST + 1

    def __init__(self, keep_payloads: bool = False) -> None:
        self.names: list[str] = []
        self.payloads: list[Any] = []
        self.keep_payloads = keep_payloads

    def attach(self, engine: Engine) -> None:
        for event in Event.ALL:  # cleanup on the ENDs: record them on the failure path too
            self.on(engine, event, self._record, cleanup=event in END_EVENTS)

    def _record(self, payload: Any) -> None:
        self.names.append(_EVENT_OF_PAYLOAD[type(payload)])
        if self.keep_payloads:
            self.payloads.append(payload)

    def clear(self) -> None:
        self.names.clear()
        self.payloads.clear()


_EVENT_OF_PAYLOAD = {event.payload_type: event.name for event in Event.ALL}
_EVENT_OF_PAYLOAD[NamedBeforeOptimizerStepEvent] = "BEFORE_OPTIMIZER_STEP"  # a step function's steps
_EVENT_OF_PAYLOAD[NamedOptimizerStepEvent] = "OPTIMIZER_STEP"


class TraceError(AssertionError):
    """A trace broke the grammar; ``position`` is the index of the first offending event."""

    def __init__(self, position: int, got: str, expected: Sequence[str], trace: Sequence[str]) -> None:
        context = " ".join(trace[max(0, position - 4) : position + 1])
        super().__init__(
            (
                f"event #{position} is {got}, expected one of {sorted(expected)} (…{context})"
                if got != "<end>"
                else f"trace ended after event #{position - 1}; expected one of {sorted(expected)} (…{context})"
            )
            + ". The loop fires these in order; a handler that calls engine.evaluate() / predict() / log() / fit() "
            "breaks it: ask through engine.control instead (should_evaluate, should_log, should_save, "
            "should_training_stop), which the loop acts on after STEP_END. A recorder attached to two engines "
            "mixes their traces"
        )
        self.position = position
        self.got = got
        self.expected = tuple(expected)


# A deterministic automaton for the grammar. A state is a name, plus for eval / predict blocks
# the state to return to. Transitions: state -> {event: next state}.
_SIDE_OPENERS = {"LOG": None, "SAVE": None, "EVAL_START": "EVAL"}
_TRANSITIONS: dict[str, dict[str, str]] = {
    "TOP": {"TRAIN_START": "TRAIN", "PREDICT_START": "PREDICT"},
    "TRAIN": {"EPOCH_START": "EPOCH0", "TRAIN_END": "TOP"},  # + side effects
    "EPOCH0": {"STEP_START": "WINDOW0", "EPOCH_END": "TRAIN"},  # just after EPOCH_START: no side effects
    "EPOCH1": {"STEP_START": "WINDOW0", "EPOCH_END": "TRAIN"},  # after STEP_END: + side effects
    "WINDOW0": {"BATCH_START": "MICRO1"},
    "MICRO1": {"LOSS": "MICRO2"},
    "MICRO2": {"BACKWARD_END": "MICRO3"},
    "MICRO3": {"BATCH_START": "MICRO1", "BEFORE_OPTIMIZER_STEP": "OPT0"},
    "OPT0": {"OPTIMIZER_STEP": "OPT1", "STEP_END": "EPOCH1"},
    "OPT1": {"STEP_END": "EPOCH1"},
}
#: a step function's window (``Engine(..., step=fn)``): one batch, then each ``engine.step_optimizer`` call
_USER_STEP: dict[str, dict[str, str]] = {
    "MICRO1": {"BEFORE_OPTIMIZER_STEP": "USER0", "STEP_END": "EPOCH1"},
    "USER0": {"OPTIMIZER_STEP": "USER1", "BEFORE_OPTIMIZER_STEP": "USER0", "STEP_END": "EPOCH1"},
    "USER1": {"BEFORE_OPTIMIZER_STEP": "USER0", "STEP_END": "EPOCH1"},
}
_ALLOWS_SIDE = {"TOP", "TRAIN", "EPOCH1"}
#: the ENDs still open in a state of the automaton, innermost first (what a failure there closes)
_OPEN_ENDS = {"TOP": (), "TRAIN": ("TRAIN_END",)}
_TOP_LEVEL_ENDS = ("TRAIN_END", "EVAL_END", "PREDICT_END")


def _closing(state: str, block: str | None, block_return: str | None) -> list[str]:
    """The ENDs a failure in this automaton state closes, innermost first."""
    ends = ["EVAL_END"] if block == "EVAL" else ["PREDICT_END"] if block == "PREDICT" else []
    outer = (block_return or "TOP") if block == "EVAL" else "TOP" if block == "PREDICT" else state
    return ends + list(_OPEN_ENDS.get(outer, ("EPOCH_END", "TRAIN_END")))


def check_trace(trace: Sequence[str], *, step_function: bool = False) -> None:
    """Raise TraceError at the first event that breaks the grammar (see the module docstring).

    ``step_function=True``: the trace of an ``Engine(..., step=fn)``, whose windows are
    ``STEP_START BATCH_START (BEFORE_OPTIMIZER_STEP OPTIMIZER_STEP?)* STEP_END`` (one per ``step_optimizer`` call).
    """
    transitions = _TRANSITIONS if not step_function else {**_TRANSITIONS, **_USER_STEP}
    state = "TOP"
    block_return: str | None = None  # where an EVAL / PREDICT block returns to
    block: str | None = None
    closing: list[str] | None = None  # after EXCEPTION: the ENDs that must follow, in order
    for position, name in enumerate(trace):
        if closing:
            if name != closing[0]:
                raise TraceError(position, name, [closing[0]], trace)
            closing.pop(0)
            continue
        if name == "EXCEPTION":
            if state == "TOP" and block is None and (position == 0 or trace[position - 1] not in _TOP_LEVEL_ENDS):
                raise TraceError(position, name, ["TRAIN_START", "EVAL_START", "PREDICT_START", "LOG", "SAVE"], trace)
            closing = _closing(state, block, block_return)
            state, block, block_return = "TOP", None, None
            continue
        if block == "EVAL":
            if name == "EVAL_BATCH_END":
                continue
            if name == "EVAL_END":
                block, state = None, block_return or "TOP"
                continue
            raise TraceError(position, name, ["EVAL_BATCH_END", "EVAL_END"], trace)
        if block == "PREDICT":
            if name == "PREDICT_BATCH_END":
                continue
            if name == "PREDICT_END":
                block, state = None, "TOP"
                continue
            raise TraceError(position, name, ["PREDICT_BATCH_END", "PREDICT_END"], trace)
        allowed = dict(transitions[state])
        if state in _ALLOWS_SIDE:
            allowed.update({"LOG": state, "SAVE": state, "EVAL_START": state})
        if name not in allowed:
            raise TraceError(position, name, list(allowed), trace)
        if name == "EVAL_START":
            block, block_return = "EVAL", state
        elif name == "PREDICT_START":
            block = "PREDICT"
        else:
            state = allowed[name]
    if closing:
        raise TraceError(len(trace), "<end>", [closing[0]], trace)
    if block is not None or state != "TOP":
        expected = (
            ["EVAL_END"] if block == "EVAL" else ["PREDICT_END"] if block == "PREDICT" else list(transitions[state])
        )
        raise TraceError(len(trace), "<end>", expected, trace)


def trace_is_valid(trace: Sequence[str], *, step_function: bool = False) -> bool:
    try:
        check_trace(trace, step_function=step_function)
    except TraceError:
        return False
    return True


@dataclass(frozen=True)
class LoopConfig:
    """A loop shape to test: data size, batch size, accumulation, length, and where to stop."""

    dataset_size: int
    batch_size: int
    accumulation_steps: int
    max_epochs: int | None
    max_steps: int | None
    stop_at_step: int | None  # a handler requests should_training_stop at this global step
    drop_last: bool = False

    @property
    def batches_per_epoch(self) -> int:
        if self.drop_last:
            return self.dataset_size // self.batch_size
        return math.ceil(self.dataset_size / self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.batches_per_epoch / self.accumulation_steps)

    @property
    def planned_steps(self) -> int:
        """Steps without a stop request: max_steps when set, else epochs x steps per epoch."""
        if self.max_steps is not None:
            return self.max_steps
        assert self.max_epochs is not None
        return self.max_epochs * self.steps_per_epoch

    @property
    def expected_steps(self) -> int:
        """The global_step a run of this config ends at."""
        planned = self.planned_steps
        return planned if self.stop_at_step is None else min(planned, self.stop_at_step)


@st.composite
def loop_configs(
    draw: st.DrawFn,
    max_dataset_size: int = 40,
    max_batch_size: int = 8,
    max_accumulation: int = 4,
    max_epochs: int = 3,
    max_steps: int = 25,
) -> LoopConfig:
    """Hypothesis strategy over loop shapes: sizes, accumulation, epochs or max_steps, a stop point."""
    batch_size = draw(st.integers(1, max_batch_size))
    drop_last = draw(st.booleans())
    dataset_size = draw(st.integers(batch_size if drop_last else 1, max_dataset_size))
    accumulation = draw(st.integers(1, max_accumulation))
    by_steps = draw(st.booleans())
    epochs = None if by_steps else draw(st.integers(1, max_epochs))
    steps = draw(st.integers(1, max_steps)) if by_steps else None
    stop = draw(st.none() | st.integers(1, max_steps))
    return LoopConfig(dataset_size, batch_size, accumulation, epochs, steps, stop, drop_last)


class StopAtStep(Plugin):
    """Requests should_training_stop at STEP_END of a given global step."""

    def __init__(self, step: int) -> None:
        self.step = step

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.STEP_END, self._check)

    def _check(self, ev: Any) -> None:
        if ev.engine.state.global_step == self.step:
            ev.engine.control.should_training_stop = True


def toy_data(config: LoopConfig, features: int = 3, dtype: torch.dtype = torch.float32, seed: int = 0) -> Any:
    """A DataLoader of (x, y) regression pairs shaped by ``config``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(config.dataset_size, features, generator=generator, dtype=dtype)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(config.dataset_size, 1, generator=generator, dtype=dtype)
    dataset = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(dataset, batch_size=config.batch_size, drop_last=config.drop_last)


def toy_engine(config: LoopConfig, plugins: Sequence[Plugin] = (), lr: float = 0.01, **engine_kwargs: Any) -> Engine:
    """An Engine training a linear model on ``toy_data(config)``, with a StopAtStep when configured."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    all_plugins = list(plugins)
    if config.stop_at_step is not None:
        all_plugins.append(StopAtStep(config.stop_at_step))
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        train_data=toy_data(config),
        max_epochs=config.max_epochs,
        max_steps=config.max_steps,
        loss_fn=torch.nn.MSELoss(),
        plugins=all_plugins,
        **engine_kwargs,
    )
    engine.accumulation_steps = config.accumulation_steps
    # a toy engine has no logger on purpose: engine.log() keeps records in state.log_history, where tests read
    # them, without the warning a real run gets (it would print once per hypothesis example)
    engine._log_warned = True
    return engine


__all__ = [
    "EventRecorder",
    "LoopConfig",
    "StopAtStep",
    "TraceError",
    "check_trace",
    "loop_configs",
    "toy_data",
    "toy_engine",
    "trace_is_valid",
]
