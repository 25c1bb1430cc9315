"""The Trainer facade behaves as HF's where users notice: metric checks, control flags, rotation, overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.facade_helpers import Regressor, quiet_args, regression_data
from trainbus.engine import ConfigError
from trainbus.plugins import Trainer, TrainerCallback
from trainbus.plugins.checkpoints.checkpoint import list_checkpoints


class CountingMetrics:
    """A stateful compute_metrics that also draws from the global torch RNG (as sampling metrics do)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, p: Any) -> dict[str, float]:
        self.calls += 1
        torch.rand(1)
        return {"neg_mse": -float(((p.predictions - p.label_ids) ** 2).mean()), "call": float(self.calls)}


def _eval_args(tmp_path: Path, **kwargs: Any) -> Any:
    defaults: dict[str, Any] = {"max_steps": 4, "eval_strategy": "steps", "eval_steps": 2, "learning_rate": 0.1}
    defaults.update(kwargs)
    return quiet_args(tmp_path, **defaults)


def test_metric_for_best_model_calls_no_user_code_before_the_first_evaluation(tmp_path: Path) -> None:
    def run(**kwargs: Any) -> tuple[CountingMetrics, list[torch.Tensor], dict[str, Any]]:
        metrics = CountingMetrics()
        torch.manual_seed(0)
        trainer = Trainer(
            Regressor(),
            _eval_args(tmp_path / str(len(kwargs)), **kwargs),
            train_dataset=regression_data(16),
            eval_dataset=regression_data(8, seed=1),
            compute_metrics=metrics,
        )
        trainer.train()
        return metrics, [p.detach().clone() for p in trainer.model.parameters()], trainer.evaluate()

    plain_metrics, plain_params, _ = run()
    best_metrics, best_params, last = run(metric_for_best_model="neg_mse")
    assert best_metrics.calls == plain_metrics.calls == 3  # one per evaluation (2 in train), none before
    assert last["eval_call"] == 3.0  # the first evaluation saw the first value of the stateful metric
    for a, b in zip(plain_params, best_params, strict=True):
        assert torch.equal(a, b)  # merely naming a metric does not change the run (global RNG untouched)


def test_a_metric_compute_metrics_lacks_fails_at_the_first_evaluation_naming_the_keys(tmp_path: Path) -> None:
    args = _eval_args(tmp_path, metric_for_best_model="accuracy", save_strategy="steps", save_steps=2)
    metrics = CountingMetrics()
    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=regression_data(16),
        eval_dataset=regression_data(8, seed=1),
        compute_metrics=metrics,
    )
    with pytest.raises(ConfigError, match=r"eval_accuracy.*not among.*eval_neg_mse"):
        trainer.train()
    assert metrics.calls == 1 and trainer.state.global_step == 2
    assert trainer.state.best_metric is None
    assert list_checkpoints(tmp_path) == []  # the failing evaluation came before its step's save


def test_a_metric_trainbus_cannot_produce_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"eval_los'.*did you mean 'eval_loss'"):
        Trainer(
            Regressor(),
            _eval_args(tmp_path, metric_for_best_model="eval_los"),
            train_dataset=regression_data(16),
            eval_dataset=regression_data(8, seed=1),
        )


class RaiseFlagAt(TrainerCallback):
    """Sets one control flag at the end of the given steps, as a user's callback does."""

    def __init__(self, flag: str, steps: set[int]) -> None:
        self.flag, self.steps = flag, steps

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step in self.steps:
            setattr(control, self.flag, True)


def test_control_flags_a_callback_sets_are_honoured_when_the_strategies_say_no(tmp_path: Path) -> None:
    args = quiet_args(tmp_path, max_steps=4, save_strategy="no", eval_strategy="no", logging_strategy="no")
    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=regression_data(16),
        eval_dataset=regression_data(8, seed=1),
        callbacks=[
            RaiseFlagAt("should_save", {2}),
            RaiseFlagAt("should_log", {3}),
            RaiseFlagAt("should_evaluate", {1}),
            RaiseFlagAt("should_training_stop", {3}),
        ],
    )
    trainer.train()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2]
    history = trainer.state.log_history
    assert [(h["step"], "loss" in h) for h in history if "loss" in h] == [(3, True)]
    assert [h["step"] for h in history if "eval_loss" in h] == [1]
    assert trainer.state.global_step == 3  # should_training_stop honoured


def test_save_total_limit_1_with_the_best_model_keeps_only_the_best_checkpoint_at_the_end(tmp_path: Path) -> None:
    class GetsWorse(CountingMetrics):
        def __call__(self, p: Any) -> dict[str, float]:
            super().__call__(p)
            return {"score": -float(self.calls)}  # the first evaluation is the best

    args = _eval_args(
        tmp_path,
        max_steps=6,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="score",
    )
    seen: list[list[int]] = []

    class Listing(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.append([step for step, _ in list_checkpoints(tmp_path)])

    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=regression_data(16),
        eval_dataset=regression_data(8, seed=1),
        compute_metrics=GetsWorse(),
        callbacks=[Listing],
    )
    trainer.train()
    assert seen[-1] == [2, 6]  # during training the newest stays beside the best, for resuming
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2]
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
