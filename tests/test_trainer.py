"""The Trainer facade: the HF quick-start, subclass overrides, callbacks API, bad input before the first step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from facade_helpers import Regressor, accuracy, quiet_args, regression_data, tiny_bert, token_data

from trainbus.engine import ConfigError
from trainbus.plugins.control.flow import FlowControl
from trainbus.plugins.evaluation.collector import PredictionOutput
from trainbus.plugins.facade.arguments import TrainingArguments
from trainbus.plugins.facade.callbacks import TrainerCallback
from trainbus.plugins.facade.trainer import Trainer, TrainOutput


def test_quickstart_tiny_bert(tmp_path: Path) -> None:
    """The HF quick-start, unchanged but for the import (datasets of dicts with a 'label' column)."""
    model = tiny_bert()
    training_args = TrainingArguments(
        output_dir=str(tmp_path),
        learning_rate=2e-3,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        num_train_epochs=2,
        weight_decay=0.01,
        eval_strategy="epoch",
        save_strategy="epoch",
        load_best_model_at_end=True,
        disable_tqdm=True,
        use_cpu=True,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=token_data(16),
        eval_dataset=token_data(8, seed=1),
        compute_metrics=accuracy,
    )
    result = trainer.train()
    assert isinstance(result, TrainOutput)
    assert result.global_step == 8 and np.isfinite(result.training_loss)
    assert result.training_loss == result.metrics["train_loss"]
    metrics = trainer.evaluate()
    assert {"eval_loss", "eval_accuracy", "eval_runtime", "eval_samples_per_second", "epoch"} <= set(metrics)
    out = trainer.predict(token_data(6, seed=2))
    assert isinstance(out, PredictionOutput)
    assert out.predictions.shape == (6, 2) and out.label_ids.tolist() == [0, 1, 0, 1, 0, 1]
    assert "test_loss" in out.metrics and "test_accuracy" in out.metrics
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4", "checkpoint-8"]
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "config.json").is_file()


def test_quickstart_plain_module(tmp_path: Path) -> None:
    trainer = Trainer(
        Regressor(),
        quiet_args(tmp_path, num_train_epochs=3, learning_rate=0.05, eval_strategy="epoch", logging_steps=2),
        train_dataset=regression_data(32),
        eval_dataset=regression_data(8, 1),
    )
    first = trainer.evaluate()["eval_loss"]
    result = trainer.train()
    assert result.global_step == 24
    assert trainer.evaluate()["eval_loss"] < first
    out = trainer.predict(regression_data(5, 2))
    assert out.predictions.shape == (5,)
    assert [h["epoch"] for h in trainer.state.log_history if "eval_loss" in h] == [
        1.0,
        2.0,
        3.0,
        3.0,
    ]  # + the evaluate() after training


def test_tuple_dataset_and_loss_func(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(3), torch.randn(1)) for _ in range(12)]
    trainer = Trainer(
        model,
        quiet_args(tmp_path, max_steps=3),
        train_dataset=data,
        compute_loss_func=lambda out, labels, num_items_in_batch=None: torch.nn.functional.mse_loss(out, labels),
    )
    assert trainer.train().global_step == 3


def test_subclass_compute_loss_changes_the_loss(tmp_path: Path) -> None:
    seen: list[float] = []

    class Doubled(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
            loss = loss * 0 + 123.0 + loss * 0  # a constant loss: easy to recognise in the logs
            seen.append(1.0)
            return (loss, outputs) if return_outputs else loss

    args = quiet_args(tmp_path, max_steps=2, logging_steps=1)
    trainer = Doubled(Regressor(), args, train_dataset=regression_data(8), eval_dataset=regression_data(4))
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == [123.0, 123.0]
    assert trainer.evaluate()["eval_loss"] == 123.0
    assert seen


def test_subclass_compute_loss_gradients(tmp_path: Path) -> None:
    """The override's loss is what is backpropagated: a zero loss leaves the weights unchanged."""

    class Zero(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
            outputs = model(**inputs)
            loss = outputs["loss"] * 0.0
            return (loss, outputs) if return_outputs else loss

    model = Regressor()
    before = [p.detach().clone() for p in model.parameters()]
    Zero(model, quiet_args(tmp_path, max_steps=2, optim="sgd"), train_dataset=regression_data(8)).train()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_subclass_training_step(tmp_path: Path) -> None:
    calls: list[int] = []

    class Counting(Trainer):
        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
            calls.append(1)
            return super().training_step(model, inputs, num_items_in_batch)

    model = Regressor()
    before = [p.detach().clone() for p in model.parameters()]
    args = quiet_args(tmp_path, max_steps=2, gradient_accumulation_steps=2, logging_steps=1, learning_rate=0.1)
    Counting(model, args, train_dataset=regression_data(16)).train()
    assert len(calls) == 4  # 2 steps x 2 micro-batches
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_subclass_prediction_step(tmp_path: Path) -> None:
    class Fixed(Trainer):
        def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None):
            n = inputs["x"].shape[0]
            return torch.tensor(7.0), torch.full((n,), 2.0), inputs["labels"]

    trainer = Fixed(Regressor(), quiet_args(tmp_path, max_steps=1), eval_dataset=regression_data(6))
    assert trainer.evaluate()["eval_loss"] == 7.0
    assert trainer.predict(regression_data(6)).predictions.tolist() == [2.0] * 6


def test_evaluate_dict_of_sets(tmp_path: Path) -> None:
    trainer = Trainer(
        Regressor(),
        quiet_args(tmp_path, max_steps=1),
        eval_dataset={"a": regression_data(4), "b": regression_data(4, 1)},
    )
    metrics = trainer.evaluate()
    assert {"eval_a_loss", "eval_b_loss"} <= set(metrics)


def test_fractional_epochs(tmp_path: Path) -> None:
    trainer = Trainer(Regressor(), quiet_args(tmp_path, num_train_epochs=1.5), train_dataset=regression_data(16))
    assert trainer.train().global_step == 6


def test_iterable_dataset_needs_max_steps(tmp_path: Path) -> None:
    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            return iter(regression_data(12))

    with pytest.raises(ConfigError, match="max_steps"):
        Trainer(Regressor(), quiet_args(tmp_path), train_dataset=Stream())
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=5), train_dataset=Stream())
    assert trainer.train().global_step == 5


def test_add_pop_remove_callbacks(tmp_path: Path) -> None:
    class A(TrainerCallback):
        pass

    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=1), train_dataset=regression_data(4))
    trainer.add_callback(A)
    instance = trainer.callback_handler.callbacks[-1]
    assert isinstance(instance, A)
    assert trainer.pop_callback(A) is instance
    trainer.add_callback(instance)
    trainer.remove_callback(instance)
    assert instance not in trainer.callback_handler.callbacks
    flow = trainer.pop_callback(FlowControl)  # trainbus plugins work too, by class or instance
    assert isinstance(flow, FlowControl)
    trainer.add_callback(flow)
    assert trainer.get_plugin(FlowControl) is flow


def test_optimizers_argument_and_create(tmp_path: Path) -> None:
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = Trainer(
        model, quiet_args(tmp_path, max_steps=2), train_dataset=regression_data(8), optimizers=(opt, sched)
    )
    trainer.train()
    assert trainer.optimizer is opt and trainer.lr_scheduler is sched
    assert opt.param_groups[0]["lr"] == pytest.approx(0.125)
    other = Trainer(
        Regressor(),
        quiet_args(tmp_path, max_steps=4, learning_rate=1.0, optim="sgd"),
        train_dataset=regression_data(16),
    )
    other.create_optimizer_and_scheduler(num_training_steps=4)
    assert type(other.optimizer).__name__ == "SGD" and other.lr_scheduler is not None
    other.train()
    assert other.optimizer.param_groups[0]["lr"] == pytest.approx(0.0)


def test_resume_from_checkpoint_continues(tmp_path: Path) -> None:
    def make(max_steps: int) -> Trainer:
        args = quiet_args(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=2, learning_rate=0.1)
        return Trainer(Regressor(), args, train_dataset=regression_data(24))

    full = make(6)
    full.train()
    (tmp_path / "checkpoint-6").rename(tmp_path / "done-6")
    for name in ("checkpoint-4",):
        import shutil

        shutil.rmtree(tmp_path / name)
    resumed = make(6)
    out = resumed.train(resume_from_checkpoint=True)  # latest: checkpoint-2
    assert out.global_step == 6
    for a, b in zip(full.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


# -- bad input: clear errors before the first step ---------------------------------------------------
def test_eval_strategy_without_eval_set(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="eval_dataset"):
        Trainer(
            Regressor(), quiet_args(tmp_path, eval_strategy="steps", eval_steps=1), train_dataset=regression_data(4)
        )


def test_metric_for_best_model_of_compute_metrics_checked_at_the_first_evaluation(tmp_path: Path) -> None:
    steps: list[int] = []

    class Spy(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            steps.append(1)

    args = quiet_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1, metric_for_best_model="acuracy")
    trainer = Trainer(
        tiny_bert(),
        args,
        train_dataset=token_data(8),
        eval_dataset=token_data(4),
        compute_metrics=accuracy,
        callbacks=[Spy],
    )
    with pytest.raises(ConfigError, match=r"eval_acuracy.*did you mean 'eval_accuracy'"):
        trainer.train()
    assert steps == [1]  # HF calls compute_metrics only in a real evaluation: the one after step 1
    args.metric_for_best_model = "accuracy"
    ok = Trainer(tiny_bert(), args, train_dataset=token_data(8), eval_dataset=token_data(4), compute_metrics=accuracy)
    assert ok.train().global_step == 2


def test_save_total_limit_below_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="save_total_limit"):
        quiet_args(tmp_path, save_total_limit=0)


def test_report_to_unknown_sink(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="report_to"):
        Trainer(Regressor(), quiet_args(tmp_path, report_to="wandbb"), train_dataset=regression_data(4))


def test_train_without_dataset(tmp_path: Path) -> None:
    trainer = Trainer(Regressor(), quiet_args(tmp_path), eval_dataset=regression_data(4))
    with pytest.raises(ConfigError, match="train_dataset"):
        trainer.train()


def test_on_init_end_fires(tmp_path: Path) -> None:
    fired: list[str] = []

    class Init(TrainerCallback):
        def on_init_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            fired.append(kw["model"].__class__.__name__)

    Trainer(Regressor(), quiet_args(tmp_path), train_dataset=regression_data(4), callbacks=[Init()])
    assert fired == ["Regressor"]
