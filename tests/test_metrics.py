"""IgniteMetrics: same numbers as compute_metrics, HF keys and prefixes, exact across 2 processes."""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist_helpers import free_port, run_processes
from hypothesis import given, settings
from hypothesis import strategies as st
from ignite.metrics import Accuracy, ConfusionMatrix, Fbeta, Loss, Precision, Recall, TopKCategoricalAccuracy
from sklearn.metrics import confusion_matrix, f1_score, precision_score, recall_score, top_k_accuracy_score

from trainbus.engine import ConfigError, Engine
from trainbus.plugins.distributed.processes import close_group
from trainbus.plugins.evaluation.collector import EvalCollector, EvalPrediction
from trainbus.plugins.evaluation.metrics import IgniteMetrics

N_CLASSES = 4
torch.manual_seed(0)
X = torch.randn(50, 3, dtype=torch.float64)
Y = torch.randint(0, N_CLASSES, (50,))


def make_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Linear(3, N_CLASSES).double()


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)]


def ignite_metrics() -> dict[str, Any]:
    return {
        "accuracy": Accuracy(),
        "precision": Precision(average=True),
        "recall": Recall(average=True),
        "f1": Fbeta(beta=1.0),
        "xent": Loss(torch.nn.CrossEntropyLoss()),
        "top2": TopKCategoricalAccuracy(k=2),
        "confusion": ConfusionMatrix(num_classes=N_CLASSES),
    }


def sklearn_metrics(p: EvalPrediction) -> dict[str, Any]:
    logits, labels = p.predictions, p.label_ids
    preds = logits.argmax(-1)
    classes = list(range(N_CLASSES))
    shifted = logits - logits.max(-1, keepdims=True)
    xent = float(np.mean(np.log(np.exp(shifted).sum(-1)) - shifted[np.arange(len(labels)), labels]))
    return {
        "accuracy": float((preds == labels).mean()),
        "precision": precision_score(labels, preds, labels=classes, average="macro", zero_division=0),
        "recall": recall_score(labels, preds, labels=classes, average="macro", zero_division=0),
        "xent": xent,
        "top2": top_k_accuracy_score(labels, logits, k=2, labels=classes),
    }


@settings(max_examples=15)
@given(st.integers(1, 30), st.integers(1, 7))
def test_ignite_plugin_equals_compute_metrics(n: int, batch_size: int) -> None:
    data = batches(X[:n], Y[:n], batch_size)
    collector = EvalCollector(sklearn_metrics)
    with_fn = Engine(make_model(), loss_fn=torch.nn.CrossEntropyLoss(), plugins=[collector]).evaluate(data)
    plugin = IgniteMetrics(ignite_metrics())
    with_ignite = Engine(make_model(), loss_fn=torch.nn.CrossEntropyLoss(), plugins=[plugin]).evaluate(data)
    for name in ("accuracy", "precision", "recall", "top2"):
        assert with_ignite[f"eval_{name}"] == pytest.approx(with_fn[f"eval_{name}"], abs=1e-12), name
    # ignite's Loss sums in float32
    assert with_ignite["eval_xent"] == pytest.approx(with_fn["eval_xent"], rel=1e-6)
    assert with_ignite["eval_xent"] == pytest.approx(with_fn["eval_loss"], rel=1e-6)
    assert collector.last is not None
    preds, labels = collector.last.predictions.argmax(-1), collector.last.label_ids
    classes = list(range(N_CLASSES))
    f1 = f1_score(labels, preds, labels=classes, average="macro", zero_division=0)
    assert with_ignite["eval_f1"] == pytest.approx(f1, abs=1e-9)
    assert with_ignite["eval_confusion"] == confusion_matrix(labels, preds, labels=classes).tolist()


def test_keys_with_named_sets_and_predict() -> None:
    engine = Engine(
        make_model(), loss_fn=torch.nn.CrossEntropyLoss(), plugins=[IgniteMetrics({"accuracy": Accuracy()})]
    )
    metrics = engine.evaluate({"a": batches(X[:10], Y[:10], 3), "b": batches(X[10:20], Y[10:20], 4)})
    assert set(metrics) == {"eval_a_accuracy", "eval_b_accuracy"}
    engine.add_plugin(EvalCollector())
    out = engine.predict(batches(X[:10], Y[:10], 3))
    assert out.metrics["test_accuracy"] == metrics["eval_a_accuracy"]
    assert IgniteMetrics({"accuracy": Accuracy()}).keys("eval_a") == ["eval_a_accuracy"]


def test_metrics_reset_between_evaluations() -> None:
    engine = Engine(
        make_model(), loss_fn=torch.nn.CrossEntropyLoss(), plugins=[IgniteMetrics({"accuracy": Accuracy()})]
    )
    first = engine.evaluate(batches(X[:20], Y[:20], 6))
    again = engine.evaluate(batches(X[:20], Y[:20], 6))
    assert first == again


def test_output_transform_and_per_metric_transform() -> None:
    def argmax_only(ev: Any) -> dict[str, Any]:
        return {"y_pred": torch.nn.functional.one_hot(ev.logits.argmax(-1), N_CLASSES), "y": ev.labels}

    plugin = IgniteMetrics(
        {"acc": Accuracy(), "acc_flip": Accuracy(output_transform=lambda out: (out["y_pred"], out["y"] * 0))},
        output_transform=argmax_only,
    )
    engine = Engine(make_model(), loss_fn=torch.nn.CrossEntropyLoss(), plugins=[plugin])
    metrics = engine.evaluate(batches(X[:20], Y[:20], 6))
    with torch.no_grad():
        preds = make_model()(X[:20]).argmax(-1)
    assert metrics["eval_acc"] == float((preds == Y[:20]).double().mean())
    assert metrics["eval_acc_flip"] == float((preds == 0).double().mean())


def test_bad_input() -> None:
    with pytest.raises(ConfigError, match="non-empty dict"):
        IgniteMetrics({})
    with pytest.raises(ConfigError, match=r"'acc' is a function, not an ignite\.metrics\.Metric"):
        IgniteMetrics({"acc": lambda p: 1.0})  # type: ignore[dict-item]
    engine = Engine(make_model(), loss_fn=torch.nn.CrossEntropyLoss(), plugins=[IgniteMetrics({"a": Accuracy()})])
    with pytest.raises(ConfigError, match="'eval' dataset is empty"):
        engine.evaluate([])
    with pytest.raises(ConfigError, match="saw no samples"):
        engine.evaluate(iter([]))


# -- two processes ---------------------------------------------------------------------------------
# 11 samples on 2 ranks: the sampler repeats one. Batch size 3 puts it in a batch with real samples,
# 1 makes a batch of padding only, 4 leaves ragged tails.
DIST_N, DIST_BATCHES = 11, (3, 1, 4)


class _SeqData(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sequences of 2-4 values: per-token predictions are ragged across batches and processes."""

    def __len__(self) -> int:
        return DIST_N

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(2 + i % 3, generator=g, dtype=torch.float64), "labels": torch.tensor(i % N_CLASSES)}


def _collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    x = torch.nn.utils.rnn.pad_sequence([item["x"] for item in items], batch_first=True, padding_value=math.nan)
    return {"x": x, "labels": torch.stack([item["labels"] for item in items])}


class _TokenModel(torch.nn.Module):
    """Per-token logits (batch, seq, classes), -100 where the sequence is padding."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.lin = torch.nn.Linear(1, N_CLASSES).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lin(torch.nan_to_num(x)[..., None])
        return torch.where(torch.isnan(x)[..., None], torch.full_like(logits, -100.0), logits)


def _first_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, 0], labels)


def _evaluate(rank: int | None, world: int, batch_size: int) -> dict[str, Any]:
    from torch.utils.data import DataLoader, DistributedSampler

    data = _SeqData()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False) if rank is not None else None
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, collate_fn=_collate)
    collector = EvalCollector(lambda p: {"mean_first": float(p.predictions[:, 0].mean())}, include_inputs=True)
    metrics = IgniteMetrics(
        {"accuracy": Accuracy(), "xent": Loss(torch.nn.CrossEntropyLoss())},
        output_transform=lambda ev: (ev.logits[:, 0], ev.labels),
    )
    engine = Engine(_TokenModel(), loss_fn=_first_token_loss, plugins=[collector, metrics])
    engine.set_hook("forward", lambda m, batch: m(batch["x"]))
    result = engine.evaluate(loader)
    assert collector.last is not None
    return {
        "metrics": {k: v for k, v in result.items() if "second" not in k and "runtime" not in k},
        "predictions": collector.last.predictions.tolist(),
        "labels": collector.last.label_ids.tolist(),
        "samples": collector.last.num_samples,
    }


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world)
    )
    torch.set_num_threads(1)
    from accelerate import PartialState

    state = PartialState(cpu=True)  # initialises the gloo process group as `accelerate launch` does
    try:
        result = [_evaluate(rank, world, batch_size) for batch_size in DIST_BATCHES]
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        close_group()  # every rank waits, and gloo's threads cannot abort the exit (processes.py)
    finally:
        state.destroy_process_group()  # failed before close_group (the group is gone otherwise)


def test_two_process_eval_equals_single_process(tmp_path: Path) -> None:
    run_processes(_worker, (2, free_port(), str(tmp_path)))
    for rank, batch_size in itertools.product((0, 1), range(len(DIST_BATCHES))):
        single = _evaluate(None, 1, DIST_BATCHES[batch_size])
        got = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())[batch_size]
        assert got["labels"] == single["labels"]
        assert got["samples"] == single["samples"] == DIST_N
        assert np.array(single["predictions"]).shape == (DIST_N, 4, N_CLASSES)
        np.testing.assert_allclose(got["predictions"], single["predictions"], rtol=1e-12)
        assert got["metrics"].keys() == single["metrics"].keys()
        for key, value in single["metrics"].items():
            tolerance = 1e-6 if key == "eval_xent" else 1e-12  # ignite's Loss sums in float32
            assert got["metrics"][key] == pytest.approx(value, rel=tolerance), key
