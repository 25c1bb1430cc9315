"""Evaluation and prediction scenarios of transformers' test_trainer.py (and test_trainer_utils.py's label
smoothing): metrics, predictions, label_ids, padding of uneven batches, iterable sets, ignore_keys.

Both implementations evaluate the same fixed regression ``y = 1.5 x + 2.5``; where transformers' test
computes the expected numbers itself, so does the test here (``expected_eval``).
"""

from __future__ import annotations

from types import SimpleNamespace

import hf_release
import numpy as np
import pytest
import torch
from hf_diff import (
    AlmostAccuracy,
    BatchedAlmostAccuracy,
    IterableRegressionData,
    RegressionData,
    RegressionModel,
    VariableLengthData,
    assert_same_arrays,
    assert_same_metrics,
    expected_eval,
    regression_trainer,
    run_both,
)

EVAL_VARIANTS = {
    "plain": {},
    "uneven_last_batch": {"eval_len": 66},
    "preprocess_logits": {"preprocess_logits_for_metrics": lambda logits, labels: logits + 1},
}


def _evaluate(tmp_path, variant, metrics, **arg_kwargs):
    kwargs = dict(EVAL_VARIANTS[variant])
    eval_len = kwargs.pop("eval_len", 64)
    trainer_kwargs = {"compute_metrics": metrics(), **kwargs}

    def scenario(impl, d):
        trainer = regression_trainer(
            impl, d, a=1.5, b=2.5, eval_len=eval_len, trainer_kwargs=trainer_kwargs, **arg_kwargs
        )
        return trainer.evaluate()

    hf, tb = run_both(scenario, tmp_path)
    assert_same_metrics(hf, tb)
    expected = expected_eval(1.5, 2.5, RegressionData(length=eval_len), shift=1.0 if "preprocess" in variant else 0.0)
    assert tb["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)
    assert tb["eval_accuracy"] == pytest.approx(expected["eval_accuracy"], abs=1e-7)
    return hf, tb


@pytest.mark.parametrize("variant", list(EVAL_VARIANTS))
def test_evaluate__mirrors_test_evaluate(tmp_path, variant):
    _evaluate(tmp_path, variant, AlmostAccuracy)


@pytest.mark.parametrize("variant", list(EVAL_VARIANTS))
def test_evaluate_batched_metrics__mirrors_test_evaluate_with_batch_eval_metrics(tmp_path, variant):
    _evaluate(tmp_path, variant, BatchedAlmostAccuracy, batch_eval_metrics=True)


PREDICT_VARIANTS = {
    "plain": {},
    "uneven_last_batch": {"eval_len": 66},
    "double_output": {"double_output": True},
    "two_outputs_two_labels": {"double_output": True, "label_names": ["labels", "labels_2"]},
}


def _predict(tmp_path, variant, **extra):
    kwargs = dict(PREDICT_VARIANTS[variant])
    eval_len = kwargs.get("eval_len", 64)

    def scenario(impl, d):
        trainer = regression_trainer(impl, d, a=1.5, b=2.5, **kwargs, **extra)
        return trainer.predict(trainer.eval_dataset)

    hf, tb = run_both(scenario, tmp_path)
    assert_same_arrays(hf.predictions, tb.predictions)
    assert_same_arrays(hf.label_ids, tb.label_ids)
    assert_same_metrics(hf.metrics, tb.metrics)
    data = RegressionData(length=eval_len, label_names=kwargs.get("label_names", ["labels"]))
    expected = 1.5 * data.x + 2.5
    preds = tb.predictions if kwargs.get("double_output") else (tb.predictions,)
    assert len(preds) == (2 if kwargs.get("double_output") else 1)
    for p in preds:
        np.testing.assert_allclose(p, expected, rtol=1e-6)
    if "label_names" in kwargs:
        for got, want in zip(tb.label_ids, data.ys):
            np.testing.assert_array_equal(got, want)
    return hf, tb


@pytest.mark.parametrize("variant", list(PREDICT_VARIANTS))
def test_predict__mirrors_test_predict(tmp_path, variant):
    _predict(tmp_path, variant)


@pytest.mark.parametrize("variant", ["plain", "two_outputs_two_labels"])
def test_predict_batched_metrics__mirrors_test_predict_with_batch_eval_metrics(tmp_path, variant):
    _, tb = _predict(
        tmp_path, variant, batch_eval_metrics=True, trainer_kwargs={"compute_metrics": BatchedAlmostAccuracy()}
    )
    data = RegressionData()
    assert tb.metrics["test_accuracy"] == pytest.approx(expected_eval(1.5, 2.5, data)["eval_accuracy"], abs=1e-7)


@pytest.mark.parametrize("eval_accumulation_steps", [None, 2], ids=["whole", "accumulated"])
def test_uneven_shapes_padded__mirrors_test_dynamic_shapes(tmp_path, eval_accumulation_steps):
    data = VariableLengthData(batch_size=8)

    def scenario(impl, d):
        args = impl.args(d, eval_accumulation_steps=eval_accumulation_steps)
        trainer = impl.Trainer(RegressionModel(a=2, b=1), args, eval_dataset=data)
        return trainer.evaluate(), trainer.predict(data)

    (hf_m, hf_p), (tb_m, tb_p) = run_both(scenario, tmp_path)
    assert_same_metrics(hf_m, tb_m)
    assert_same_arrays(hf_p.predictions, tb_p.predictions)
    assert_same_arrays(hf_p.label_ids, tb_p.label_ids)
    # the test's own pin: each row is the sample, then -100 up to the longest batch
    for x, y, pred, label in zip(data.xs, data.ys, tb_p.predictions, tb_p.label_ids):
        np.testing.assert_array_equal(pred[: len(x)], 2 * x + 1)
        np.testing.assert_array_equal(label[: len(y)], y)
        assert (pred[len(x) :] == -100).all() and (label[len(y) :] == -100).all()


def test_iterable_eval_set__mirrors_test_evaluation_iterable_dataset(tmp_path):
    def scenario(impl, d):
        data = IterableRegressionData(label_names=["labels", "extra"])  # "extra": not a forward argument
        trainer = impl.Trainer(
            RegressionModel(a=1.5, b=2.5), impl.args(d), eval_dataset=data, compute_metrics=AlmostAccuracy()
        )
        return trainer.evaluate(), trainer.evaluate(IterableRegressionData(length=66))

    (hf1, hf2), (tb1, tb2) = run_both(scenario, tmp_path)
    assert_same_metrics(hf1, tb1)
    assert_same_metrics(hf2, tb2)
    expected = expected_eval(1.5, 2.5, RegressionData(length=66))
    assert tb2["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-5)
    assert tb2["eval_accuracy"] == pytest.approx(expected["eval_accuracy"], abs=1e-7)


def test_iterable_test_set__mirrors_test_predict_iterable_dataset(tmp_path):
    def scenario(impl, d):
        trainer = impl.Trainer(RegressionModel(a=1.5, b=2.5), impl.args(d), compute_metrics=AlmostAccuracy())
        return trainer.predict(IterableRegressionData()), trainer.predict(
            IterableRegressionData(length=66, label_names=["labels", "extra"])
        )

    (hf1, hf2), (tb1, tb2) = run_both(scenario, tmp_path)
    for hf, tb, n in ((hf1, tb1, 64), (hf2, tb2, 66)):
        assert_same_arrays(hf.predictions, tb.predictions)
        assert_same_arrays(hf.label_ids, tb.label_ids)
        assert_same_metrics(hf.metrics, tb.metrics)
        np.testing.assert_allclose(tb.predictions, 1.5 * RegressionData(length=n).x + 2.5, rtol=1e-6)


def test_named_eval_sets__mirrors_test_trainer_eval_multiple(tmp_path):
    def scenario(impl, d):
        evals = {"data1": RegressionData(length=16), "data2": RegressionData(length=24, seed=7)}
        trainer = impl.Trainer(
            RegressionModel(a=1.5, b=2.5),
            impl.args(d, per_device_eval_batch_size=1),
            eval_dataset=evals,
            compute_metrics=AlmostAccuracy(),
        )
        return trainer.evaluate()

    hf, tb = run_both(scenario, tmp_path)
    assert_same_metrics(hf, tb)
    assert "eval_data1_loss" in tb and "eval_data2_loss" in tb


def test_cache_dropped_by_default__mirrors_test_evaluation_with_keys_to_drop(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    x = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for _ in range(8)]

    def build():
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=16, n_layer=2, n_head=2))

    def scenario(impl, d):
        trainer = impl.Trainer(build(), impl.args(d), eval_dataset=data)
        return trainer.predict(data)

    hf, tb = run_both(scenario, tmp_path)
    # what transformers' test pins: the cache is not a prediction, only the logits come back, as one array
    assert isinstance(hf.predictions, np.ndarray) and isinstance(tb.predictions, np.ndarray)
    assert_same_arrays(hf.predictions, tb.predictions, atol=1e-5)
    # test_loss: transformers wrong. Its prediction_step passes num_items_in_batch counted on the
    # unshifted labels (16 per row) because GPT2LMHeadModel's class name gives no "ForCausalLM" loss_type,
    # while the causal loss sums over the 15 shifted ones: it reports 15/16 of the loss (4.3210). The
    # model's own loss on the same rows (all rows are equal) is the right value (4.6090), trainbus's.
    with torch.no_grad():
        own = build().eval()(input_ids=x[None], labels=x[None]).loss.item()
    assert tb.metrics["test_loss"] == pytest.approx(own, rel=1e-5)
    assert hf.metrics["test_loss"] == pytest.approx(own * 15 / 16, rel=1e-5)  # transformers' value


def test_training_and_prediction_loss_agree__mirrors_test_train_and_predict_loss_parity(tmp_path):
    def loss_func(outputs, labels, num_items_in_batch=None):
        loss = torch.nn.functional.mse_loss(outputs[0] if isinstance(outputs, tuple) else outputs, labels)
        return loss if num_items_in_batch is None else loss / num_items_in_batch

    batch = {"input_x": torch.linspace(-1, 1, 6), "labels": torch.linspace(0, 3, 6)}

    def scenario(impl, d):
        model = RegressionModel(a=1.5, b=2.5)
        trainer = impl.Trainer(model, impl.args(d), compute_loss_func=loss_func)
        train_loss = trainer.training_step(model, dict(batch), 6)
        predict_loss = trainer.prediction_step(model, dict(batch), prediction_loss_only=True)[0]
        return float(train_loss), float(predict_loss)

    hf, tb = run_both(scenario, tmp_path)
    assert tb[0] == pytest.approx(hf[0], rel=1e-6) and tb[1] == pytest.approx(hf[1], rel=1e-6)
    # the test's pin: prediction_step's loss is training_step's (both pass the batch's item count, 6)
    expected = float(((1.5 * batch["input_x"] + 2.5 - batch["labels"]) ** 2).mean())
    assert tb[0] == pytest.approx(expected / 6, rel=1e-6) and tb[1] == pytest.approx(tb[0], rel=1e-6)


def test_memory_metrics__mirrors_test_mem_metrics(tmp_path):
    def scenario(impl, d):
        keys = []
        for skip in (False, True):
            trainer = regression_trainer(impl, d / str(skip), skip_memory_metrics=skip, max_steps=2)
            train = trainer.train().metrics
            evals = trainer.evaluate()
            test = trainer.predict(RegressionData()).metrics
            keys.append(
                (
                    "init_mem_cpu_alloc_delta" in train,
                    "train_mem_cpu_alloc_delta" in train,
                    "eval_mem_cpu_alloc_delta" in evals,
                    "test_mem_cpu_alloc_delta" in test,
                )
            )
        return keys

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb == [(True, True, True, True), (False, False, False, False)]


class _Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(4, 3)
        # transformers' Trainer reads model.config.problem_type when label_smoothing_factor is set (an
        # AttributeError for a plain module without config); give it one so the scenario runs there
        self.config = SimpleNamespace(problem_type=None)

    def forward(self, x, labels=None):
        logits = self.linear(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits, labels)
        return out


def test_label_smoothing__mirrors_test_label_smoothing(tmp_path):
    g = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g)
    data = [{"x": xs[i], "labels": ys[i]} for i in range(24)]
    epsilon = 0.1

    def scenario(impl, d):
        args = impl.args(d, label_smoothing_factor=epsilon, logging_steps=1, max_steps=3, learning_rate=0.1)
        trainer = impl.Trainer(_Classifier(), args, train_dataset=data, eval_dataset=data)
        fresh = trainer.evaluate()
        trainer.train()
        return fresh, trainer

    (hf_m, hf), (tb_m, tb) = run_both(scenario, tmp_path)
    assert_same_metrics(hf_m, tb_m)
    # the smoothed loss, computed here: (1 - eps) * NLL + eps * mean over classes of -log p
    logp = torch.log_softmax(_Classifier()(xs)["logits"].detach(), dim=-1)
    nll = -logp.gather(1, ys[:, None]).squeeze(1)
    smoothed = ((1 - epsilon) * nll + epsilon * (-logp.mean(dim=-1))).mean()
    assert tb_m["eval_loss"] == pytest.approx(float(smoothed), rel=1e-5)
    hf_losses = [r["loss"] for r in hf.state.log_history if "loss" in r]
    tb_losses = [r["loss"] for r in tb.state.log_history if "loss" in r]
    rounding = max(map(hf_release.loss_tolerance, hf_losses))  # 4.x logs round(loss, 4)
    np.testing.assert_allclose(tb_losses, hf_losses, rtol=1e-5, atol=rounding)


class _MultiLabel(_Classifier):
    """transformers' multi-label head: float targets, a binary cross-entropy; its config says so."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(problem_type="multi_label_classification")

    def forward(self, x, labels=None):
        logits = self.linear(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        return out


def test_label_smoothing_off_for_multi_label__mirrors_test_label_smoothing_multi_label_incompatibility(tmp_path):
    """transformers warns at construction and trains without smoothing; so does trainbus (same words)."""
    g = torch.Generator().manual_seed(6)
    xs, ys = torch.randn(16, 4, generator=g), (torch.rand(16, 3, generator=g) > 0.5).float()
    data = [{"x": xs[i], "labels": ys[i]} for i in range(16)]

    def scenario(impl, d):
        args = impl.args(d, label_smoothing_factor=0.1, logging_steps=1, max_steps=2, learning_rate=0.1)
        with pytest.warns(UserWarning, match="Label smoothing is not compatible with multi-label classification"):
            trainer = impl.Trainer(_MultiLabel(), args, train_dataset=data)
        trainer.train()
        return trainer

    hf, tb = run_both(scenario, tmp_path)
    assert hf.label_smoother is None and tb.label_smoother is None
    hf_losses = [r["loss"] for r in hf.state.log_history if "loss" in r]
    tb_losses = [r["loss"] for r in tb.state.log_history if "loss" in r]
    rounding = max(map(hf_release.loss_tolerance, hf_losses))
    np.testing.assert_allclose(tb_losses, hf_losses, rtol=1e-5, atol=rounding)
