"""Data for the facade: collators, unused columns, seeded shuffling, resumable epochs that skip in the sampler."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from facade_helpers import Regressor, quiet_args, regression_data, tiny_bert
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import ConfigError
from trainbus.plugins.data.loading import (
    DataCollatorWithPadding,
    EpochSampler,
    RemoveColumnsCollator,
    build_dataloader,
    default_data_collator,
    remove_unused_columns,
    resumable_epoch_iterator,
    signature_columns,
)
from trainbus.plugins.facade.trainer import Trainer


def test_default_collator_dicts() -> None:
    features = [
        {"input_ids": [1, 2, 3], "label": 1, "text": "a", "score": 0.5, "mask": torch.ones(3)},
        {"input_ids": [4, 5, 6], "label": 0, "text": "b", "score": 1.5, "mask": torch.zeros(3)},
    ]
    batch = default_data_collator(features)
    assert set(batch) == {"input_ids", "labels", "score", "mask"}
    assert batch["labels"].dtype == torch.long and batch["labels"].tolist() == [1, 0]
    assert batch["input_ids"].shape == (2, 3)
    assert batch["mask"].shape == (2, 3)
    float_labels = default_data_collator([{"x": [1.0], "label": 0.5}, {"x": [2.0], "label": 1.5}])
    assert float_labels["labels"].dtype == torch.float


def test_default_collator_tuples() -> None:
    x, y = default_data_collator([(torch.ones(2), 1), (torch.zeros(2), 0)])
    assert x.shape == (2, 2) and y.tolist() == [1, 0]


def _tokenizer(tmp_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world", "a", "b"]
    path = tmp_path / "vocab.txt"
    path.write_text("\n".join(vocab))
    return transformers.BertTokenizerFast(vocab_file=str(path))


def test_padding_collator_with_a_local_tokenizer(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path)
    features = [dict(tok("hello"), label=1), dict(tok("hello world a b"), label=0)]
    batch = DataCollatorWithPadding(tok)(features)
    assert batch["input_ids"].shape == (2, 6)
    assert batch["attention_mask"][0].tolist() == [1, 1, 1, 0, 0, 0]
    assert batch["labels"].tolist() == [1, 0]


def test_trainer_pads_with_processing_class(tmp_path: Path) -> None:
    tok = _tokenizer(tmp_path)
    texts = ["hello", "hello world", "a b a b", "world"] * 2
    data = [dict(tok(t), label=i % 2) for i, t in enumerate(texts)]
    trainer = Trainer(tiny_bert(), quiet_args(tmp_path, max_steps=2), train_dataset=data, processing_class=tok)
    assert isinstance(trainer.data_collator, DataCollatorWithPadding)
    assert trainer.train().global_step == 2


def test_remove_unused_columns_collator(tmp_path: Path) -> None:
    data = [dict(d, extra=torch.tensor(1.0), idx=i) for i, d in enumerate(regression_data(8))]
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=2), train_dataset=data)
    batch = next(iter(trainer.get_train_dataloader()))
    assert set(batch) == {"x", "labels"}
    assert trainer.train().global_step == 2


def test_remove_unused_columns_off_keeps_columns(tmp_path: Path) -> None:
    data = [dict(d, extra=torch.tensor(1.0)) for d in regression_data(8)]
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=1, remove_unused_columns=False), train_dataset=data)
    assert "extra" in next(iter(trainer.get_train_dataloader()))


def test_nothing_left_is_a_clear_error() -> None:
    collate = RemoveColumnsCollator(
        default_data_collator, signature_columns(Regressor(), ["labels"]), Regressor()
    )
    with pytest.raises(ConfigError, match=r"no column of the dataset \(\['a', 'b'\]\) matches"):
        collate([{"a": 1, "b": 2}])


def test_hf_datasets_dataset(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict(
        {"x": [[float(i), 1.0] for i in range(8)], "labels": [float(i) for i in range(8)], "text": ["t"] * 8}
    )
    assert remove_unused_columns(ds, Regressor(), ["labels"]).column_names == ["x", "labels"]
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=2), train_dataset=ds, eval_dataset=ds)
    assert trainer.train().global_step == 2
    assert "eval_loss" in trainer.evaluate()
    with pytest.raises(ConfigError, match="no column"):
        remove_unused_columns(datasets.Dataset.from_dict({"a": [1], "b": [2]}), Regressor(), ["labels"])


def test_epoch_sampler_is_seeded_per_epoch() -> None:
    a, b = EpochSampler(20, seed=3), EpochSampler(20, seed=3)
    a.set_epoch(2)
    b.set_epoch(2)
    torch.manual_seed(0)
    first = list(a)
    torch.manual_seed(1)  # the global RNG does not matter
    assert first == list(b)
    b.set_epoch(3)
    assert first != list(b) and sorted(first) == list(range(20))


def test_data_seed_sets_the_order(tmp_path: Path) -> None:
    def first_batch(**kw: Any) -> list[float]:
        trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=1, **kw), train_dataset=regression_data(16))
        return next(iter(trainer.get_train_dataloader()))["labels"].tolist()

    assert first_batch(seed=1) == first_batch(seed=1)
    assert first_batch(seed=1, data_seed=5) == first_batch(seed=2, data_seed=5)
    assert first_batch(seed=1, data_seed=5) != first_batch(seed=1, data_seed=6)


class CountingDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n
        self.loaded: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.loaded.append(i)
        return torch.tensor([i])


@given(n=st.integers(1, 30), batch=st.integers(1, 5), epoch=st.integers(0, 3), data=st.data())
def test_skip_in_the_sampler_without_loading(n: int, batch: int, epoch: int, data: st.DataObject) -> None:
    dataset = CountingDataset(n)
    loader = build_dataloader(dataset, batch_size=batch, collate_fn=default_data_collator, shuffle=True, seed=7)
    full = [b.tolist() for b in resumable_epoch_iterator(loader, epoch, 0)]
    skip = data.draw(st.integers(0, len(full)))
    dataset.loaded.clear()
    rest = [b.tolist() for b in resumable_epoch_iterator(loader, epoch, skip)]
    assert rest == full[skip:]
    assert len(dataset.loaded) == sum(len(b) for b in rest)  # the skipped batches were never loaded


def test_iterable_data_skips_by_iteration() -> None:
    loader = build_dataloader(
        iter_data := _Stream(10), batch_size=3, collate_fn=default_data_collator, shuffle=True, seed=0
    )
    assert [b.tolist() for b in resumable_epoch_iterator(loader, 0, 2)] == [[[6], [7], [8]], [[9]]]
    assert iter_data.epochs == [0]


class _Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __init__(self, n: int) -> None:
        self.n = n
        self.epochs: list[int] = []

    def __iter__(self) -> Any:
        return iter(torch.tensor([i]) for i in range(self.n))

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)
