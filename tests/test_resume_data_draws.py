"""Every random draw in data loading is made again on a mid-epoch resume of a bare Engine (#37 item 4).

Each loader shape below draws random numbers while it loads: a dataset augmenting with torch's, numpy's
or ``random``'s global generators (``random`` seeded in a ``worker_init_fn``, torch's recipe), a dataset,
an iterable dataset, a collator or a sampler drawing from a generator of its own; loaded in the main
process or by 1-2 workers, persistent or not. A run stopped mid-epoch and resumed in a fresh engine
(a fresh model, optimizer, loader and dataset, as a new process builds them) ends with the uninterrupted
run's weights, bit for bit. What the data plugin cannot make again is named in a warning when the
loader is attached.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from trainbus.engine import Engine
from trainbus.plugins.checkpoints.checkpoint import Checkpointing
from trainbus.plugins.checkpoints.resuming import resume
from trainbus.plugins.data.seeded import seeded_loader

SIZE, FEATURES = 12, 3


def _rows() -> torch.Tensor:
    return torch.arange(SIZE * FEATURES, dtype=torch.float32).reshape(SIZE, FEATURES) / (SIZE * FEATURES)


class TorchAugmented(Dataset[Any]):
    """Adds noise from torch's global generator to each row (a random transform)."""

    def __init__(self) -> None:
        self.x = _rows()

    def __len__(self) -> int:
        return SIZE

    def __getitem__(self, i: int) -> Any:
        return self.x[i] + 0.1 * torch.rand(FEATURES), self.x[i].sum(0, keepdim=True)


class NumpyAugmented(TorchAugmented):
    def __getitem__(self, i: int) -> Any:
        noise = torch.from_numpy(np.random.uniform(size=FEATURES).astype(np.float32))
        return self.x[i] + 0.1 * noise, self.x[i].sum(0, keepdim=True)


class RandomAugmented(TorchAugmented):
    """Draws from Python's ``random``, which ``seed_worker`` seeds in each worker (torch's recipe)."""

    def __getitem__(self, i: int) -> Any:
        noise = torch.tensor([random.random() for _ in range(FEATURES)])
        return self.x[i] + 0.1 * noise, self.x[i].sum(0, keepdim=True)


def seed_worker(worker_id: int) -> None:
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


class OwnGenerator(TorchAugmented):
    """Draws from a numpy generator of its own, made once with the dataset."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(5)

    def __getitem__(self, i: int) -> Any:
        noise = torch.from_numpy(self.rng.uniform(size=FEATURES).astype(np.float32))
        return self.x[i] + 0.1 * noise, self.x[i].sum(0, keepdim=True)


class IterableOwnGenerator(IterableDataset[Any]):
    """An iterable dataset drawing from a torch generator of its own (no index: a resume makes the prefix again)."""

    def __init__(self) -> None:
        self.x = _rows()
        self.generator = torch.Generator().manual_seed(9)

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        ids = range(SIZE) if info is None else range(info.id, SIZE, info.num_workers)
        for i in ids:
            yield self.x[i] + 0.1 * torch.rand(FEATURES, generator=self.generator), self.x[i].sum(0, keepdim=True)


class IterableTorch(IterableOwnGenerator):
    """An iterable dataset augmenting with torch's global generator (seeded per worker by torch)."""

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        ids = range(SIZE) if info is None else range(info.id, SIZE, info.num_workers)
        for i in ids:
            yield self.x[i] + 0.1 * torch.rand(FEATURES), self.x[i].sum(0, keepdim=True)


class MaskingCollator:
    """Masks features with a torch generator of its own, made at the first call (as transformers'
    ``DataCollatorForLanguageModeling(seed=...)`` does)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.generator: torch.Generator | None = None

    def __call__(self, rows: list[Any]) -> Any:
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.seed)
        x = torch.stack([r[0] for r in rows])
        keep = torch.rand(x.shape, generator=self.generator) > 0.3
        return x * keep, torch.stack([r[1] for r in rows])


class PlainRows(TorchAugmented):
    def __getitem__(self, i: int) -> Any:
        return self.x[i], self.x[i].sum(0, keepdim=True)


class EpochAndOwnState(Sampler[int]):
    """A sampler with a ``set_epoch`` whose order also depends on a generator it keeps drawing from."""

    def __init__(self) -> None:
        self.epoch = 0
        self.rng = np.random.default_rng(3)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return SIZE

    def __iter__(self) -> Iterator[int]:
        return iter(((self.rng.permutation(SIZE) + self.epoch) % SIZE).tolist())


#: each shape: (what loads, which worker counts it is checked with)
SHAPES = ("torch", "numpy", "random-worker-init", "own-generator", "iterable-own-generator", "iterable-torch",
          "collator", "sampler")  # fmt: skip


def make_loader(shape: str, workers: int, persistent: bool, batch: int) -> DataLoader[Any]:
    options: dict[str, Any] = dict(batch_size=batch, num_workers=workers)
    if workers:
        options["persistent_workers"] = persistent
    if shape.startswith("iterable"):
        return DataLoader(IterableOwnGenerator() if shape == "iterable-own-generator" else IterableTorch(), **options)
    dataset = {"torch": TorchAugmented, "numpy": NumpyAugmented, "random-worker-init": RandomAugmented,
               "own-generator": OwnGenerator}.get(shape, PlainRows)()  # fmt: skip
    if shape == "random-worker-init":
        options["worker_init_fn"] = seed_worker
    if shape == "collator":
        options["collate_fn"] = MaskingCollator(4)
    if shape == "sampler":
        return DataLoader(dataset, sampler=EpochAndOwnState(), **options)
    return DataLoader(dataset, shuffle=True, **options)


def make_engine(output_dir: Path, loader: DataLoader[Any]) -> Engine:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 4), torch.nn.Dropout(0.3), torch.nn.Linear(4, 1))
    return Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), train_data=loader, max_steps=7,
        loss_fn=torch.nn.MSELoss(), plugins=[Checkpointing(output_dir, save_strategy="steps", save_steps=1)],
    )  # fmt: skip


def shut_down(engine: Engine) -> None:
    """Persistent pools outlive fit(): end them before the next run forks."""
    for loader in {id(x): x for x in (engine.train_data, seeded_loader(engine.train_data))}.values():
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            loader._iterator = None


def resumed_equals_uninterrupted(
    root: Path, shape: str, workers: int, persistent: bool, batch: int, stop: float
) -> None:
    full = make_engine(root / "full", make_loader(shape, workers, persistent, batch))
    full.fit()
    shut_down(full)
    step = 1 + int(stop * (full.state.global_step - 1))
    resumed = make_engine(root / "resumed", make_loader(shape, workers, persistent, batch))
    resume(resumed, root / "full" / f"checkpoint-{step}")
    resumed.fit()
    shut_down(resumed)
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b), f"{shape}, {workers} workers (persistent={persistent}): resumed from step {step}"


EACH = [("torch", 2, False), ("numpy", 2, False), ("random-worker-init", 2, False), ("torch", 2, True),
        ("own-generator", 0, False), ("own-generator", 2, False), ("iterable-own-generator", 0, False),
        ("iterable-own-generator", 2, False), ("iterable-torch", 0, False), ("iterable-torch", 2, False),
        ("collator", 0, False), ("collator", 1, False), ("collator", 2, True), ("sampler", 0, False)]  # fmt: skip


@pytest.mark.parametrize(("shape", "workers", "persistent"), EACH)
def test_each_loader_shape_resumes_bit_exact(tmp_path: Path, shape: str, workers: int, persistent: bool) -> None:
    resumed_equals_uninterrupted(tmp_path, shape, workers, persistent, batch=3, stop=0.8)  # step 5: mid-epoch 1


@settings(max_examples=10)
@given(
    shape=st.sampled_from(SHAPES),
    workers=st.sampled_from([0, 0, 1, 2]),
    persistent=st.booleans(),
    batch=st.integers(2, 5),
    stop=st.floats(0.0, 1.0, exclude_max=True),
)
def test_any_loader_shape_resumes_bit_exact_from_any_step(
    tmp_path_factory: pytest.TempPathFactory, shape: str, workers: int, persistent: bool, batch: int, stop: float
) -> None:
    root = tmp_path_factory.mktemp("draws")
    if unreplayable(shape, workers, persistent):
        return  # named in a warning instead (tested below)
    resumed_equals_uninterrupted(root, shape, workers, persistent and workers > 0, batch, stop)


def unreplayable(shape: str, workers: int, persistent: bool) -> bool:
    """The shapes the data plugin says it cannot replay (each named in a warning: tested below)."""
    return workers > 0 and shape.startswith("iterable") and persistent


class LoaderSubclass(DataLoader):  # type: ignore[type-arg]
    """A DataLoader subclass: the data plugin iterates it as it is (no seeded twin)."""


@pytest.mark.parametrize(
    ("loader", "named"),
    [(lambda: make_loader("iterable-own-generator", 1, True, 3),
      "iterable dataset IterableOwnGenerator is read by persistent workers"),
     (lambda: LoaderSubclass(TorchAugmented(), batch_size=3, num_workers=1),
      "train loader is a LoaderSubclass .a DataLoader subclass., whose workers' batches cannot be seeded")],
    ids=["iterable-persistent", "loader-subclass"],
)  # fmt: skip
def test_what_workers_cannot_draw_again_is_named_when_the_loader_is_attached(
    tmp_path: Path, loader: Any, named: str
) -> None:
    with pytest.warns(UserWarning, match=named + ".*will not reproduce the uninterrupted run"):
        make_engine(tmp_path, loader())


def test_loaders_that_resume_exactly_attach_quietly(tmp_path: Path) -> None:
    for shape, workers, persistent in (("torch", 2, True), ("collator", 2, False), ("sampler", 0, False),
                                       ("iterable-own-generator", 2, False), ("own-generator", 1, True)):  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            make_engine(tmp_path, make_loader(shape, workers, persistent, 3))


# -- transformers' masked-LM collator with a seed of its own, under the Trainer -------------------
def masked_lm_trainer(output_dir: Path, **more: Any) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertForMaskedLM, DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    from tests.facade_helpers import quiet_args
    from trainbus.plugins import Trainer

    words = ["good", "bad", "fine", "awful", "great", "poor", "ok", "nice"]
    vocab = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, **{w: i + 3 for i, w in enumerate(words)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    special = dict(pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, **special)
    texts = [" ".join(words[(i * 3 + j) % 8] for j in range(6)) for i in range(16)]
    rows = [{"input_ids": tokenizer(t)["input_ids"]} for t in texts]
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=16)  # fmt: skip
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3, seed=3)
    options = dict(max_steps=6, per_device_train_batch_size=4, learning_rate=0.01, save_strategy="steps",
                   save_steps=1, seed=2) | more  # fmt: skip
    args = quiet_args(output_dir, **options)
    return Trainer(BertForMaskedLM(config), args, train_dataset=rows, data_collator=collator)


def test_transformers_masked_lm_collator_with_a_seed_resumes_bit_exact(tmp_path: Path) -> None:
    """Its generator (made at its first call) travels with the checkpoint, the batch in flight's state too."""
    full = masked_lm_trainer(tmp_path / "full")
    full.train()
    for step in (2, 5):  # mid-epoch 0 (4 batches an epoch), mid-epoch 1
        resumed = masked_lm_trainer(tmp_path / f"from-{step}")
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{step}"))
        for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
            assert torch.equal(a, b), f"resumed from checkpoint-{step}"


def test_transformers_masked_lm_collator_with_a_seed_in_workers_resumes_bit_exact(tmp_path: Path) -> None:
    """In each worker it makes its generator at its first call (seed + the worker's id): made before the first
    batch's draws there, then seeded from each batch, as every later one (the collator wrapped by the Trainer)."""
    full = masked_lm_trainer(tmp_path / "full", dataloader_num_workers=2)
    full.train()
    resumed = masked_lm_trainer(tmp_path / "resumed", dataloader_num_workers=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))  # mid-epoch 0, odd: workers swap
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_sets_no_generator_where_an_object_makes_none() -> None:
    """Only an object that makes its ``generator`` at its first call gets one made from a checkpoint's state."""
    from trainbus.plugins.data.generators import generator_state, restore_generators

    collator, transform = MaskingCollator(4), PlainRows()
    transform.transform = None  # type: ignore[attr-defined]
    state = generator_state(torch.Generator().manual_seed(8))
    restore_generators({"collate_fn": collator, "dataset": transform},
                       {"collate_fn.generator": state, "dataset.transform": state})  # fmt: skip
    assert isinstance(collator.generator, torch.Generator) and torch.equal(
        collator.generator.get_state(), state["state"]
    )
    assert transform.transform is None  # type: ignore[attr-defined]
