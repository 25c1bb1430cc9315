"""EvalCollector: exact metrics over ragged batches, -100 padding, predict, host syncs, bad input."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import ConfigError, Engine, Event
from trainbus.engine.testing import SyncCounter
from trainbus.plugins.evaluation.collector import (
    EvalCollector,
    EvalPrediction,
    PredictionOutput,
    hf_prediction_step,
    nested_concat,
    pad_concat,
)

torch.manual_seed(0)
X = torch.randn(60, 3, dtype=torch.float64)
Y = torch.randint(0, 4, (60,))


def make_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(3, 4).double()


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]


def accuracy(p: EvalPrediction) -> dict[str, Any]:
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean()), "n": len(p.label_ids)}


@given(st.integers(1, 40), st.integers(1, 9), st.sampled_from([None, 1, 2, 3]))
def test_ragged_last_batch_gives_whole_set_metrics(n: int, batch_size: int, accumulation: int | None) -> None:
    model = make_model()
    collector = EvalCollector(accuracy, eval_accumulation_steps=accumulation)
    engine = Engine(model, loss_fn=torch.nn.CrossEntropyLoss(), plugins=[collector])
    metrics = engine.evaluate(batches(X[:n], Y[:n], batch_size))
    with torch.no_grad():
        logits = model(X[:n])
        loss = torch.nn.functional.cross_entropy(logits, Y[:n]).item()
    assert metrics["eval_loss"] == pytest.approx(loss, rel=1e-12, abs=1e-12)
    assert metrics["eval_accuracy"] == float((logits.argmax(-1) == Y[:n]).double().mean())
    assert metrics["eval_n"] == n
    assert collector.last is not None and collector.last.num_samples == n
    np.testing.assert_allclose(collector.last.predictions, logits.numpy(), rtol=1e-12)
    assert {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"} <= set(metrics)


class TokenModel(torch.nn.Module):
    """Per-token logits (batch, seq, 3) plus a per-sequence score, as a tuple."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.emb = torch.nn.Embedding(10, 3)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.emb(input_ids)
        out = {"logits": logits, "score": logits.sum(dim=(1, 2))}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits.reshape(-1, 3), labels.reshape(-1))
        return out


@given(st.lists(st.tuples(st.integers(1, 4), st.integers(1, 6)), min_size=1, max_size=5))
def test_ragged_sequences_padded_with_minus_100(shapes: list[tuple[int, int]]) -> None:
    gen = torch.Generator().manual_seed(len(shapes))
    data = [
        {"input_ids": torch.randint(0, 10, (b, s), generator=gen), "labels": torch.randint(0, 3, (b, s), generator=gen)}
        for b, s in shapes
    ]
    model = TokenModel()
    collector = EvalCollector(include_inputs=True)
    engine = Engine(model, plugins=[collector])
    engine.set_hook("prediction_step", hf_prediction_step())
    out = engine.predict(data)
    logits, scores = out.predictions
    longest = max(s for _, s in shapes)
    assert logits.shape == (sum(b for b, _ in shapes), longest, 3)
    assert out.label_ids.shape == (sum(b for b, _ in shapes), longest)
    assert collector.last is not None
    row = 0
    with torch.no_grad():
        for batch, (b, s) in zip(data, shapes, strict=True):
            expected = model(batch["input_ids"])
            np.testing.assert_allclose(logits[row : row + b, :s], expected["logits"].numpy(), rtol=1e-6)
            np.testing.assert_allclose(scores[row : row + b], expected["score"].numpy(), rtol=1e-6)
            assert (logits[row : row + b, s:] == -100).all()
            assert (out.label_ids[row : row + b, s:] == -100).all()
            np.testing.assert_array_equal(out.label_ids[row : row + b, :s], batch["labels"].numpy())
            row += b
    assert out.metrics is not None and set(out.metrics) >= {"test_loss", "test_runtime"}


def test_predict_output_and_prefixes() -> None:
    engine = Engine(make_model(), loss_fn=torch.nn.CrossEntropyLoss(), plugins=[EvalCollector(accuracy)])
    out = engine.predict(batches(X[:10], Y[:10], 4))
    assert isinstance(out, PredictionOutput)
    assert out._fields == ("predictions", "label_ids", "metrics")
    assert out.predictions.shape == (10, 4)
    np.testing.assert_array_equal(out.label_ids, Y[:10].numpy())
    assert set(out.metrics) == {
        "test_loss",
        "test_accuracy",
        "test_n",
        "test_runtime",
        "test_samples_per_second",
        "test_steps_per_second",
    }
    metrics = engine.evaluate(batches(X[:10], Y[:10], 4), prefix="val")
    assert "val_accuracy" in metrics and "val_loss" in metrics


def test_predict_without_labels_has_no_loss() -> None:
    engine = Engine(make_model(), plugins=[EvalCollector(accuracy)])
    out = engine.predict([X[:5], X[5:7]])
    assert out.label_ids is None and out.predictions.shape == (7, 4)
    assert "test_loss" not in out.metrics and "test_accuracy" not in out.metrics


def test_preprocess_logits_inputs_and_losses_reach_compute_metrics() -> None:
    seen: dict[str, Any] = {}

    def compute(p: EvalPrediction) -> dict[str, float]:
        seen["p"] = p
        return {"acc": float((p.predictions == p.label_ids).mean())}

    collector = EvalCollector(
        compute,
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1),
        include_inputs=True,
        include_losses=True,
    )
    engine = Engine(make_model(), loss_fn=torch.nn.CrossEntropyLoss(), plugins=[collector])
    engine.evaluate(batches(X[:7], Y[:7], 3))
    p = seen["p"]
    assert p.predictions.shape == (7,) and p.predictions.dtype == np.int64
    np.testing.assert_array_equal(p.inputs, X[:7].numpy())
    assert p.losses.shape == (7,)
    preds, _labels, _inputs, losses = p  # unpacks like HF
    assert preds is p.predictions and losses is p.losses


def test_prediction_loss_only_skips_predictions_and_metrics() -> None:
    called = []
    collector = EvalCollector(lambda p: called.append(p) or {}, prediction_loss_only=True)
    engine = Engine(make_model(), loss_fn=torch.nn.CrossEntropyLoss(), plugins=[collector])
    metrics = engine.evaluate(batches(X[:9], Y[:9], 4))
    assert "eval_loss" in metrics and not called
    assert collector.last is not None and collector.last.predictions is None


def test_eval_restores_train_mode_and_uses_inference_mode() -> None:
    model = make_model()
    flags = []
    engine = Engine(model, loss_fn=torch.nn.CrossEntropyLoss(), plugins=[EvalCollector()])
    engine.on(Event.EVAL_BATCH_END, lambda ev: flags.append((torch.is_inference_mode_enabled(), model.training)))
    model.train()
    engine.evaluate(batches(X[:4], Y[:4], 2))
    assert flags == [(True, False), (True, False)] and model.training


def test_bf16_logits_become_float32() -> None:
    model = make_model().to(torch.bfloat16)
    engine = Engine(model, loss_fn=torch.nn.CrossEntropyLoss(), plugins=[EvalCollector(accuracy)])
    data = batches(X[:6].to(torch.bfloat16), Y[:6], 4)
    out = engine.predict(data)
    assert out.predictions.dtype == np.float32 and isinstance(out.metrics["test_loss"], float)


def test_bert_model_output() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, num_labels=3
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    data = [
        {"input_ids": torch.randint(0, 50, (b, s)), "labels": torch.randint(0, 3, (b,))} for b, s in ((4, 7), (3, 5))
    ]
    engine = Engine(model, plugins=[EvalCollector(accuracy)])
    metrics = engine.evaluate(data)
    model.eval()
    with torch.no_grad():
        outs = [model(**batch) for batch in data]
    expected_loss = (outs[0].loss * 4 + outs[1].loss * 3).item() / 7
    assert metrics["eval_loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert engine.predict(data).predictions.shape == (7, 3)


def test_tuple_outputs_with_hf_prediction_step() -> None:
    class TwoHeads(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, x[:, :1]

    engine = Engine(TwoHeads(), loss_fn=lambda out, y: out.sum() * 0, plugins=[EvalCollector()])
    engine.set_hook("prediction_step", hf_prediction_step())
    out = engine.predict(batches(X[:5], Y[:5], 2))
    doubled, first = out.predictions
    np.testing.assert_allclose(doubled, X[:5].numpy() * 2)
    assert first.shape == (5, 1)


@pytest.mark.parametrize("accumulation", [None, 2])
def test_no_host_sync_per_eval_batch(accumulation: int | None) -> None:
    counts = []
    for n_batches in (2, 8):
        engine = Engine(
            make_model(),
            loss_fn=torch.nn.CrossEntropyLoss(),
            plugins=[EvalCollector(eval_accumulation_steps=accumulation)],
        )
        data = batches(X[: 3 * n_batches], Y[: 3 * n_batches], 3)
        with SyncCounter(on_device=lambda t: True) as counter:  # every read counts, the CPU's too
            engine.evaluate(data)
        counts.append(counter.count)
    # per evaluation, whatever the number of batches: the loss value, and the predictions and labels
    # handed to compute_metrics as numpy arrays
    assert counts[0] == counts[1] <= 3, counts


def test_compute_metrics_returning_non_numbers() -> None:
    engine = Engine(make_model(), loss_fn=torch.nn.CrossEntropyLoss(), plugins=[EvalCollector(lambda p: {"f": "x"})])
    with pytest.raises(TypeError, match=r"metric 'f' is str .*must be numbers"):
        engine.evaluate(batches(X[:4], Y[:4], 2))
    engine = Engine(make_model(), loss_fn=torch.nn.CrossEntropyLoss(), plugins=[EvalCollector(lambda p: [1.0])])
    with pytest.raises(TypeError, match="must return a dict"):
        engine.evaluate(batches(X[:4], Y[:4], 2))


def test_empty_eval_set() -> None:
    engine = Engine(make_model(), loss_fn=torch.nn.CrossEntropyLoss(), plugins=[EvalCollector()])
    with pytest.raises(ConfigError, match="'eval' dataset is empty"):
        engine.evaluate([])
    with pytest.raises(ConfigError, match="yielded no batches"):
        engine.evaluate(iter([]))


def test_bad_config() -> None:
    with pytest.raises(ConfigError, match="eval_accumulation_steps"):
        EvalCollector(eval_accumulation_steps=0)
    with pytest.raises(ConfigError, match="compute_metrics"):
        EvalCollector(compute_metrics="accuracy")  # type: ignore[arg-type]


def test_padding_helpers() -> None:
    a, b = torch.ones(2, 3), torch.zeros(1, 5)
    joined = pad_concat([a, b])
    assert joined.shape == (3, 5) and (joined[:2, 3:] == -100).all() and (joined[2] == 0).all()
    nested = nested_concat((a, {"k": a.numpy()}), (b, {"k": b.numpy()}))
    assert nested[0].shape == (3, 5) and nested[1]["k"].shape == (3, 5) and isinstance(nested[1]["k"], np.ndarray)
    assert nested_concat(None, a) is a
    with pytest.raises(ValueError, match="numbers of dimensions"):
        pad_concat([torch.ones(2, 3), torch.ones(2)])


def test_docstring_examples_run() -> None:
    import doctest

    from trainbus.plugins.control import best_model, early_stopping
    from trainbus.plugins.evaluation import collector, metrics

    for module in (collector, metrics, best_model, early_stopping):
        result = doctest.testmod(module)
        assert result.failed == 0 and result.attempted > 0, module.__name__
