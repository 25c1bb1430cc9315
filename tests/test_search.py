"""Hyperparameter search on optuna (HF ``Trainer.hyperparameter_search``): best run, pruning, run dirs, errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from facade_helpers import RecordingCallback, Regressor, quiet_args, regression_data

from trainbus.engine import ConfigError, Event, Plugin
from trainbus.plugins.facade.arguments import TrainingArguments
from trainbus.plugins.facade.search import (
    BestRun,
    TrialPruning,
    default_compute_objective,
    hyperparameter_search,
    trial_arguments,
)
from trainbus.plugins.facade.trainer import Trainer

TRAIN, EVAL = regression_data(32, 0), regression_data(8, 1)


@pytest.fixture
def optuna() -> Any:
    """The optuna module (the tests that run a study skip without it; ``pip install optuna``)."""
    module = pytest.importorskip("optuna")
    module.logging.set_verbosity(module.logging.WARNING)
    return module


def make_trainer(out: Path, model_init: Any = Regressor, **kwargs: Any) -> Trainer:
    callbacks = kwargs.pop("callbacks", None)
    defaults: dict[str, Any] = {
        "max_steps": 8,
        "logging_steps": 1,
        "report_to": "jsonl",
        "lr_scheduler_type": "constant",
    }
    args = quiet_args(out, **{**defaults, **kwargs})
    return Trainer(model_init=model_init, args=args, train_dataset=TRAIN, eval_dataset=EVAL, callbacks=callbacks)


def logs(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "logs.jsonl").read_text().splitlines()]


def evals(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in logs(run_dir) if "eval_loss" in r}


def space(trial: Any) -> dict[str, Any]:
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-3, 0.5, log=True),
        "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [4, 8]),
    }


def test_the_best_of_six_trials_is_returned_and_each_trial_ran_with_its_hyperparameters(
    tmp_path: Path, optuna: Any
) -> None:
    trainer = make_trainer(tmp_path, eval_strategy="steps", eval_steps=4)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    best = hyperparameter_search(
        trainer,
        hp_space=space,
        n_trials=6,
        sampler=optuna.samplers.TPESampler(seed=0),
        pruner=optuna.pruners.NopPruner(),
    )
    assert isinstance(best, BestRun)
    study = best.run_summary
    trials = study.trials
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 6
    winner = min(trials, key=lambda t: t.value)
    assert best.objective == winner.value == min(t.value for t in trials)
    assert best.run_id == str(winner.number) and best.hyperparameters == winner.params == study.best_trial.params
    assert len({t.params["learning_rate"] for t in trials}) == 6
    for t in trials:
        run_dir = tmp_path / f"run-{t.number}"
        records = logs(run_dir)
        # the objective is the last evaluation's eval_loss, every evaluation was reported at its step
        assert t.value == evals(run_dir)[8] and t.intermediate_values == evals(run_dir)
        # the trial's learning rate and batch size were the ones its model trained with
        assert records[0]["learning_rate"] == pytest.approx(t.params["learning_rate"], rel=1e-6)
        assert records[-1]["step"] == 8 and records[-1]["epoch"] == 8 / (32 / t.params["per_device_train_batch_size"])
    # the Trainer searched for is left as it was
    assert trainer.args.output_dir == str(tmp_path) and trainer.args.learning_rate == 5e-5
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert not (tmp_path / "logs.jsonl").exists()


def test_diverging_trials_are_pruned_at_an_evaluation_and_end_cleanly(tmp_path: Path, optuna: Any) -> None:
    recorder = RecordingCallback()  # an HF callback: shared by the trials, as in HF
    trainer = make_trainer(
        tmp_path, eval_strategy="steps", eval_steps=1, optim="sgd", max_grad_norm=0, callbacks=[recorder]
    )

    def diverging(trial: Any) -> dict[str, Any]:
        return {"learning_rate": trial.suggest_float("learning_rate", 0.05, 20.0, log=True)}

    best = hyperparameter_search(
        trainer,
        hp_space=diverging,
        n_trials=6,
        sampler=optuna.samplers.TPESampler(seed=1),
        pruner=optuna.pruners.MedianPruner(n_startup_trials=1),
    )
    study = best.run_summary
    pruned = [t for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert pruned and complete and len(pruned) + len(complete) == 6
    assert any(t.params["learning_rate"] > 2.0 for t in pruned)  # a diverging one among them
    for t in pruned:
        run_dir = tmp_path / f"run-{t.number}"
        stop = max(t.intermediate_values)
        assert stop < 8 and max(evals(run_dir)) == stop  # no evaluation after the one that pruned it
        assert "train_runtime" in logs(run_dir)[-1]  # training ended normally: the summary was logged
    for t in complete:
        assert sorted(t.intermediate_values) == list(range(1, 9))
    assert best.objective == min(t.value for t in complete)
    assert recorder.names.count("on_train_begin") == recorder.names.count("on_train_end") == 6


def test_model_init_is_required(tmp_path: Path) -> None:
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=1), train_dataset=TRAIN, eval_dataset=EVAL)
    with pytest.raises(ConfigError, match="model_init"):
        hyperparameter_search(trainer, n_trials=1)


def test_an_unknown_hyperparameter_name_is_an_error_naming_it(tmp_path: Path, optuna: Any) -> None:
    trainer = make_trainer(tmp_path)

    def misspelt(trial: Any) -> dict[str, Any]:
        return {"learning_rat": trial.suggest_float("lr", 1e-3, 1e-2), "push_to_hub": True, "seed": 3}

    with pytest.raises(ConfigError, match=r"'learning_rat'; did you mean 'learning_rate'.*'push_to_hub'") as info:
        hyperparameter_search(trainer, hp_space=misspelt, n_trials=1)
    assert "'seed'" not in str(info.value)


@pytest.mark.parametrize("backend", ["ray", "sigopt", "wandb"])
def test_other_backends_are_an_error_naming_optuna(tmp_path: Path, backend: str) -> None:
    with pytest.raises(ConfigError, match=rf"backend '{backend}' is not supported.*'optuna'"):
        hyperparameter_search(make_trainer(tmp_path), backend=backend)


def test_a_missing_optuna_says_how_to_install_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "optuna", None)  # import optuna now raises ImportError
    with pytest.raises(ConfigError, match="pip install optuna"):
        hyperparameter_search(make_trainer(tmp_path), n_trials=1)


def test_bad_search_arguments_are_errors(tmp_path: Path, optuna: Any) -> None:
    trainer = make_trainer(tmp_path)
    with pytest.raises(ConfigError, match=r"unknown keyword arguments \['samplr'\]; did you mean 'sampler'"):
        hyperparameter_search(trainer, samplr=None)
    with pytest.raises(ConfigError, match=r"n_jobs=2.*one at a time"):
        hyperparameter_search(trainer, n_jobs=2)
    with pytest.raises(ConfigError, match="direction must be"):
        hyperparameter_search(trainer, direction="minimise")
    no_eval = Trainer(model_init=Regressor, args=quiet_args(tmp_path, max_steps=1), train_dataset=TRAIN)
    with pytest.raises(ConfigError, match="needs an eval_dataset"):
        hyperparameter_search(no_eval)


def test_multi_objective_returns_the_list_of_best_runs(tmp_path: Path, optuna: Any) -> None:
    # evaluating during training checks the pruning plugin does not report: optuna would raise
    trainer = make_trainer(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1)

    def both(metrics: dict[str, float]) -> list[float]:
        return [metrics["eval_loss"], metrics["eval_loss"]]  # opposed directions: every trial is Pareto-best

    kwargs: dict[str, Any] = {"hp_space": space, "n_trials": 3, "direction": ["minimize", "maximize"]}
    best = hyperparameter_search(trainer, compute_objective=both, sampler=optuna.samplers.TPESampler(seed=0), **kwargs)
    assert isinstance(best, list) and all(isinstance(b, BestRun) for b in best)
    study = best[0].run_summary
    assert len(study.directions) == 2
    expected = sorted((str(t.number), t.values, t.params) for t in study.best_trials)
    assert sorted((b.run_id, b.objective, b.hyperparameters) for b in best) == expected
    assert len(best) == 3 and all(
        b.objective[0] == b.objective[1] == evals(tmp_path / f"run-{b.run_id}")[2] for b in best
    )
    with pytest.raises(ConfigError, match="2 directions compute_objective must return a list of 2"):
        hyperparameter_search(trainer, compute_objective=default_compute_objective, **kwargs)


def test_run_names_the_trial_passed_to_model_init_and_fresh_plugins(tmp_path: Path, optuna: Any) -> None:
    seen: list[Any] = []

    def model_init(trial: Any = None) -> torch.nn.Module:
        seen.append(None if trial is None else trial.number)
        return Regressor()

    class CountSteps(Plugin):
        def __init__(self) -> None:
            self.steps = 0

        def attach(self, engine: Any) -> None:
            self.on(engine, Event.STEP_END, self.step_end)
            self.on(engine, Event.LOG, self.log)

        def step_end(self, ev: Any) -> None:
            self.steps += 1

        def log(self, ev: Any) -> None:
            ev.logs["steps_counted"] = self.steps

    counter = CountSteps()
    trainer = make_trainer(tmp_path, model_init=model_init, max_steps=2, callbacks=[counter])
    hyperparameter_search(
        trainer,
        hp_space=space,
        n_trials=2,
        hp_name=lambda trial: f"trial_{trial.number}",
        sampler=optuna.samplers.TPESampler(seed=0),
    )
    assert seen == [None, 0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trial_0", "trial_1"]
    for name in ("trial_0", "trial_1"):  # each trial counted its own steps from 0
        assert [r["steps_counted"] for r in logs(tmp_path / name) if "loss" in r] == [1, 2]
    assert counter.steps == 0


def test_a_plain_trainer_resumes_from_a_trial_checkpoint(tmp_path: Path, optuna: Any) -> None:
    trainer = make_trainer(
        tmp_path, max_steps=2, save_strategy="steps", save_steps=1, eval_strategy="steps", eval_steps=1
    )
    best = hyperparameter_search(trainer, hp_space=space, n_trials=1, sampler=optuna.samplers.TPESampler(seed=0))
    args = trial_arguments(trainer.args, {**best.hyperparameters, "max_steps": 3}, str(tmp_path / "again"))
    again = Trainer(model_init=Regressor, args=args, train_dataset=TRAIN, eval_dataset=EVAL)
    assert again.train(resume_from_checkpoint=str(tmp_path / "run-0" / "checkpoint-2")).global_step == 3


def test_trial_arguments_copy_validate_and_cast() -> None:
    args = TrainingArguments("out", learning_rate=1e-3)
    trial = trial_arguments(args, {"num_train_epochs": 2, "warmup_steps": 0.5}, "out/run-0")
    assert (
        trial.output_dir == "out/run-0" and trial.num_train_epochs == 2.0 and isinstance(trial.num_train_epochs, float)
    )
    assert trial.warmup_steps == 0.5 and trial.learning_rate == 1e-3  # an int field keeps a float it cannot hold
    assert args.output_dir == "out" and args.num_train_epochs == 3.0
    with pytest.raises(ConfigError, match=r"invalid TrainingArguments.*warmup_ratio must be in \[0, 1\]"):
        trial_arguments(args, {"warmup_ratio": 2.0}, "out/run-1")
    with pytest.raises(ConfigError, match="must not set output_dir"):
        trial_arguments(args, {"output_dir": "elsewhere"}, "out/run-1")


def test_default_compute_objective_is_hfs() -> None:
    hf_objective = pytest.importorskip("transformers.trainer_utils").default_compute_objective

    for metrics in (
        {"eval_loss": 0.5, "eval_runtime": 0.1, "eval_samples_per_second": 9.0, "epoch": 1.0},
        {"eval_loss": 0.5, "eval_accuracy": 0.75, "eval_f1": 0.5, "eval_steps_per_second": 3.0},
    ):
        assert default_compute_objective(metrics) == hf_objective(metrics)


class FakeTrial:
    """An optuna trial stand-in: records reports, prunes from a given step on."""

    def __init__(self, prune_at: int) -> None:
        self.prune_at = prune_at
        self.reports: list[tuple[float, int]] = []

    def report(self, value: float, step: int) -> None:
        self.reports.append((value, step))

    def should_prune(self) -> bool:
        return self.reports[-1][1] >= self.prune_at


def test_pruning_sums_named_eval_sets_once_per_evaluation_and_stops(tmp_path: Path) -> None:
    trial = FakeTrial(prune_at=2)
    pruning = TrialPruning(trial, default_compute_objective)
    args = quiet_args(tmp_path, max_steps=6, logging_steps=1, eval_strategy="steps", eval_steps=1)
    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=TRAIN,
        eval_dataset={"a": EVAL, "b": regression_data(4, 2)},
        callbacks=[pruning],
    )
    trainer.train()
    losses: dict[int, float] = {}  # each named set logs its own record
    for record in trainer.state.log_history:
        for key in ("eval_a_loss", "eval_b_loss"):
            if key in record:
                losses[record["step"]] = losses.get(record["step"], 0.0) + record[key]
    assert trainer.state.global_step == 2 and pruning.pruned and pruning.pruned_at == 2
    assert trial.reports == [(pytest.approx(total), step) for step, total in sorted(losses.items())]
    assert [step for _, step in trial.reports] == [1, 2]
    trainer.evaluate()  # outside training: not reported
    assert len(trial.reports) == 2


def test_doctests() -> None:
    import doctest

    from trainbus.plugins.facade import search

    assert doctest.testmod(search, optionflags=doctest.ELLIPSIS).failed == 0
