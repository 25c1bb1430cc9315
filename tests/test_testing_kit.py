"""The testing kit users get: the trace grammar checker and the loop-config strategy."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine.testing import LoopConfig, TraceError, check_trace, loop_configs, trace_is_valid

STEP = ["STEP_START", "BATCH_START", "LOSS", "BACKWARD_END", "BEFORE_OPTIMIZER_STEP", "OPTIMIZER_STEP", "STEP_END"]
GOOD = [
    "TRAIN_START",
    "EPOCH_START",
    *STEP,
    "LOG",
    "EVAL_START",
    "EVAL_BATCH_END",
    "EVAL_END",
    "SAVE",
    "EPOCH_END",
    "TRAIN_END",
]


def test_good_traces_pass() -> None:
    check_trace(GOOD)
    check_trace(["EVAL_START", "EVAL_END", "PREDICT_START", "PREDICT_BATCH_END", "PREDICT_END"])
    check_trace(["TRAIN_START", "EVAL_START", "EVAL_END", "TRAIN_END"])  # eval on start
    check_trace([])


@pytest.mark.parametrize(
    ("trace", "position", "got"),
    [
        (["EPOCH_START"], 0, "EPOCH_START"),
        (["TRAIN_START", "EPOCH_START", "LOG"], 2, "LOG"),  # no side effect before the first step
        (["TRAIN_START", "EPOCH_START", "STEP_START", "LOSS"], 3, "LOSS"),
        (
            ["TRAIN_START", "EPOCH_START", "STEP_START", "BATCH_START", "LOSS", "BACKWARD_END", "STEP_END"],
            6,
            "STEP_END",
        ),
        (GOOD[:-1], len(GOOD) - 1, "<end>"),
        (["EVAL_START", "EVAL_BATCH_END", "SAVE"], 2, "SAVE"),
    ],
)
def test_bad_traces_report_the_first_offending_position(trace: list[str], position: int, got: str) -> None:
    with pytest.raises(TraceError) as info:
        check_trace(trace)
    assert (info.value.position, info.value.got) == (position, got)


@given(st.data())
def test_removing_any_structural_event_breaks_the_trace(data: st.DataObject) -> None:
    index = data.draw(
        st.sampled_from(
            [i for i, name in enumerate(GOOD) if name not in {"OPTIMIZER_STEP", "LOG", "SAVE", "EVAL_BATCH_END"}]
        )
    )
    broken = GOOD[:index] + GOOD[index + 1 :]
    assert not trace_is_valid(broken)


@given(loop_configs())
def test_configs_are_consistent(config: LoopConfig) -> None:
    assert (config.max_epochs is None) != (config.max_steps is None)
    assert config.batches_per_epoch >= 1
    assert config.expected_steps <= config.planned_steps
