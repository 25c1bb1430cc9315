"""EarlyStopping stops exactly where the reference function says, also across a resume."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import ConfigError, Engine, Event, Priority
from trainbus.plugins.control.early_stopping import EarlyStopping, early_stop_index

X = torch.randn(6, 3)
TRAIN = [(X[i : i + 2], torch.randn(2, 1)) for i in range(0, 6, 2)]  # 3 steps per epoch


def scripted_engine(
    values: dict[str, Sequence[float]], eval_data: Any, plugin: EarlyStopping, steps: int, start: int = 0
) -> Engine:
    """Evaluates after every step; EVAL_END reports ``{prefix}_score = values[prefix][evaluation index]``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        train_data=TRAIN,
        eval_data=eval_data,
        max_steps=steps,
        loss_fn=torch.nn.MSELoss(),
        plugins=[plugin],
    )
    engine.on(Event.STEP_END, lambda ev: setattr(ev.engine.control, "should_evaluate", True))
    calls = dict.fromkeys(values, start)

    def produce(ev: Any) -> None:
        ev.metrics[f"{ev.prefix}_score"] = values[ev.prefix][calls[ev.prefix]]
        calls[ev.prefix] += 1

    engine.on(Event.EVAL_END, produce, priority=Priority.PRODUCER)
    return engine


values_st = st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0, math.nan]), min_size=1, max_size=10)
config_st = st.tuples(st.integers(1, 3), st.sampled_from([0.0, 0.3]), st.booleans())


@given(values_st, config_st)
def test_stops_where_reference_says(values: list[float], config: tuple[int, float, bool]) -> None:
    patience, threshold, greater = config
    stopper = EarlyStopping("score", patience=patience, threshold=threshold, greater_is_better=greater)
    state = scripted_engine({"eval": values}, [X[:2]], stopper, len(values)).fit()
    index = early_stop_index(values, patience, threshold, greater)
    assert state.global_step == (len(values) if index is None else index + 1)


@given(values_st, config_st, st.integers(1, 9))
def test_resume_stops_at_the_same_step(values: list[float], config: tuple[int, float, bool], cut: int) -> None:
    patience, threshold, greater = config
    cut = min(cut, len(values))
    first = scripted_engine({"eval": values}, [X[:2]], EarlyStopping("score", patience, threshold, greater), cut)
    first.fit()
    saved = json.loads(json.dumps(first.state_dict()))  # what a checkpoint keeps: JSON
    index = early_stop_index(values, patience, threshold, greater)
    if first.control.should_training_stop:
        assert index is not None and first.state.global_step == index + 1
        return
    resumed = scripted_engine(
        {"eval": values}, [X[:2]], EarlyStopping("score", patience, threshold, greater), len(values), start=cut
    )
    resumed.load_state_dict(saved)
    state = resumed.fit()
    assert state.global_step == (len(values) if index is None else index + 1)


def test_only_the_named_set_counts() -> None:
    # set a never improves, set b improves every time: watching b never stops
    a, b = [1.0] * 6, [float(i) for i in range(6)]
    sets = {"a": [X[:2]], "b": [X[2:4]]}
    state = scripted_engine({"eval_a": a, "eval_b": b}, sets, EarlyStopping("b_score", patience=1), 6).fit()
    assert state.global_step == 6
    state = scripted_engine({"eval_a": a, "eval_b": b}, sets, EarlyStopping("a_score", patience=2), 6).fit()
    assert state.global_step == 3


def test_loss_is_lower_is_better_by_default() -> None:
    stopper = EarlyStopping()
    assert stopper.key == "eval_loss" and stopper.greater_is_better is False


def test_state_dict_round_trip() -> None:
    stopper = EarlyStopping("score", patience=3)
    stopper.best, stopper.waited = 0.5, 2
    other = EarlyStopping("score", patience=3)
    other.load_state_dict(json.loads(json.dumps(stopper.state_dict())))
    assert (other.best, other.waited) == (0.5, 2)


def test_bad_input() -> None:
    with pytest.raises(ConfigError, match="patience must be an integer >= 1, got 0"):
        EarlyStopping(patience=0)
    with pytest.raises(ConfigError, match="threshold must be a finite number >= 0"):
        EarlyStopping(threshold=-1.0)
    engine = scripted_engine({"eval": [1.0]}, [X[:2]], EarlyStopping("accuracy"), 1)
    with pytest.raises(ConfigError, match=r"'eval_accuracy' is not among .*eval_score"):
        engine.fit()


def test_reference_examples() -> None:
    assert early_stop_index([1.0, 1.0], patience=1) == 1  # a tie is no improvement
    assert early_stop_index([math.nan, 1.0, 0.5], patience=2) is None  # NaN first: waits, then 1.0 is best
    assert early_stop_index([math.nan, math.nan], patience=2) == 1
    assert early_stop_index([1.0, 1.2, 1.25], patience=2, threshold=0.3) == 2
    assert early_stop_index([1.0, 0.5, 0.4], patience=1, greater_is_better=False) is None
