"""Every permutation of a composition's plugin list gives the same logs, checkpoints and weights (#35 item 1):
the README's Engine examples (with sinks, ignite metrics and checkpoints added) and the default Trainer's
composition. Hypothesis draws the permutation; the reference is the list as written."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ignite.metrics import Accuracy
from safetensors.torch import load_file

from trainbus.engine import Engine, Plugin
from trainbus.plugins import (
    EMA,
    Checkpointing,
    CsvSink,
    EvalCollector,
    FlowControl,
    GradientAccumulation,
    GradientClipping,
    IgniteMetrics,
    JsonlSink,
    LRScheduler,
    MixedPrecision,
    SkipNonFinite,
    TrainLogger,
)

#: what differs between two runs of one composition in one order: wall-clock figures, the run's identity, paths
VOLATILE = ("runtime", "per_second", "run_id", "time", "path", "output_dir", "logging_dir")


def volatile(key: str) -> bool:
    return any(part in key for part in VOLATILE)


def canonical(value: Any) -> Any:
    """Dicts without volatile keys (compared as dicts: key order is the producers', which is free), floats
    as they are (bit for bit), tensors as lists."""
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items() if not volatile(str(k))}
    if isinstance(value, list | tuple):
        return [canonical(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def outcome(engine: Engine, out: Path) -> dict[str, Any]:
    """What a permutation must not change: logs (history, JSONL, CSV), checkpoints' files, weights, metrics."""
    found: dict[str, Any] = {"history": canonical(engine.state.log_history)}
    found["weights"] = canonical(dict(engine.model.state_dict()))
    for path in sorted(out.rglob("*")):
        name = path.relative_to(out).as_posix()
        if path.suffix == ".jsonl":
            found[name] = [canonical(json.loads(line)) for line in path.read_text().splitlines()]
        elif path.suffix == ".csv":
            with path.open(newline="") as handle:
                found[name] = [canonical(row) for row in csv.DictReader(handle)]
        elif path.name == "manifest.json":  # the hashes of JSON files with wall-clock figures vary: those files
            manifest = json.loads(path.read_text())  # are compared by content here, the tensors' files by hash
            manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.endswith(".json")}
            found[name] = canonical(manifest)
        elif path.suffix == ".json":
            found[name] = canonical(json.loads(path.read_text()))
        elif path.suffix == ".safetensors":
            found[name] = canonical(load_file(path))
        elif path.is_file():
            found[name] = "present"
    return found


def data(n: int = 48, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def loaders() -> tuple[Any, Any]:
    xs, ys = data()
    generator = torch.Generator().manual_seed(1)
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8, shuffle=True,
                                        generator=generator)  # fmt: skip
    valid = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs[:16], ys[:16]), batch_size=8)
    return train, valid


def quickstart(out: Path) -> tuple[Callable[[Sequence[Plugin]], Engine], list[Plugin]]:
    """README's first example, with ignite metrics, the JSONL / CSV sinks and checkpoints added."""
    plugins: list[Plugin] = [
        GradientAccumulation(2), MixedPrecision("bf16"), GradientClipping(max_norm=1.0),
        LRScheduler("cosine", warmup_ratio=0.1), EvalCollector(),
        FlowControl(logging_steps=2, eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3),
        TrainLogger(), IgniteMetrics({"accuracy": Accuracy()}), JsonlSink(out / "logs.jsonl"),
        CsvSink(out / "logs.csv"), Checkpointing(out / "ckpt", save_total_limit=2),
    ]  # fmt: skip

    def build(listed: Sequence[Plugin]) -> Engine:
        model = classifier()
        train, valid = loaders()
        return Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), train_data=train, eval_data=valid,
                      max_epochs=2, loss_fn=torch.nn.CrossEntropyLoss(), plugins=listed)  # fmt: skip

    return build, plugins


def ema_example(out: Path) -> tuple[Callable[[Sequence[Plugin]], Engine], list[Plugin]]:
    """README's EMA example, evaluated every epoch and logged."""
    plugins: list[Plugin] = [EMA(decay=0.9, eval_with_ema=True), EvalCollector(), TrainLogger(),
                             FlowControl(logging_steps=1, eval_strategy="epoch", save_strategy="no"),
                             JsonlSink(out / "logs.jsonl")]  # fmt: skip

    def build(listed: Sequence[Plugin]) -> Engine:
        model = classifier()
        train, valid = loaders()
        return Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2), train_data=train, eval_data=valid,
                      max_epochs=2, loss_fn=torch.nn.CrossEntropyLoss(), plugins=listed)  # fmt: skip

    return build, plugins


def skip_example(out: Path) -> tuple[Callable[[Sequence[Plugin]], Engine], list[Plugin]]:
    """README's SkipNonFinite example: one poisoned batch."""
    plugins: list[Plugin] = [LRScheduler("linear"), FlowControl(logging_steps=2, save_strategy="no"), TrainLogger(),
                             SkipNonFinite(), CsvSink(out / "logs.csv")]  # fmt: skip

    def build(listed: Sequence[Plugin]) -> Engine:
        model = classifier()
        xs, ys = data()
        batches = [(xs[i : i + 8].clone(), ys[i : i + 8]) for i in range(0, 48, 8)]
        batches[2][0][0, 0] = float("nan")
        return Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True), train_data=batches,
                      max_epochs=1, loss_fn=torch.nn.CrossEntropyLoss(), plugins=listed)  # fmt: skip

    return build, plugins


def run(example: Any, out: Path, order: Sequence[int] | None) -> dict[str, Any]:
    build, plugins = example(out)
    listed = plugins if order is None else [plugins[i] for i in order]
    engine = build(listed)
    engine.fit()
    if engine.has_eval_data:
        engine.evaluate()
    return outcome(engine, out)


EXAMPLES = {"quickstart": (quickstart, 11), "ema": (ema_example, 5), "skip_nonfinite": (skip_example, 5)}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_every_permutation_of_an_engine_composition_gives_the_same_run(name: str, tmp_path_factory: Any) -> None:
    example, size = EXAMPLES[name]
    reference = run(example, tmp_path_factory.mktemp("reference"), None)

    @settings(max_examples=8, deadline=None)
    @given(st.permutations(range(size)))
    def permuted(order: list[int]) -> None:
        got = run(example, tmp_path_factory.mktemp("permuted"), order)
        assert got.keys() == reference.keys(), sorted(set(got) ^ set(reference))
        for key in reference:
            assert got[key] == reference[key], f"{key} differs in plugin order {order}"

    permuted()


#: TrainingArguments beyond the default Trainer's: the docs' SETUP, then the best model, a schedule, bf16, eval on start
TRAINER_EXTRAS = {
    "setup": {},
    "best_bf16_schedule": {
        "load_best_model_at_end": True, "metric_for_best_model": "eval_loss", "lr_scheduler_type": "cosine",
        "warmup_ratio": 0.2, "weight_decay": 0.1, "bf16": True, "eval_on_start": True,
    },
}  # fmt: skip


def trainer_run(
    out: Path, order: Sequence[int] | None, monkeypatch: Any, extra: dict[str, Any]
) -> tuple[dict[str, Any], int]:
    """The default Trainer (evaluation, saving, logging every 2 steps, accumulation, clipping, metrics,
    the JSONL sink; ``extra`` arguments), its built plugin list permuted by ``order``."""
    from facade_helpers import Regressor, regression_data

    from trainbus.plugins import Trainer, TrainingArguments
    from trainbus.plugins.facade import trainer as trainer_module

    built = trainer_module.build_plugins
    count = [0]

    def permuted(*args: Any, **kwargs: Any) -> list[Plugin]:
        plugins = built(*args, **kwargs)
        count[0] = len(plugins)
        return plugins if order is None else [plugins[i] for i in order]

    monkeypatch.setattr(trainer_module, "build_plugins", permuted)
    args = TrainingArguments(
        str(out), eval_strategy="steps", save_strategy="steps", logging_steps=2, eval_steps=2, save_steps=2,
        max_grad_norm=1.0, gradient_accumulation_steps=2, num_train_epochs=2, per_device_train_batch_size=2,
        report_to="none", disable_tqdm=True, use_cpu=True, seed=0, save_total_limit=2, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(12), eval_dataset=regression_data(6, seed=1),
                      compute_metrics=lambda p: {"mean_prediction": float(p.predictions.mean())},
                      plugins=[JsonlSink(out / "logs.jsonl")])  # fmt: skip
    trainer.train()
    trainer.evaluate()
    monkeypatch.setattr(trainer_module, "build_plugins", built)
    found = outcome(trainer, out)
    found["plugins"] = sorted(p.name for p in trainer.plugins)
    return found, count[0]


@pytest.mark.parametrize("config", list(TRAINER_EXTRAS))
def test_every_permutation_of_the_default_trainers_composition_gives_the_same_run(
    config: str, tmp_path_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = TRAINER_EXTRAS[config]
    reference, size = trainer_run(tmp_path_factory.mktemp("reference"), None, monkeypatch, extra)
    assert size >= 8  # the composition SETUP in docs/events.md has this many built plugins

    @settings(max_examples=8, deadline=None)
    @given(st.permutations(range(size)))
    def permuted(order: list[int]) -> None:
        with pytest.MonkeyPatch.context() as patch:
            got, _ = trainer_run(tmp_path_factory.mktemp("permuted"), order, patch, extra)
        assert got.keys() == reference.keys(), sorted(set(got) ^ set(reference))
        for key in reference:
            assert got[key] == reference[key], f"{key} differs in plugin order {order}"

    permuted()
