"""Overrides of transformers' data and step internals run where transformers runs them (issue 34 item 2).

Each subclass changes what the method returns (or records what it is given) and runs under transformers.Trainer
and trainbus.plugins.Trainer: the calls, the logged losses (rtol 1e-5), the metrics and the weights agree.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.differential.hf_diff import (
    AlmostAccuracy,
    RegressionData,
    RegressionModel,
    assert_same_arrays,
    assert_same_logs,
    assert_same_metrics,
    assert_same_weights,
    run_both,
)


class SummedLoss(RegressionModel):
    """A forward that takes loss kwargs and divides its summed loss by ``num_items_in_batch`` (as GPT-2 does)."""

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        y = input_x * self.a + self.b
        if labels is None:
            return (y,)
        items = kwargs.get("num_items_in_batch")
        squared = (y - labels) ** 2
        return (squared.sum() / items if items is not None else squared.mean(), y)


def _args(impl: Any, workdir: Path, **more: Any) -> Any:
    base = {"per_device_train_batch_size": 4, "per_device_eval_batch_size": 4, "max_steps": 4, "logging_steps": 1,
            "gradient_accumulation_steps": 2, "save_strategy": "no", "eval_strategy": "steps", "eval_steps": 2,
            "learning_rate": 0.1, "train_sampling_strategy": "sequential"}  # fmt: skip
    return impl.args(workdir, **{**base, **more})


def _compare(hf: Any, tb: Any) -> None:
    (hf_trainer, hf_pred), (tb_trainer, tb_pred) = hf, tb
    assert_same_logs(hf_trainer.state.log_history, tb_trainer.state.log_history)
    assert_same_weights(hf_trainer.model, tb_trainer.model)
    assert_same_metrics(hf_pred.metrics, tb_pred.metrics)
    assert_same_arrays(hf_pred.predictions, tb_pred.predictions)
    assert hf_trainer.seen == tb_trainer.seen


def _run(impl: Any, workdir: Path, methods: dict[str, Any], model: Any = None, **more: Any) -> Any:
    subclass = type("Sub", (impl.Trainer,), methods)
    trainer = subclass(model=model if model is not None else SummedLoss(), args=_args(impl, workdir, **more),
                       train_dataset=RegressionData(32, seed=1), eval_dataset=RegressionData(12, seed=2),
                       compute_metrics=AlmostAccuracy())  # fmt: skip
    trainer.seen = []
    trainer.train()
    return trainer, trainer.predict(RegressionData(8, seed=3))


def test_a_get_num_items_in_batch_override_is_the_count_the_model_divides_by(tmp_path: Path) -> None:
    """Counting every label twice halves the loss the model returns: trainbus trains on it, as transformers."""

    def _get_num_items_in_batch(self: Any, batch_samples: list[Any], device: Any) -> Any:
        items = super(type(self), self)._get_num_items_in_batch(batch_samples, device)
        self.seen.append((len(batch_samples), None if items is None else int(items)))
        return None if items is None else items * 2

    hf, tb = run_both(lambda impl, d: _run(impl, d, {"_get_num_items_in_batch": _get_num_items_in_batch}), tmp_path)
    _compare(hf, tb)
    assert tb[0].seen[0] == (2, 8)  # the first window: two micro-batches of 4 labels
    assert (1, 4) in tb[0].seen  # an evaluation batch, counted for compute_loss as transformers counts it
    # independent: the first step's loss is half the mean squared error of the window's 8 samples
    data = RegressionData(32, seed=1)
    assert tb[0].state.log_history[0]["loss"] == pytest.approx(0.5 * float((data.ys[0][:8] ** 2).mean()), rel=1e-6)


def test_a_get_eval_sampler_override_orders_evaluation_and_prediction(tmp_path: Path) -> None:
    def _get_eval_sampler(self: Any, eval_dataset: Any) -> Any:
        self.seen.append(len(eval_dataset))
        return list(reversed(range(len(eval_dataset))))  # a sampler is any iterable of indices

    hf, tb = run_both(lambda impl, d: _run(impl, d, {"_get_eval_sampler": _get_eval_sampler}), tmp_path)
    _compare(hf, tb)
    model, x = tb[0].model, RegressionData(8, seed=3).x  # independent: the final line, in the reversed order
    expected = (x * model.a.item() + model.b.item())[::-1]
    assert_same_arrays(expected, tb[1].predictions, atol=1e-5)
    assert tb[0].seen[:2] == [12, 12] and tb[0].seen[-1] == 8  # two scheduled evaluations, then predict


def test_a_prepare_inputs_override_changes_every_batch(tmp_path: Path) -> None:
    def _prepare_inputs(self: Any, inputs: Any) -> Any:
        inputs = super(type(self), self)._prepare_inputs(inputs)
        self.seen.append(("train" if self.model.training else "eval", len(inputs["labels"])))
        return {**inputs, "input_x": inputs["input_x"] * 0.5}

    def _prepare_input(self: Any, data: Any) -> Any:
        self.seen.append("input")
        return super(type(self), self)._prepare_input(data)

    for methods in ({"_prepare_inputs": _prepare_inputs}, {"_prepare_input": _prepare_input}):
        hf, tb = run_both(lambda impl, d, m=methods: _run(impl, d, m), tmp_path / next(iter(methods)))
        _compare(hf, tb)
        assert tb[0].seen


def test_a_compute_loss_context_manager_override_runs_around_every_loss(tmp_path: Path) -> None:
    def compute_loss_context_manager(self: Any) -> Any:
        self.seen.append("train" if self.model.training else "eval")
        stack = contextlib.ExitStack()
        stack.enter_context(torch.no_grad() if not self.model.training else contextlib.nullcontext())
        return stack

    def autocast_smart_context_manager(self: Any, cache_enabled: Any = True) -> Any:
        self.seen.append("autocast")
        return contextlib.nullcontext()

    for methods in (
        {"compute_loss_context_manager": compute_loss_context_manager},
        {"autocast_smart_context_manager": autocast_smart_context_manager},
    ):
        hf, tb = run_both(lambda impl, d, m=methods: _run(impl, d, m), tmp_path / next(iter(methods)))
        _compare(hf, tb)
        assert tb[0].seen


def _columns_data(n: int, seed: int) -> Any:
    import datasets

    data = RegressionData(n, seed=seed)
    return datasets.Dataset.from_dict({"input_x": data.x.tolist(), "labels": data.ys[0].tolist(), "note": ["x"] * n})


def test_loader_builder_overrides_run_with_transformers_arguments(tmp_path: Path) -> None:
    """_get_dataloader (what each get_*_dataloader asks for), _remove_unused_columns (a datasets.Dataset: the extra
    column goes) and _get_collator_with_removed_columns (a list of dicts: here its collator also scales the input)."""

    def _get_dataloader(self: Any, dataset: Any, description: str, batch_size: int, sampler_fn: Any = None,
                        is_training: bool = False, dataloader_key: Any = None) -> Any:  # fmt: skip
        self.seen.append(("loader", description, batch_size, is_training, dataloader_key, sampler_fn is not None))
        return super(type(self), self)._get_dataloader(
            dataset, description, batch_size, sampler_fn, is_training, dataloader_key
        )

    def _remove_unused_columns(self: Any, dataset: Any, description: Any = None) -> Any:
        kept = super(type(self), self)._remove_unused_columns(dataset, description)
        self.seen.append(("columns", description, sorted(dataset.column_names), sorted(kept.column_names)))
        return kept

    def _get_collator_with_removed_columns(self: Any, data_collator: Any, description: Any = None) -> Any:
        inner = super(type(self), self)._get_collator_with_removed_columns(data_collator, description)
        self.seen.append(("collator", description))

        def collate(rows: list[Any]) -> Any:
            batch = inner(rows)
            return {**batch, "input_x": batch["input_x"] * 2}

        return collate

    def run(impl: Any, workdir: Path, methods: dict[str, Any], columnar: bool) -> Any:
        subclass = type("Sub", (impl.Trainer,), methods)
        make = _columns_data if columnar else (lambda n, seed: RegressionData(n, seed=seed))
        train, evals = make(32, 1), make(12, 2)
        trainer = subclass(model=SummedLoss(), args=_args(impl, workdir), train_dataset=train, eval_dataset=evals,
                           compute_metrics=AlmostAccuracy())  # fmt: skip
        trainer.seen = []
        trainer.train()
        return trainer, trainer.predict(evals)

    cases = [
        ("dataloader", {"_get_dataloader": _get_dataloader}, False),
        ("columns", {"_remove_unused_columns": _remove_unused_columns}, True),
        ("collator", {"_get_collator_with_removed_columns": _get_collator_with_removed_columns}, False),
    ]
    seen = {}
    for label, methods, columnar in cases:
        hf, tb = run_both(lambda impl, d, m=methods, c=columnar: run(impl, d, m, c), tmp_path / label)
        _compare(hf, tb)
        seen[label] = tb[0].seen
    assert ("loader", "Training", 4, True, None, True) in seen["dataloader"]
    assert ("loader", "Evaluation", 4, False, "eval", True) in seen["dataloader"]
    assert ("columns", "Training", ["input_x", "labels", "note"], ["input_x", "labels"]) in seen["columns"]
    assert ("collator", "test") in seen["collator"]


def test_a_get_batch_samples_override_makes_the_windows_and_their_count(tmp_path: Path) -> None:
    """A community-style override: the window's count from its own rule (every label twice). 9 batches per epoch in
    windows of 2: transformers asks 2, 2, 2, 2 and 1 (the epoch's remainder) each epoch, and so does trainbus."""

    def get_batch_samples(self: Any, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
        batches, items = super(type(self), self).get_batch_samples(epoch_iterator, num_batches, device)
        self.seen.append((num_batches, len(batches), None if items is None else int(items)))
        return batches, sum(len(b["labels"]) for b in batches) * 2

    def run(impl: Any, workdir: Path) -> Any:
        subclass = type("Sub", (impl.Trainer,), {"get_batch_samples": get_batch_samples})
        args = _args(impl, workdir, max_steps=-1, num_train_epochs=2, eval_strategy="epoch")
        trainer = subclass(model=SummedLoss(), args=args, train_dataset=RegressionData(36, seed=1),
                           eval_dataset=RegressionData(12, seed=2), compute_metrics=AlmostAccuracy())  # fmt: skip
        trainer.seen = []
        trainer.train()
        return trainer, trainer.predict(RegressionData(8, seed=3))

    hf, tb = run_both(run, tmp_path)
    _compare(hf, tb)
    assert tb[0].seen == [(2, 2, 8)] * 4 + [(1, 1, 4)] + [(2, 2, 8)] * 4 + [(1, 1, 4)]
    # independent: the first step's loss is half the window's mean squared error (the model divides by 2 x 8)
    data = RegressionData(36, seed=1)
    assert tb[0].state.log_history[0]["loss"] == pytest.approx(0.5 * float((data.ys[0][:8] ** 2).mean()), rel=1e-6)


def test_a_get_batch_samples_override_taking_more_batches_is_named(tmp_path: Path) -> None:
    from trainbus.engine import ConfigError
    from trainbus.plugins import Trainer, TrainingArguments

    class Greedy(Trainer):
        def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            return super().get_batch_samples(epoch_iterator, num_batches + 1, device)

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", max_steps=2, gradient_accumulation_steps=2,
                             per_device_train_batch_size=4, save_strategy="no")  # fmt: skip
    trainer = Greedy(SummedLoss(), args, train_dataset=RegressionData(32, seed=1))
    with pytest.raises(ConfigError, match=r"Greedy.get_batch_samples returned 3 batches for a window of 2"):
        trainer.train()
