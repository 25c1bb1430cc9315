"""BestMetric: state.best_metric / best_global_step, direction from the name, named eval sets, errors."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import ConfigError, Engine, Event, Priority
from trainbus.plugins.control.best_model import (
    BestMetric,
    check_metric_key,
    eval_prefixes,
    expected_keys,
    greater_is_better_for,
    is_improvement,
    resolve_metric_key,
)
from trainbus.plugins.evaluation.collector import EvalCollector, EvalPrediction

X = torch.randn(8, 3)
TRAIN = [(X[:4], torch.randn(4, 1)), (X[4:], torch.randn(4, 1))]


def scripted_engine(
    values: dict[str, Sequence[float]], eval_data: Any, plugins: Sequence[Any], steps: int
) -> tuple[Engine, list[int]]:
    """An engine that evaluates after every step; EVAL_END metrics ``{prefix}_score`` come from ``values``."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        train_data=TRAIN,
        eval_data=eval_data,
        max_steps=steps,
        loss_fn=torch.nn.MSELoss(),
        plugins=plugins,
    )
    engine.on(Event.STEP_END, lambda ev: setattr(ev.engine.control, "should_evaluate", True))
    calls: dict[str, int] = {}
    evaluated_at: list[int] = []

    def produce(ev: Any) -> None:
        i = calls.get(ev.prefix, 0)
        calls[ev.prefix] = i + 1
        ev.metrics[f"{ev.prefix}_score"] = values[ev.prefix][i]
        ev.metrics[f"{ev.prefix}_loss"] = 1.0
        evaluated_at.append(ev.engine.state.global_step)

    engine.on(Event.EVAL_END, produce, priority=Priority.PRODUCER)
    return engine, evaluated_at


def reference_best(values: Sequence[float], greater: bool) -> tuple[float | None, int | None]:
    """(best value, 1-based index of its first occurrence), NaN never best."""
    best: tuple[float | None, int | None] = (None, None)
    for i, v in enumerate(values, start=1):
        if math.isnan(v):
            continue
        if best[0] is None or (v > best[0] if greater else v < best[0]):
            best = (v, i)
    return best


metric_values = st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, math.nan]), min_size=1, max_size=8)


@given(metric_values, st.booleans())
def test_best_metric_matches_reference(values: list[float], greater: bool) -> None:
    plugin = BestMetric("score", greater_is_better=greater)
    engine, steps = scripted_engine({"eval": values}, [X[:2]], [plugin], len(values))
    state = engine.fit()
    assert steps == list(range(1, len(values) + 1))
    best, step = reference_best(values, greater)
    assert state.best_metric == best and state.best_global_step == step


@given(metric_values, metric_values)
def test_named_set_decides(a: list[float], b: list[float]) -> None:
    steps = min(len(a), len(b))
    plugin = BestMetric("b_score", greater_is_better=True)
    engine, _ = scripted_engine({"eval_a": a, "eval_b": b}, {"a": [X[:2]], "b": [X[2:4]]}, [plugin], steps)
    state = engine.fit()
    assert (state.best_metric, state.best_global_step) == reference_best(b[:steps], True)


def test_dict_of_eval_sets_with_compute_metrics_keys() -> None:
    def mean_label(p: EvalPrediction) -> dict[str, float]:
        return {"mean_label": float(p.label_ids.mean())}

    sets = {"low": [(X[:4], torch.zeros(4, 1))], "high": [(X[4:], torch.ones(4, 1))]}
    plugin = BestMetric("high_mean_label")
    engine, _ = scripted_engine(
        {"eval_low": [0.0] * 3, "eval_high": [0.0] * 3}, sets, [EvalCollector(mean_label), plugin], 2
    )
    metrics = engine.evaluate()
    assert metrics["eval_low_mean_label"] == 0.0 and metrics["eval_high_mean_label"] == 1.0
    assert {"eval_low_loss", "eval_high_loss", "eval_high_runtime"} <= set(metrics)
    engine.fit()
    assert engine.state.best_metric == 1.0 and engine.state.best_global_step == 1


def test_missing_metric_lists_keys() -> None:
    engine, _ = scripted_engine({"eval": [1.0]}, [X[:2]], [BestMetric("acuracy")], 1)
    with pytest.raises(ConfigError, match=r"'eval_acuracy' is not among .*eval_loss, eval_score"):
        engine.fit()
    sets = {"a": [X[:2]], "b": [X[2:4]]}
    engine, _ = scripted_engine({"eval_a": [1.0], "eval_b": [1.0]}, sets, [BestMetric("c_score")], 1)
    with pytest.raises(ConfigError, match=r"'eval_c_score' is not among.*eval sets: eval_a, eval_b"):
        engine.fit()
    engine, _ = scripted_engine({"eval_a": [1.0], "eval_b": [1.0]}, sets, [BestMetric("loss")], 1)
    with pytest.raises(ConfigError, match="eval_a_loss"):
        engine.fit()


def test_evaluate_outside_fit_leaves_best_alone() -> None:
    engine, _ = scripted_engine({"eval": [3.0], "test": [1.0]}, [X[:2]], [BestMetric("score")], 1)
    engine.evaluate([X[:2]], prefix="test")  # another prefix, outside training: neither error nor update
    assert engine.state.best_metric is None


def test_save_on_best_requests_a_checkpoint() -> None:
    plugin = BestMetric("score", greater_is_better=True, save_on_best=True)
    engine, _ = scripted_engine({"eval": [1.0, 0.5, 2.0]}, [X[:2]], [plugin], 3)
    saves: list[int] = []
    engine.on(Event.SAVE, lambda ev: saves.append(ev.engine.state.global_step))
    engine.fit()
    assert saves == [1, 3]


def test_names_and_directions() -> None:
    assert resolve_metric_key("loss") == "eval_loss"
    assert resolve_metric_key("eval_loss") == "eval_loss"
    assert resolve_metric_key("valid_f1") == "eval_valid_f1"
    assert resolve_metric_key("accuracy", "test") == "test_accuracy"
    for lower in ("loss", "eval_loss", "eval_valid_loss", "eval_nll_loss", "eval_wer", "mean_squared_error", "ppl"):
        assert not greater_is_better_for(lower), lower
    for higher in ("accuracy", "eval_f1", "eval_valid_accuracy", "bleu", "eval_lossless_ratio"):
        assert greater_is_better_for(higher), higher
    assert BestMetric("valid_loss").greater_is_better is False
    assert BestMetric("valid_loss", greater_is_better=True).greater_is_better is True


def test_is_improvement() -> None:
    assert is_improvement(1.0, None, True)
    assert not is_improvement(math.nan, None, True)
    assert not is_improvement(1.0, 1.0, True) and not is_improvement(1.0, 1.0, False)
    assert is_improvement(0.5, 1.0, False) and not is_improvement(0.5, 1.0, True)
    assert not is_improvement(1.05, 1.0, True, threshold=0.1) and is_improvement(1.2, 1.0, True, threshold=0.1)


def test_up_front_validation_helpers() -> None:
    assert eval_prefixes({"a": [], "b": []}) == ["eval_a", "eval_b"]
    keys = expected_keys({"a": [], "b": []}, ["accuracy"])
    assert "eval_a_accuracy" in keys and "eval_b_loss" in keys and "eval_loss" not in keys
    assert check_metric_key("a_accuracy", keys) == "eval_a_accuracy"
    assert expected_keys([1], ["eval_f1", "f1"]).count("eval_f1") == 2  # as compute_metrics keys are prefixed
    with pytest.raises(ConfigError, match=r"did you mean 'eval_a_accuracy'.*available keys: eval_a_accuracy"):
        check_metric_key("a_acuracy", keys)
    with pytest.raises(ConfigError, match="non-empty string"):
        resolve_metric_key("")


# -- a damaged best checkpoint (#23 item 3) --------------------------------------------------------
def _checkpointed_run(output_dir: Any, steps: int = 3) -> Engine:
    from trainbus.plugins.checkpoints.checkpoint import Checkpointing, LoadBestModelAtEnd

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=TRAIN, max_steps=steps,
        loss_fn=torch.nn.MSELoss(),
        plugins=[Checkpointing(output_dir, save_strategy="steps", save_steps=1), LoadBestModelAtEnd()],
    )  # fmt: skip


def _flip(path: Any) -> None:
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_damaged_best_checkpoint_at_the_end_warns_and_keeps_the_runs_weights(tmp_path: Any) -> None:
    from types import SimpleNamespace

    from trainbus.plugins.checkpoints import io as cio
    from trainbus.plugins.checkpoints.checkpoint import LoadBestModelAtEnd

    engine = _checkpointed_run(tmp_path)
    engine.fit()
    best = tmp_path / "checkpoint-1"
    best_weights = cio.read_tensors(best / "model.safetensors", owned=True)
    engine.state.best_model_checkpoint = str(best)
    own = {k: v.clone() for k, v in engine.model.state_dict().items()}
    _flip(best / "model.safetensors")
    with pytest.warns(UserWarning, match=r"best checkpoint .*checkpoint-1 cannot be loaded .*keeping the run's own"):
        LoadBestModelAtEnd().load(SimpleNamespace(engine=engine))
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in own.items())
    _flip(best / "model.safetensors")  # intact again: loaded
    LoadBestModelAtEnd().load(SimpleNamespace(engine=engine))
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in best_weights.items())
    # a best checkpoint that does not fit the model: warned, and not one tensor copied
    other = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    engine.model = other
    with pytest.warns(UserWarning, match=r"cannot be loaded .*does not fit the model"):
        LoadBestModelAtEnd().load(SimpleNamespace(engine=engine))
    assert all(torch.equal(other.state_dict()[k], v) for k, v in before.items())


def test_a_resume_checks_the_best_checkpoint_it_will_load_at_the_end(tmp_path: Any) -> None:
    from trainbus.plugins.checkpoints.checkpoint import resume, save_checkpoint

    engine = _checkpointed_run(tmp_path, steps=2)
    engine.fit()
    engine.state.best_global_step = engine.state.global_step = 2
    save_checkpoint(engine, tmp_path)  # checkpoint-2 is the best; then the run goes on to 3
    engine.state.global_step = 3
    save_checkpoint(engine, tmp_path)
    _flip(tmp_path / "checkpoint-2" / "model.safetensors")
    resumed = _checkpointed_run(tmp_path, steps=4)
    with pytest.warns(UserWarning, match=r"best checkpoint .*checkpoint-2 is damaged .*keep its own weights"):
        assert resume(resumed, True, tmp_path) == tmp_path / "checkpoint-3"
    assert resumed.state.best_model_checkpoint is None
    resumed.fit()  # and the end does not fail on it
    intact = _checkpointed_run(tmp_path, steps=4)
    _flip(tmp_path / "checkpoint-2" / "model.safetensors")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resume(intact, tmp_path / "checkpoint-3")
    assert intact.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
