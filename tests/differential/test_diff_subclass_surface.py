"""The subclass surface (#27 items 1 and 2): subclasses written against transformers.Trainer's internals, as
transformers' own example trainers are, run the same under trainbus.

Each scenario defines its subclass on the implementation's ``Trainer`` (the one import a port changes),
runs it under both, and compares what the subclass relies on.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_diff import (
    Impl,
    RegressionData,
    RegressionDictModel,
    assert_same_logs,
    assert_same_metrics,
    assert_same_weights,
    checkpoint_names,
    read_state,
    run_both,
    state_summary,
)


def qa_style_trainer(impl: Impl) -> type:
    """A subclass written as transformers' examples/pytorch/question-answering/trainer_qa.py: its evaluate()
    runs evaluation_loop with compute_metrics set to None, post-processes the predictions itself, logs, and
    tells the callbacks through ``self.callback_handler.on_evaluate``."""

    class PostProcessingTrainer(impl.Trainer):  # type: ignore[misc, name-defined]
        def __init__(self, *args: Any, post_process_function: Any = None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.post_process_function = post_process_function
            self.evaluations = 0

        def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
            self.evaluations += 1
            eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
            eval_dataloader = self.get_eval_dataloader(eval_dataset)
            compute_metrics = self.compute_metrics
            self.compute_metrics = None
            # transformers 4.x's example reads use_legacy_prediction_loop; 5.x removed the argument
            legacy = getattr(self.args, "use_legacy_prediction_loop", False)
            eval_loop = self.prediction_loop if legacy else self.evaluation_loop
            start_time = time.time()
            try:
                output = eval_loop(
                    eval_dataloader,
                    description="Evaluation",
                    prediction_loss_only=True if compute_metrics is None else None,
                    ignore_keys=ignore_keys,
                    metric_key_prefix=metric_key_prefix,
                )
            finally:
                self.compute_metrics = compute_metrics
            runtime = time.time() - start_time
            output.metrics[f"{metric_key_prefix}_runtime"] = runtime
            if self.post_process_function is not None and self.compute_metrics is not None:
                eval_preds = self.post_process_function(eval_dataset, output.predictions)
                metrics = self.compute_metrics(eval_preds)
                for key in list(metrics.keys()):
                    if not key.startswith(f"{metric_key_prefix}_"):
                        metrics[f"{metric_key_prefix}_{key}"] = metrics.pop(key)
                metrics.update(output.metrics)
            else:
                metrics = output.metrics
            self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            return metrics

    return PostProcessingTrainer


def shifted(dataset: RegressionData, predictions: Any) -> Any:
    """The post-processing: predictions and labels as plain arrays (a QA script maps logits to answers here)."""
    from transformers import EvalPrediction

    return EvalPrediction(predictions=np.asarray(predictions).reshape(-1), label_ids=dataset.ys[0])


class Closeness:
    """A metric that changes from evaluation to evaluation: the share of predictions within 0.5 of the label,
    minus a penalty that grows with the number of calls (so the best evaluation is an early one)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, p: Any) -> dict[str, float]:
        self.calls += 1
        close = float((np.abs(p.predictions - p.label_ids) <= 0.5).mean())
        return {"closeness": close - 0.1 * max(self.calls - 2, 0)}


def _qa_run(impl: Impl, workdir: Path, **extra: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    cls = qa_style_trainer(impl)
    args = impl.args(
        workdir / "out", learning_rate=0.05, num_train_epochs=4, per_device_train_batch_size=8, eval_strategy="steps",
        eval_steps=4, save_strategy="steps", save_steps=4, save_total_limit=2, logging_steps=4, seed=7,
        metric_for_best_model="closeness", greater_is_better=True, load_best_model_at_end=True, **extra,
    )  # fmt: skip
    evals = RegressionData(length=24, seed=3)
    trainer = cls(
        model=RegressionDictModel(), args=args, train_dataset=RegressionData(length=32), eval_dataset=evals,
        compute_metrics=Closeness(), post_process_function=shifted,
    )  # fmt: skip
    result = trainer.train()
    out = workdir / "out"
    return {
        "trainer": trainer,
        "train": result.metrics,
        "log_history": trainer.state.log_history,
        "state": state_summary(read_state(sorted(out.glob("checkpoint-*"))[-1]), out),
        "best": (trainer.state.best_metric, trainer.state.best_global_step),
        "best_checkpoint": Path(trainer.state.best_model_checkpoint).name,
        "checkpoints": checkpoint_names(out),
    }


def test_overridden_evaluate_drives_best_model_and_logs_as_transformers(tmp_path: Path) -> None:
    """#27 item 2: the metrics a QA-style evaluate() returns pick the best checkpoint (kept by rotation and
    loaded at the end), and every record the subclass logs is in log_history once, as under transformers."""
    hf, tb = run_both(_qa_run, tmp_path)
    assert hf["trainer"].evaluations == tb["trainer"].evaluations == 4
    assert_same_logs(hf["log_history"], tb["log_history"])
    assert tb["best"] == pytest.approx(hf["best"])
    assert tb["best"][1] < 16, "the penalty makes an early evaluation the best one"
    assert tb["best_checkpoint"] == hf["best_checkpoint"] == f"checkpoint-{tb['best'][1]}"
    assert tb["checkpoints"] == hf["checkpoints"]
    assert tb["best_checkpoint"] in tb["checkpoints"] and tb["checkpoints"][-1] == "checkpoint-16"  # rotation kept it
    assert_same_weights(hf["trainer"].model, tb["trainer"].model)  # the best model was loaded at the end
    eval_records = [r for r in tb["log_history"] if "eval_closeness" in r]
    assert len(eval_records) == 4 and all("eval_loss" in r for r in eval_records)


def test_overridden_evaluate_feeds_early_stopping(tmp_path: Path) -> None:
    """The metric of an overridden evaluate() stops the run through EarlyStoppingCallback (HF's on_evaluate)."""

    def scenario(impl: Impl, workdir: Path) -> dict[str, Any]:
        torch.manual_seed(0)
        cls = qa_style_trainer(impl)
        args = impl.args(
            workdir / "out", learning_rate=0.05, num_train_epochs=6, per_device_train_batch_size=8,
            eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=2, logging_steps=2, seed=7,
            metric_for_best_model="closeness", greater_is_better=True, load_best_model_at_end=True,
        )  # fmt: skip
        trainer = cls(
            model=RegressionDictModel(), args=args, train_dataset=RegressionData(length=32),
            eval_dataset=RegressionData(length=24, seed=3), compute_metrics=Closeness(),
            post_process_function=shifted, callbacks=[impl.EarlyStoppingCallback(early_stopping_patience=2)],
        )  # fmt: skip
        result = trainer.train()
        return {"steps": result.global_step, "log": trainer.state.log_history, "model": trainer.model}

    hf, tb = run_both(scenario, tmp_path)
    assert tb["steps"] == hf["steps"] < 24  # stopped early
    assert_same_logs(hf["log"], tb["log"])
    assert_same_weights(hf["model"], tb["model"])


def test_evaluation_loop_with_compute_metrics_none(tmp_path: Path) -> None:
    """``self.compute_metrics = None`` around ``evaluation_loop`` turns metrics off for that loop; a direct
    ``evaluation_loop`` call returns HF's EvalLoopOutput (metrics under its prefix, num_samples, predictions)."""

    def scenario(impl: Impl, workdir: Path) -> dict[str, Any]:
        cls = qa_style_trainer(impl)
        trainer = cls(
            model=RegressionDictModel(a=1.5, b=0.5), args=impl.args(workdir),
            eval_dataset=RegressionData(length=20, seed=3), compute_metrics=Closeness(),
            post_process_function=shifted,
        )  # fmt: skip
        metrics = trainer.evaluate()
        loop = trainer.evaluation_loop(trainer.get_eval_dataloader(), "Evaluation", metric_key_prefix="loop")
        return {"metrics": metrics, "loop": (loop.metrics, loop.num_samples, loop.predictions)}

    hf, tb = run_both(scenario, tmp_path)
    assert_same_metrics(hf["metrics"], tb["metrics"])
    assert "eval_closeness" in tb["metrics"]
    assert_same_metrics(hf["loop"][0], tb["loop"][0])
    assert tb["loop"][1] == hf["loop"][1] == 20
    np.testing.assert_allclose(tb["loop"][2], hf["loop"][2], atol=1e-6)


def copied_training_step_trainer(impl: Impl) -> type:
    """A training_step override that copies HF's body line by line (a common way to add a regulariser)."""

    class CopiedStepTrainer(impl.Trainer):  # type: ignore[misc, name-defined]
        def training_step(self, model, inputs, num_items_in_batch=None):
            model.train()
            if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
                self.optimizer.train()
            inputs = self._prepare_inputs(inputs)
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
            del inputs
            if self.args.n_gpu > 1:
                loss = loss.mean()
            loss = loss + 0.01 * model.a.abs()  # the subclass's addition
            if (not self.model_accepts_loss_kwargs or num_items_in_batch is None) and self.compute_loss_func is None:
                loss = loss / self.current_gradient_accumulation_steps
            self.accelerator.backward(loss)
            return loss.detach()

    return CopiedStepTrainer


def test_copied_training_step_with_a_short_last_window(tmp_path: Path) -> None:
    """_prepare_inputs, compute_loss_context_manager, current_gradient_accumulation_steps (the short last
    window of each epoch: 11 batches in windows of 3, 3, 3, 2) and accelerator.backward, as in transformers."""

    def scenario(impl: Impl, workdir: Path) -> dict[str, Any]:
        cls = copied_training_step_trainer(impl)
        args = impl.args(
            workdir, learning_rate=0.1, num_train_epochs=2, per_device_train_batch_size=3,
            gradient_accumulation_steps=3, logging_steps=1, seed=3, save_strategy="no",
        )  # fmt: skip
        trainer = cls(model=RegressionDictModel(), args=args, train_dataset=RegressionData(length=32))
        trainer.train()
        return {"log": trainer.state.log_history, "model": trainer.model}

    hf, tb = run_both(scenario, tmp_path)
    assert_same_logs(hf["log"], tb["log"])
    assert_same_weights(hf["model"], tb["model"])


def test_train_dataloader_made_in_train_and_args_read_again(tmp_path: Path) -> None:
    """get_train_dataloader() runs in train(): a subclass's attribute set after super().__init__ is there.
    Arguments changed after construction (learning rate, epochs, logging) apply at the next train()."""

    def scenario(impl: Impl, workdir: Path) -> dict[str, Any]:
        class OwnLoader(impl.Trainer):  # type: ignore[misc, name-defined]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                self.loader_calls = 0  # set after super().__init__, as subclasses do

            def get_train_dataloader(self):
                self.loader_calls += 1
                return super().get_train_dataloader()

        args = impl.args(workdir, learning_rate=0.01, num_train_epochs=1, logging_steps=4, seed=5, save_strategy="no")
        trainer = OwnLoader(model=RegressionDictModel(), args=args, train_dataset=RegressionData(length=32))
        first = trainer.train()
        trainer.args.learning_rate = 0.1
        trainer.args.num_train_epochs = 2
        trainer.args.logging_steps = 2
        second = trainer.train()
        return {"calls": trainer.loader_calls, "steps": (first.global_step, second.global_step),
                "log": trainer.state.log_history, "model": trainer.model}  # fmt: skip

    hf, tb = run_both(scenario, tmp_path)
    assert tb["calls"] == hf["calls"] == 2
    assert tb["steps"] == hf["steps"] == (4, 8)
    assert_same_logs(hf["log"], tb["log"])
    assert_same_weights(hf["model"], tb["model"])


def test_batch_size_changed_after_construction_applies_at_next_train(tmp_path: Path) -> None:
    """per_device_train_batch_size changed on trainer.args trains with the new size at the next train(), as
    after a hyperparameter search: the same run as a Trainer built with that size. (transformers 5 keeps
    the constructor's size outside a search; trainbus reads the arguments as they are, the issue's rule.)"""
    from trainbus.plugins import Trainer, TrainingArguments

    def run(batch_size_at_init: int) -> Any:
        args = TrainingArguments(
            str(tmp_path / f"b{batch_size_at_init}"), per_device_train_batch_size=batch_size_at_init,
            num_train_epochs=1, learning_rate=0.1, logging_steps=1, seed=5, save_strategy="no", use_cpu=True,
            report_to="none", disable_tqdm=True,
        )  # fmt: skip
        trainer = Trainer(model=RegressionDictModel(), args=args, train_dataset=RegressionData(length=32))
        trainer.args.per_device_train_batch_size = 4
        return trainer.train().global_step, trainer.state.log_history, trainer.model

    changed, direct = run(8), run(4)
    assert changed[0] == direct[0] == 8
    assert_same_logs(direct[1], changed[1])
    assert_same_weights(direct[2], changed[2])


def test_model_init_runs_again_at_each_train(tmp_path: Path) -> None:
    """#27 item 6: with model_init, every train() starts from a fresh model (and a fresh optimizer), as HF."""

    def scenario(impl: Impl, workdir: Path) -> dict[str, Any]:
        calls = []

        def model_init() -> torch.nn.Module:
            calls.append(1)
            return RegressionDictModel(a=0.5, b=0.5)

        args = impl.args(workdir, learning_rate=0.1, num_train_epochs=1, logging_steps=2, seed=5, save_strategy="no")
        trainer = impl.Trainer(model_init=model_init, args=args, train_dataset=RegressionData(length=16))
        trainer.train()
        first = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        trainer.train()
        return {"calls": len(calls), "first": first, "model": trainer.model, "log": trainer.state.log_history}

    hf, tb = run_both(scenario, tmp_path)
    assert tb["calls"] == hf["calls"] == 3  # the constructor's, then one per train()
    for key, value in tb["first"].items():  # the second run repeated the first from a fresh model
        torch.testing.assert_close(tb["model"].state_dict()[key], value)
    assert_same_logs(hf["log"], tb["log"])
    assert_same_weights(hf["model"], tb["model"])


def test_internals_subclasses_read(tmp_path: Path) -> None:
    """The attributes a copied body reads: is_in_train, the callback handler's methods returning the control,
    _memory_tracker, accelerator.gather_for_metrics, _move_model_to_device, _prepare_inputs' empty-batch error."""

    def scenario(impl: Impl, workdir: Path) -> dict[str, Any]:
        seen: dict[str, Any] = {}

        class Watcher(impl.TrainerCallback):  # type: ignore[misc, name-defined]
            def on_step_end(self, args, state, control, **kwargs):
                seen.setdefault("in_train", trainer.is_in_train)

            def on_log(self, args, state, control, logs=None, **kwargs):
                seen.setdefault("logged", []).append(dict(logs or {}))

        args = impl.args(workdir, max_steps=2, logging_steps=1, save_strategy="no", skip_memory_metrics=False)
        trainer = impl.Trainer(
            model=RegressionDictModel(), args=args, train_dataset=RegressionData(length=16), callbacks=[Watcher()]
        )
        trainer.train()
        seen["after"] = trainer.is_in_train
        control = trainer.callback_handler.on_log(trainer.args, trainer.state, trainer.control, {"custom": 1.0})
        seen["control_is_trainers"] = control is trainer.control
        trainer.control.should_save = False
        control = trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, {"eval_x": 1.0})
        seen["evaluate_control"] = control is trainer.control
        gathered = trainer.accelerator.gather_for_metrics(torch.arange(3.0))
        seen["gathered"] = gathered.tolist()
        trainer._move_model_to_device(trainer.model, torch.device("cpu"))
        seen["device"] = str(next(trainer.model.parameters()).device)
        moved = trainer._prepare_inputs({"input_x": torch.ones(2)})
        seen["prepared"] = sorted(moved)
        with pytest.raises(ValueError, match="The batch received was empty"):
            trainer._prepare_inputs({})
        with pytest.raises(ValueError, match="only expect to be called from one of"):
            trainer._memory_tracker.start()  # the stage is the calling method's name: "scenario" is none
        return seen

    hf, tb = run_both(scenario, tmp_path)
    assert tb["in_train"] is hf["in_train"] is True
    assert tb["after"] is hf["after"] is False
    assert tb["control_is_trainers"] and hf["control_is_trainers"]
    assert tb["evaluate_control"] and hf["evaluate_control"]
    assert tb["logged"][-1] == hf["logged"][-1] == {"custom": 1.0}
    assert tb["gathered"] == hf["gathered"] == [0.0, 1.0, 2.0]
    assert tb["device"] == hf["device"] == "cpu"
    assert tb["prepared"] == hf["prepared"] == ["input_x"]


def test_subclass_memory_tracker_in_its_evaluate(tmp_path: Path) -> None:
    """HF's evaluate body with the memory tracker (stage from the method name): eval_mem_* metrics as HF."""

    def scenario(impl: Impl, workdir: Path) -> list[str]:
        class Tracked(impl.Trainer):  # type: ignore[misc, name-defined]
            def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
                self._memory_tracker.start()
                output = self.evaluation_loop(
                    self.get_eval_dataloader(eval_dataset), "Evaluation", metric_key_prefix=metric_key_prefix
                )
                self._memory_tracker.stop_and_update_metrics(output.metrics)
                self.log(output.metrics)
                return output.metrics

        args = impl.args(workdir, skip_memory_metrics=False)
        trainer = Tracked(model=RegressionDictModel(), args=args, eval_dataset=RegressionData(length=8))
        return sorted(k for k in trainer.evaluate() if "_mem_" in k)

    hf, tb = run_both(scenario, tmp_path)
    assert tb == hf and any(k.startswith("eval_mem_cpu") for k in tb)
    assert math.isfinite(len(tb))


def test_legacy_prediction_loop_argument_of_transformers_4(tmp_path: Path) -> None:
    """transformers 4.x's trainer_qa.py reads args.use_legacy_prediction_loop; True takes prediction_loop,
    which in trainbus is the same loop: the QA-style evaluate gives the same metrics either way."""
    from hf_diff import implementation

    impl = implementation("trainbus")
    results = []
    for legacy in (False, True):
        cls = qa_style_trainer(impl)
        args = impl.args(tmp_path / str(legacy), use_legacy_prediction_loop=legacy)
        assert args.use_legacy_prediction_loop is legacy
        trainer = cls(
            model=RegressionDictModel(a=1.5, b=0.5), args=args, eval_dataset=RegressionData(length=20, seed=3),
            compute_metrics=Closeness(), post_process_function=shifted,
        )  # fmt: skip
        results.append(trainer.evaluate())
    assert_same_metrics(results[0], results[1])
