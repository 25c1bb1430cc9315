"""A step function's run obeys its grammar and the step arithmetic, for any loop shape (#35 item 2)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbus.engine import Engine, Event
from trainbus.engine.testing import EventRecorder, TraceError, check_trace


def _engine(items: int, batch: int, epochs: int | None, max_steps: int | None, *, steps: tuple[str, ...],
            fail_at: int | None = None, stop_at: int | None = None) -> tuple[Engine, EventRecorder]:  # fmt: skip
    torch.manual_seed(0)
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    data = [(torch.randn(min(batch, items - i), 2),) for i in range(0, items, batch)]

    def step(engine: Any, batch_: Any) -> dict[str, torch.Tensor]:
        (x,) = batch_
        if fail_at is not None and engine.state.global_step + 1 == fail_at:
            a(x).pow(2).mean().backward()  # gradients half made, then the failure
            raise RuntimeError("planted")
        for name in steps:
            engine.step_optimizer(name, (a if name == "a" else b)(x).pow(2).mean())
        return {}

    recorder = EventRecorder()
    engine = Engine(torch.nn.ModuleDict({"a": a, "b": b}), {"a": torch.optim.SGD(a.parameters(), 0.1),
                    "b": torch.optim.SGD(b.parameters(), 0.1)}, train_data=data, max_epochs=epochs,
                    max_steps=max_steps, step=step, plugins=[recorder])  # fmt: skip
    if stop_at is not None:
        engine.on(Event.STEP_END, lambda ev: setattr(ev.engine.control, "should_training_stop",
                                                     ev.engine.state.global_step >= stop_at))  # fmt: skip
    return engine, recorder


@settings(max_examples=30, deadline=None)
@given(
    items=st.integers(1, 9),
    batch=st.integers(1, 4),
    epochs=st.integers(1, 3),
    max_steps=st.one_of(st.none(), st.integers(1, 8)),
    steps=st.lists(st.sampled_from(["a", "b"]), max_size=3).map(tuple),
    veto=st.booleans(),
    stop_at=st.one_of(st.none(), st.integers(1, 6)),
)
def test_any_loop_shape_gives_a_trace_of_the_grammar_and_its_steps(
    items: int, batch: int, epochs: int, max_steps: int | None, steps: tuple[str, ...], veto: bool, stop_at: int | None
) -> None:
    engine, recorder = _engine(items, batch, epochs, max_steps, steps=steps, stop_at=stop_at)
    if veto:
        engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: setattr(ev, "skip", ev.optimizer == "a"))
    state = engine.fit()
    check_trace(recorder.names, step_function=True)
    per_epoch = math.ceil(items / batch)
    planned = max_steps if max_steps is not None else epochs * per_epoch
    assert state.global_step == min(planned, stop_at or planned)
    assert recorder.names.count("BEFORE_OPTIMIZER_STEP") == len(steps) * state.global_step
    stepping = [s for s in steps if not (veto and s == "a")]
    assert recorder.names.count("OPTIMIZER_STEP") == len(stepping) * state.global_step
    assert state.optimizer_steps_taken == (state.global_step if stepping else 0)
    with pytest.raises(TraceError):  # the loop's own grammar has LOSS / BACKWARD_END in every window
        check_trace(recorder.names)


def test_a_failing_step_function_closes_the_run_and_keeps_the_last_completed_step() -> None:
    engine, recorder = _engine(8, 2, 2, None, steps=("a", "b"), fail_at=3)
    with pytest.raises(RuntimeError, match="planted"):
        engine.fit()
    check_trace(recorder.names, step_function=True)
    assert recorder.names[-3:] == ["EXCEPTION", "EPOCH_END", "TRAIN_END"]
    assert engine.state.global_step == 2 and engine.state.optimizer_steps_taken == 2
    assert all(p.grad is None for p in engine.model.parameters())  # zeroed: nothing carried into a retry
