"""HF TrainingArguments fields that trainbus used to accept only at their default (issue #18, items 7 and 10).

tf32, torch_empty_cache_steps, train_sampling_strategy / length_column_name, batch_eval_metrics,
eval_do_concat_batches, ignore_data_skip, dataloader_multiprocessing_context and use_liger_kernel:
each is checked against what transformers 5 does with it.
"""

from __future__ import annotations

import doctest
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from facade_helpers import Regressor, quiet_args, regression_data

from trainbus.engine import ConfigError, Event, Plugin
from trainbus.engine.events import BatchStartEvent
from trainbus.plugins.data import length_grouping
from trainbus.plugins.data.length_grouping import LengthGroupedEpochSampler, train_sampler
from trainbus.plugins.data.loading import EpochSampler, default_data_collator, skip_first_batches
from trainbus.plugins.evaluation.collector import EvalCollector
from trainbus.plugins.facade.arguments import TrainingArguments
from trainbus.plugins.facade.trainer import Trainer
from trainbus.plugins.optimization import device_settings, liger
from trainbus.plugins.optimization.device_settings import TF32, tf32_setting, tf32_supported
from trainbus.plugins.optimization.liger import LigerKernel


# -- tiny models and data ---------------------------------------------------------------------------
class TokenScorer(torch.nn.Module):
    """Scores every token (logits: batch x sequence); the loss compares the mean score with the label."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 1, padding_idx=0)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, idx: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        scores = self.embed(input_ids).squeeze(-1)
        out = {"logits": scores}
        if labels is not None:
            out["loss"] = torch.nn.functional.mse_loss(scores.mean(-1), labels)
        return out


def token_rows(lengths: list[int]) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    return [
        {"input_ids": torch.randint(1, 50, (n,), generator=g), "labels": float(i % 3), "idx": i}
        for i, n in enumerate(lengths)
    ]


def pad_collator(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    ids = [torch.as_tensor(r["input_ids"]) for r in rows]
    return {
        "input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True),
        "labels": torch.tensor([float(r["labels"]) for r in rows]),
        "idx": torch.tensor([int(r["idx"]) for r in rows]),
    }


class IndexedRegressor(Regressor):
    def forward(  # type: ignore[override]
        self, x: torch.Tensor, labels: torch.Tensor | None = None, idx: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        return super().forward(x, labels)


def indexed_regression(n: int) -> list[dict[str, Any]]:
    return [{**row, "idx": i} for i, row in enumerate(regression_data(n))]


class Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.lin(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits, labels)
        return out


def class_data(n: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(n, 3, generator=g)
    return [{"x": xs[i], "labels": int(xs[i, 0] > 0)} for i in range(n)]


def accuracy(p: Any) -> dict[str, float]:
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


class SeenBatches(Plugin):
    """Records the ``idx`` of every training batch."""

    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def attach(self, engine: Any) -> None:
        self.on(engine, Event.BATCH_START, self.batch_start)

    def batch_start(self, ev: BatchStartEvent) -> None:
        self.seen.append(ev.batch["idx"].tolist())


def batches_of(order: list[int], size: int) -> list[list[int]]:
    return [order[i : i + size] for i in range(0, len(order), size)]


def epoch_order(sampler: Any, epoch: int) -> list[int]:
    sampler.set_epoch(epoch)
    return list(sampler)


# -- tf32 -------------------------------------------------------------------------------------------
def test_tf32_true_needs_an_ampere_gpu() -> None:
    if tf32_supported():
        assert TrainingArguments("x", tf32=True).tf32 is True
    else:  # HF raises too; trainbus names what it found
        with pytest.raises(ConfigError, match=r"tf32=True needs .*compute capability >= 8.0"):
            TrainingArguments("x", tf32=True)
    assert TrainingArguments("x", tf32=False).tf32 is False
    with pytest.raises(ConfigError, match="tf32 must be True, False or None"):
        TrainingArguments("x", tf32="yes")


def _tf32_flags() -> Any:
    backends = torch.backends
    if hasattr(backends, "fp32_precision"):  # torch >= 2.9 (the API HF uses there)
        return backends.fp32_precision
    return backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32


def _tf32_on() -> bool:
    flags = _tf32_flags()
    return flags == "tf32" if isinstance(flags, str) else all(flags)


@pytest.mark.parametrize("enabled", [True, False])
def test_tf32_plugin_sets_torch_and_restores_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, enabled: bool) -> None:
    monkeypatch.setattr(device_settings, "tf32_supported", lambda: True)  # as on an Ampere GPU
    original = _tf32_flags()
    restore = device_settings.set_tf32(not enabled)  # start from the opposite setting
    try:
        before = _tf32_flags()
        trainer = Trainer(
            Regressor(), quiet_args(tmp_path, tf32=enabled, max_steps=1), train_dataset=regression_data(4)
        )
        assert _tf32_on() is enabled
        trainer.pop_plugin(TF32)
        assert _tf32_flags() == before  # detaching restores the setting it found
    finally:
        restore()
    assert _tf32_flags() == original


def test_tf32_setting_follows_hf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_settings, "tf32_supported", lambda: True)
    assert tf32_setting(None, torch_compile=True, fp16=False) is True  # HF: compile on Ampere turns TF32 on
    assert tf32_setting(None, torch_compile=True, fp16=True) is None
    assert tf32_setting(False, torch_compile=True, fp16=False) is False
    assert tf32_setting(None, torch_compile=False, fp16=False) is None
    monkeypatch.setattr(device_settings, "tf32_supported", lambda: False)
    assert tf32_setting(None, torch_compile=True, fp16=False) is None


def test_tf32_unset_adds_no_plugin(tmp_path: Path) -> None:
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=1), train_dataset=regression_data(4))
    assert trainer.get_plugin(TF32) is None


# -- torch_empty_cache_steps ------------------------------------------------------------------------
def test_empty_cache_every_n_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    trainer = Trainer(
        Regressor(), quiet_args(tmp_path, max_steps=7, torch_empty_cache_steps=3), train_dataset=regression_data(8)
    )
    monkeypatch.setattr(
        "accelerate.utils.memory.clear_device_cache", lambda *a, **k: calls.append(trainer.state.global_step)
    )
    trainer.train()
    assert calls == [3, 6]


@pytest.mark.parametrize("value", [0, -2, 1.5])
def test_empty_cache_steps_must_be_positive(value: Any) -> None:
    message = r"torch_empty_cache_steps (\(or None\) must be an integer >= 1|must be an int)"
    with pytest.raises(ConfigError, match=message):
        TrainingArguments("x", torch_empty_cache_steps=value)


# -- train_sampling_strategy ------------------------------------------------------------------------
LENGTHS = [int(n) for n in torch.randint(1, 30, (32,), generator=torch.Generator().manual_seed(3))]


def _padding(batches: list[list[int]], lengths: list[int]) -> int:
    return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)


class EpochStartRng(Plugin):
    """Records torch's global generator state as each epoch starts."""

    def __init__(self) -> None:
        self.states: list[torch.Tensor] = []

    def attach(self, engine: Any) -> None:
        self.on(engine, Event.EPOCH_START, lambda ev: self.states.append(torch.get_rng_state()))


def transformers_draw(state: torch.Tensor, lengths: list[int], group: int) -> list[int]:
    """transformers' epoch order from the global generator at the epoch's start: the DataLoader draws
    its base seed (one int64), then LengthGroupedSampler's get_length_grouped_indices draws the shuffle."""
    from transformers.trainer_pt_utils import get_length_grouped_indices

    generator = torch.Generator()
    generator.set_state(state)
    torch.empty((), dtype=torch.int64).random_(generator=generator)
    return list(get_length_grouped_indices(lengths, group, generator=generator))


def test_group_by_length_trains_on_transformers_length_groups(tmp_path: Path) -> None:
    args = quiet_args(
        tmp_path,
        train_sampling_strategy="group_by_length",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        seed=5,
    )
    trainer = Trainer(
        TokenScorer(),
        args,
        train_dataset=token_rows(LENGTHS),
        data_collator=pad_collator,
        callbacks=[SeenBatches(), EpochStartRng()],
    )
    trainer.train()
    assert isinstance(trainer.train_data.sampler, LengthGroupedEpochSampler)
    states = trainer.get_plugin(EpochStartRng).states
    expected = []
    for state in states:  # transformers' grouping over batch x accumulation, shuffled by the global generator
        expected += batches_of(transformers_draw(state, LENGTHS, 4), 2)
    seen = trainer.get_plugin(SeenBatches).seen
    assert len(states) == 2 and seen == expected
    assert seen[:16] != seen[16:]  # the generator moved on: another order in the second epoch
    random_order = batches_of(epoch_order(EpochSampler(32, 5), 0), 2)
    assert _padding(seen[:16], LENGTHS) < _padding(random_order, LENGTHS) / 2


def test_group_by_length_reads_the_length_column(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from transformers.trainer_pt_utils import get_length_grouped_indices

    rows = token_rows(LENGTHS)
    fake = [100 - i for i in range(32)]  # the column wins over the real lengths
    table = datasets.Dataset.from_dict(
        {
            "input_ids": [r["input_ids"].tolist() for r in rows],
            "labels": [r["labels"] for r in rows],
            "idx": [r["idx"] for r in rows],
            "n_tokens": fake,
        }
    )
    args = quiet_args(
        tmp_path,
        train_sampling_strategy="group_by_length",
        length_column_name="n_tokens",
        per_device_train_batch_size=4,
    )
    trainer = Trainer(TokenScorer(), args, train_dataset=table, data_collator=pad_collator)
    order = get_length_grouped_indices(fake, 4, generator=torch.Generator().manual_seed(42))
    assert epoch_order(trainer.get_train_dataloader().sampler, 0) == order
    assert "n_tokens" not in next(iter(trainer.get_train_dataloader()))  # the column is still removed before batching


def test_group_by_length_sampler_draws_from_the_global_generator_and_resumes() -> None:
    sampler = LengthGroupedEpochSampler(4, LENGTHS, seed=1)
    torch.manual_seed(1)
    first = epoch_order(sampler, 3)
    torch.manual_seed(1)
    assert epoch_order(sampler, 3) == first and sorted(first) == list(range(32))
    assert epoch_order(sampler, 4) != first  # the generator moved on
    torch.manual_seed(1)
    epoch_order(sampler, 3)
    saved = sampler.state_dict()
    assert saved["epoch"] == 3
    resumed = LengthGroupedEpochSampler(4, LENGTHS, seed=1)
    resumed.load_state_dict(saved)
    torch.manual_seed(999)
    before = torch.get_rng_state()
    assert epoch_order(resumed, 3) == first  # the saved epoch's draw again, from its own generator
    assert torch.equal(torch.get_rng_state(), before)  # the global generator is the resume's to restore


def test_sequential_strategy(tmp_path: Path) -> None:
    args = quiet_args(tmp_path, train_sampling_strategy="sequential", per_device_train_batch_size=3, max_steps=4)
    trainer = Trainer(IndexedRegressor(), args, train_dataset=indexed_regression(12), callbacks=[SeenBatches()])
    trainer.train()
    assert trainer.get_plugin(SeenBatches).seen == batches_of(list(range(12)), 3)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"train_sampling_strategy": "batch_rebalance"}, "'batch_rebalance' is not supported"),
        ({"train_sampling_strategy": "shuffled"}, r"must be one of \['random', 'sequential', 'group_by_length'\]"),
        ({"group_by_length": True, "train_sampling_strategy": "sequential"}, "group_by_length=True .* pass one"),
    ],
)
def test_bad_sampling_strategies(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TrainingArguments("x", **kwargs)


def test_group_by_length_needs_lengths() -> None:
    with pytest.raises(ConfigError, match=r"needs each example's length.*'input_ids'"):
        train_sampler(regression_data(4), "group_by_length", seed=0, group_size=2)
    with pytest.raises(ConfigError, match="map-style"):
        train_sampler(iter(token_rows([3, 4])), "group_by_length", seed=0, group_size=2)
    assert train_sampler(iter(token_rows([3, 4])), "random", seed=0, group_size=2) is None


# -- batch_eval_metrics -----------------------------------------------------------------------------
class BatchAccuracy:
    """An HF-style batched compute_metrics: accumulates per batch, returns on compute_result=True."""

    def __init__(self) -> None:
        self.calls: list[tuple[type, tuple[int, ...], bool]] = []
        self.inputs: list[Any] = []
        self.correct = self.total = 0

    def __call__(self, p: Any, compute_result: bool) -> dict[str, float] | None:
        self.calls.append((type(p.predictions), tuple(p.predictions.shape), compute_result))
        self.inputs.append(p.inputs)
        self.correct += int((p.predictions.argmax(-1) == p.label_ids).sum())
        self.total += len(p.label_ids)
        if not compute_result:
            return None
        result = {"accuracy": self.correct / self.total}
        self.correct = self.total = 0
        return result


def test_batch_eval_metrics_calls_compute_metrics_per_batch(tmp_path: Path) -> None:
    data = class_data(10)
    metrics = BatchAccuracy()
    args = quiet_args(tmp_path, batch_eval_metrics=True, include_for_metrics=["inputs"])
    trainer = Trainer(Classifier(), args, eval_dataset=data, compute_metrics=metrics)
    result = trainer.evaluate()
    assert metrics.calls == [(torch.Tensor, (4, 2), False), (torch.Tensor, (4, 2), False), (torch.Tensor, (2, 2), True)]
    assert [tuple(i["x"].shape) for i in metrics.inputs] == [(4, 3), (4, 3), (2, 3)]  # HF: the whole batch
    whole = Trainer(Classifier(), quiet_args(tmp_path), eval_dataset=data, compute_metrics=accuracy).evaluate()
    assert result["eval_accuracy"] == pytest.approx(whole["eval_accuracy"])
    assert result["eval_loss"] == pytest.approx(whole["eval_loss"])
    assert trainer.get_plugin(EvalCollector).last.predictions is None  # evaluation keeps no logits

    out = trainer.predict(data)  # predict keeps them, and still calls per batch (HF)
    assert out.predictions.shape == (10, 2) and out.metrics["test_accuracy"] == result["eval_accuracy"]
    assert [c[2] for c in metrics.calls[3:]] == [False, False, True]


def test_batch_eval_metrics_needs_compute_result(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="takes no compute_result argument"):
        Trainer(Classifier(), quiet_args(tmp_path, batch_eval_metrics=True), eval_dataset=class_data(4),
                compute_metrics=accuracy)  # fmt: skip


# -- eval_do_concat_batches -------------------------------------------------------------------------
@pytest.mark.parametrize("accumulation", [None, 2])
def test_eval_do_concat_batches_false_keeps_batches(tmp_path: Path, accumulation: int | None) -> None:
    lengths = [3, 7, 2, 5, 9, 4, 6, 1, 8, 2]
    seen: list[Any] = []

    def metrics(p: Any) -> dict[str, float]:
        seen.append(p)
        return {"batches": len(p.predictions)}

    def run(concat: bool) -> tuple[Any, Any]:
        args = quiet_args(tmp_path, eval_do_concat_batches=concat, eval_accumulation_steps=accumulation)
        trainer = Trainer(
            TokenScorer(), args, eval_dataset=token_rows(lengths), data_collator=pad_collator, compute_metrics=metrics
        )
        return trainer.evaluate(), trainer.predict(token_rows(lengths))

    listed, predicted = run(False)
    assert listed["eval_batches"] == 3
    assert [a.shape for a in seen[-1].predictions] == [(4, 7), (4, 9), (2, 8)]  # each batch's own padding
    assert [a.shape for a in seen[-1].label_ids] == [(4,), (4,), (2,)]
    assert isinstance(predicted.predictions, list) and all(isinstance(a, np.ndarray) for a in predicted.predictions)
    concatenated, whole = run(True)
    assert whole.predictions.shape == (10, 9)
    for batch, rows in zip(predicted.predictions, (slice(0, 4), slice(4, 8), slice(8, 10))):
        np.testing.assert_array_equal(batch, whole.predictions[rows, : batch.shape[1]])
    assert listed["eval_loss"] == pytest.approx(concatenated["eval_loss"])


# -- ignore_data_skip -------------------------------------------------------------------------------
@pytest.mark.parametrize("ignore", [True, False])
def test_ignore_data_skip_restarts_the_epoch(tmp_path: Path, ignore: bool) -> None:
    def args(out: Path, **kwargs: Any) -> TrainingArguments:
        return quiet_args(out, per_device_train_batch_size=2, num_train_epochs=2, **kwargs)

    first = Trainer(IndexedRegressor(), args(tmp_path, save_strategy="steps", save_steps=4),
                    train_dataset=indexed_regression(12))  # fmt: skip
    first.train()
    resumed = Trainer(
        IndexedRegressor(),
        args(tmp_path / "resumed", ignore_data_skip=ignore),
        train_dataset=indexed_regression(12),
        callbacks=[SeenBatches()],
    )
    out = resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    epoch0, epoch1 = (batches_of(epoch_order(EpochSampler(12, 42), e), 2) for e in (0, 1))
    seen = resumed.get_plugin(SeenBatches).seen
    if ignore:  # HF: the interrupted epoch from its first batch; the run still ends at its 12 steps
        assert seen == epoch0 + epoch1[:2]
    else:
        assert seen == epoch0[4:] + epoch1
    assert out.global_step == 12 and resumed.state.epoch == pytest.approx(2.0 if not ignore else 1 + 2 / 6)


# -- dataloader_multiprocessing_context -------------------------------------------------------------
def test_multiprocessing_context_reaches_the_workers(tmp_path: Path) -> None:
    args = quiet_args(
        tmp_path,
        dataloader_num_workers=1,
        dataloader_multiprocessing_context="spawn",
        remove_unused_columns=False,  # default_data_collator alone: a spawned worker unpickles it by name
        max_steps=2,
    )
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(8), data_collator=default_data_collator)
    loader = trainer.get_train_dataloader()
    assert loader.multiprocessing_context.get_start_method() == "spawn"
    assert skip_first_batches(loader, 1).multiprocessing_context.get_start_method() == "spawn"  # resume keeps it
    assert trainer.train().global_step == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dataloader_multiprocessing_context": "threads", "dataloader_num_workers": 1}, "must be one of"),
        ({"dataloader_multiprocessing_context": "spawn"}, "set dataloader_num_workers > 0"),
    ],
)
def test_bad_multiprocessing_context(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TrainingArguments("x", **kwargs)


# -- use_liger_kernel -------------------------------------------------------------------------------
LIGER_RUNS = importlib.util.find_spec("liger_kernel") is not None and torch.cuda.is_available()


@pytest.mark.skipif(LIGER_RUNS, reason="this machine has liger-kernel and a GPU: the error path cannot happen")
def test_liger_kernel_needs_liger_and_a_gpu() -> None:
    with pytest.raises(ConfigError, match="use_liger_kernel=True needs liger-kernel and a CUDA GPU"):
        TrainingArguments("x", use_liger_kernel=True)
    with pytest.raises(ConfigError, match="needs liger-kernel and a CUDA GPU"):
        LigerKernel({"rope": True})


def test_liger_kernel_config_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="liger_kernel_config is set but use_liger_kernel=False"):
        TrainingArguments("x", liger_kernel_config={"rope": True})
    with pytest.raises(ConfigError, match="liger_kernel_config must be None or a dict"):
        liger.check_liger_kernel(["rope"])


# -- docs -------------------------------------------------------------------------------------------
def test_doctests() -> None:
    for module in (length_grouping, device_settings):
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0
