"""A mid-epoch resume on a bare Engine is bit-exact with a plain ``DataLoader(shuffle=True)`` and dropout.

Such a loader draws from torch's global generator each epoch (the iterator's base seed, then the
RandomSampler's seed), so an epoch's order depends on every draw before it (dropout masks included),
and creating the resumed epoch's iterator draws again. The data plugin (attached by ``Checkpointing``)
keeps the generators' states from the start of each epoch in every checkpoint: a resume makes the
epoch's order again from them, skips the consumed batches in the sampler, then sets the checkpoint's
own states, so every later draw (each dropout mask) is the uninterrupted run's.

The resumed engine is built from scratch, as a new process would build it: a fresh model (same seed),
a fresh optimizer without state, a fresh loader.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Sampler, TensorDataset

from trainbus.engine import Engine
from trainbus.plugins import (
    EvalCollector,
    FlowControl,
    GradientAccumulation,
    GradientClipping,
    LRScheduler,
    MixedPrecision,
    TrainLogger,
)
from trainbus.plugins.checkpoints.checkpoint import Checkpointing
from trainbus.plugins.checkpoints.resuming import resume
from trainbus.plugins.data.loading import ResumableData


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def untimed(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if "runtime" not in k and "per_second" not in k} for r in history]


# -- the README's Engine example, with a checkpoint every step -------------------------------------
def readme_engine(output_dir: Path) -> Engine:
    """README.md's bare-Engine example as written, save_strategy="steps" and Checkpointing added."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    xs, ys = torch.randn(64, 8), torch.randint(0, 3, (64,))
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs, ys), batch_size=8, shuffle=True)
    valid = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(xs[:16], ys[:16]), batch_size=8)

    engine = Engine(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2),
        train_data=train, eval_data=valid, max_epochs=3, loss_fn=torch.nn.CrossEntropyLoss(),
        plugins=[
            GradientAccumulation(2),           # loss normalised by the items of the whole window
            MixedPrecision("bf16"),            # autocast; "fp16" adds a GradScaler
            GradientClipping(max_norm=1.0),    # after unscaling; grad_norm stays on device
            LRScheduler("cosine", warmup_ratio=0.1),
            EvalCollector(),                   # eval_loss, runtime, samples/s, compute_metrics
            FlowControl(logging_steps=4, eval_strategy="epoch", save_strategy="steps", save_steps=1),
            TrainLogger(),                     # mean loss of the window, lr, grad_norm -> log_history
            Checkpointing(output_dir),
        ],
    )  # fmt: skip
    return engine


def test_readme_engine_example_resumes_bit_exact_from_every_step(tmp_path: Path) -> None:
    full = readme_engine(tmp_path / "full")
    state = full.fit()
    assert state.global_step == 12
    for step in (1, 3, 4, 6, 11):  # mid-epoch, an epoch's last step (4: before its evaluation), the last epoch
        resumed = readme_engine(tmp_path / f"from-{step}")
        resume(resumed, tmp_path / "full" / f"checkpoint-{step}")
        resumed.fit()
        assert same_weights(full.model, resumed.model), f"resumed from checkpoint-{step}"
        assert untimed(resumed.state.log_history) == untimed(full.state.log_history)


# -- the property: any data size, batch size, accumulation, save point, with dropout ---------------
def dropout_engine(output_dir: Path, size: int, batch: int, accumulation: int, save_steps: int) -> Engine:
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Dropout(0.4), torch.nn.Linear(6, 1))
    data = TensorDataset(torch.randn(size, 3), torch.randn(size, 1))
    plugins: list[Any] = [Checkpointing(output_dir, save_strategy="steps", save_steps=save_steps)]
    if accumulation > 1:
        plugins.append(GradientAccumulation(accumulation))
    return Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=DataLoader(data, batch_size=batch, shuffle=True),
        max_epochs=3, loss_fn=torch.nn.MSELoss(), plugins=plugins,
    )  # fmt: skip


@settings(max_examples=8, deadline=None)
@given(
    size=st.integers(3, 17),
    batch=st.integers(1, 4),
    accumulation=st.integers(1, 3),
    save_point=st.floats(0.0, 1.0, exclude_max=True),
)
def test_engine_resume_with_a_shuffling_loader_and_dropout_is_bit_exact(
    tmp_path_factory: pytest.TempPathFactory, size: int, batch: int, accumulation: int, save_point: float
) -> None:
    root = tmp_path_factory.mktemp("exact")
    full = dropout_engine(root / "full", size, batch, accumulation, save_steps=1)
    full.fit()
    step = 1 + int(save_point * (full.state.global_step - 1))
    resumed = dropout_engine(root / "resumed", size, batch, accumulation, save_steps=1)
    resume(resumed, root / "full" / f"checkpoint-{step}")
    resumed.fit()
    assert same_weights(full.model, resumed.model)


def test_a_resume_of_a_resume_is_bit_exact(tmp_path: Path) -> None:
    """The epoch's states travel on: checkpoints the resumed run writes in that epoch resume exactly too."""
    full = dropout_engine(tmp_path / "full", 13, 2, 1, 2)
    full.fit()
    first = dropout_engine(tmp_path / "first", 13, 2, 1, 3)
    resume(first, tmp_path / "full" / "checkpoint-2")
    first.fit()
    second = dropout_engine(tmp_path / "second", 13, 2, 1, 3)
    resume(second, tmp_path / "first" / "checkpoint-3")  # written by the resumed run, in the same epoch
    second.fit()
    assert same_weights(full.model, first.model) and same_weights(full.model, second.model)


def test_a_loader_with_its_own_generator_resumes_bit_exact(tmp_path: Path) -> None:
    """``DataLoader(shuffle=True, generator=g)`` (torch's reproducibility recipe): g's epoch-start state is kept."""

    def build(out: Path) -> Engine:
        engine = dropout_engine(out, 11, 2, 1, 4)
        g = torch.Generator().manual_seed(5)
        engine.train_data = DataLoader(engine.train_data.dataset, batch_size=2, shuffle=True, generator=g)
        return engine

    full = build(tmp_path / "full")
    full.fit()
    resumed = build(tmp_path / "resumed")
    resume(resumed, tmp_path / "full" / "checkpoint-8")  # mid-epoch 1: g drew for epoch 0 and 1 before
    resumed.fit()
    assert same_weights(full.model, resumed.model)


@pytest.mark.parametrize("save_strategy", ["steps", "epoch"], ids=["last-batch", "epoch-end"])
def test_a_loader_with_its_own_generator_resumes_bit_exact_at_an_epoch_boundary(
    tmp_path: Path, save_strategy: str
) -> None:
    """The generator's state at the checkpoint travels with it (a fresh process would start it over), and a
    checkpoint at an epoch's last batch, before the sampler's pass drew its exhaustion, resumes as well."""

    def build(out: Path) -> Engine:
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(3, 6), torch.nn.Dropout(0.4), torch.nn.Linear(6, 1))
        data = TensorDataset(torch.randn(12, 3), torch.randn(12, 1))
        loader = DataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5))
        saving = Checkpointing(out, save_strategy=save_strategy, save_steps=6)
        return Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=loader, max_epochs=3,
                      loss_fn=torch.nn.MSELoss(), plugins=[saving])  # fmt: skip

    full = build(tmp_path / "full")
    full.fit()
    resumed = build(tmp_path / "resumed")
    resume(resumed, tmp_path / "full" / "checkpoint-6")  # the end of epoch 0: epoch 1 draws its order from g
    resumed.fit()
    assert same_weights(full.model, resumed.model)


class NumpyShuffle(Sampler[int]):
    """A user's sampler drawing its order from numpy's global generator when a pass starts."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Any:
        import numpy as np

        return iter(np.random.permutation(self.size).tolist())


@pytest.mark.parametrize(
    "make_sampler",
    [
        lambda n: torch.utils.data.WeightedRandomSampler(torch.linspace(0.5, 2.0, n), n),
        lambda n: torch.utils.data.SubsetRandomSampler(range(1, n)),
        lambda n: torch.utils.data.RandomSampler(range(n), replacement=True, num_samples=n + 3),
        NumpyShuffle,
    ],
    ids=["weighted", "subset", "with-replacement", "numpy-shuffle"],
)
def test_samplers_drawing_from_the_global_generators_resume_bit_exact(tmp_path: Path, make_sampler: Any) -> None:
    def build(out: Path) -> Engine:
        engine = dropout_engine(out, 13, 3, 2, 1)
        engine.train_data = DataLoader(engine.train_data.dataset, batch_size=3, sampler=make_sampler(13))
        return engine

    full = build(tmp_path / "full")
    full.fit()
    step = full.state.global_step // 3 + 1  # the middle epoch's first step: mid-epoch
    resumed = build(tmp_path / "resumed")
    resume(resumed, tmp_path / "full" / f"checkpoint-{step}")
    resumed.fit()
    assert same_weights(full.model, resumed.model)


# -- samplers that cannot be replayed: said at attach time -----------------------------------------
class DrawsAsItGoes(Sampler[int]):
    """Draws from the global generator for every index it yields: interleaved with the steps' draws."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Any:
        left = list(range(self.size))
        while left:
            yield left.pop(int(torch.randint(len(left), ())))


class RemembersPasses(Sampler[int]):
    """Keeps a private counter across passes, with no ``set_epoch``: the order depends on the epochs before."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.passes = 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Any:
        self.passes += 1
        return iter(sorted(range(self.size), key=lambda i: (i * 7 + self.passes) % self.size))


class EpochAndPasses(RemembersPasses):
    """Has a ``set_epoch``, but its order also depends on a counter it keeps: more state than its epoch."""

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


@pytest.mark.parametrize(
    "sampler",
    [DrawsAsItGoes(6), RemembersPasses(6), EpochAndPasses(6)],
    ids=["draws-as-it-goes", "private-state", "set-epoch-and-private-state"],
)
def test_a_sampler_that_cannot_be_replayed_is_reported_at_attach(sampler: Sampler[int]) -> None:
    model = torch.nn.Linear(3, 1)
    loader = DataLoader(TensorDataset(torch.randn(6, 3), torch.randn(6, 1)), batch_size=2, sampler=sampler)
    before = torch.get_rng_state()
    with pytest.warns(UserWarning, match=type(sampler).__name__ + ".*mid-epoch resume"):
        Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=loader, max_epochs=1,
               loss_fn=torch.nn.MSELoss(), plugins=[ResumableData()])  # fmt: skip
    assert torch.equal(before, torch.get_rng_state())  # the check draws nothing the run would see


def test_replayable_samplers_attach_quietly() -> None:
    model = torch.nn.Linear(3, 1)
    data = TensorDataset(torch.randn(6, 3), torch.randn(6, 1))
    for loader in (
        DataLoader(data, batch_size=2, shuffle=True),
        DataLoader(data, batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(1)),
        DataLoader(data, batch_size=2, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 6, 6)),
        DataLoader(data, batch_size=2),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=loader, max_epochs=1,
                   loss_fn=torch.nn.MSELoss(), plugins=[ResumableData()])  # fmt: skip
