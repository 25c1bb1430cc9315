"""The Trainer resumes bit-exact with dropout, with worker processes, and with persistent workers (#29).

With ``dataloader_persistent_workers=True`` the uninterrupted run starts its worker pools once (the
train loader's at its first epoch, the eval loader's at its first evaluation), each drawing a base
seed from the global generator then, and reuses them. A resumed run starts them again later: its
pools are started without a trace in any generator, so every dropout mask after them is the
uninterrupted run's. The workers read the epoch from shared memory, so a persistent worker's
per-batch seeds follow the epochs as a fresh pool's do (a random collator draws the same).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.facade_helpers import quiet_args
from tests.test_resume_in_flight import NoisyRegressor, random_masking_collator, rows
from trainbus.plugins import Trainer


def trainer(output_dir: Path, **kwargs: Any) -> Trainer:
    collator = kwargs.pop("data_collator", None)
    args = quiet_args(
        output_dir, num_train_epochs=3, per_device_train_batch_size=4, learning_rate=0.05, logging_steps=1,
        save_strategy="steps", save_steps=3, seed=11, eval_strategy="steps", eval_steps=5, **kwargs,
    )  # fmt: skip
    return Trainer(NoisyRegressor(), args, train_dataset=rows(24), eval_dataset=rows(8), data_collator=collator)


def shut_down_pools(run: Trainer) -> None:
    """Persistent pools outlive train(); their workers, forked while Preemption ran, ignore SIGTERM, so the
    interpreter's exit (which terminates daemonic children, then joins them) would wait for them."""
    for loader in (run.train_data, run.eval_data):
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()
            loader._iterator = None


def assert_resumes_exactly(tmp_path: Path, checkpoints: tuple[int, ...], **kwargs: Any) -> None:
    full = trainer(tmp_path / "full", **kwargs)
    full.train()
    shut_down_pools(full)
    for step in checkpoints:
        resumed = trainer(tmp_path / f"from-{step}", **kwargs)
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{step}"))
        shut_down_pools(resumed)
        for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
            assert torch.equal(a, b), f"resumed from checkpoint-{step}"


def test_trainer_resume_with_dropout_is_bit_exact(tmp_path: Path) -> None:
    # 6 steps an epoch: mid-epoch 0 before the first evaluation, mid-epoch 1 and 2 after evaluations
    assert_resumes_exactly(tmp_path, (3, 9, 15))


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
def test_trainer_resume_with_workers_is_bit_exact(tmp_path: Path, persistent: bool) -> None:
    assert_resumes_exactly(
        tmp_path, (3, 6, 9, 15), dataloader_num_workers=2, dataloader_persistent_workers=persistent
    )


def test_persistent_workers_with_a_random_collator_resume_bit_exact(tmp_path: Path) -> None:
    assert_resumes_exactly(
        tmp_path, (3, 9), dataloader_num_workers=2, dataloader_persistent_workers=True,
        data_collator=random_masking_collator,
    )  # fmt: skip


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
def test_engine_resume_with_a_shuffling_loader_with_workers_is_bit_exact(tmp_path: Path, persistent: bool) -> None:
    """A bare Engine, a plain DataLoader(shuffle=True, num_workers=2), dropout: exact from any epoch."""
    from torch.utils.data import DataLoader

    from tests.test_resume_exact_engine import dropout_engine, same_weights
    from trainbus.plugins.checkpoints.resuming import resume
    from trainbus.plugins.data.seeded import seeded_loader

    def build(out: Path) -> Any:
        engine = dropout_engine(out, 13, 2, 1, 1)
        data = engine.train_data.dataset
        engine.train_data = DataLoader(data, batch_size=2, shuffle=True, num_workers=2, persistent_workers=persistent)
        return engine

    def shut_down(engine: Any) -> None:
        loader = seeded_loader(engine.train_data)  # the loader the data plugin iterates (workers seeded per batch)
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None:
            iterator._shutdown_workers()
            loader._iterator = None

    full = build(tmp_path / "full")
    full.fit()
    shut_down(full)
    for step in (3, 10, 16):  # 7 batches an epoch: mid-epoch 0, 1 and 2
        resumed = build(tmp_path / f"from-{step}")
        resume(resumed, tmp_path / "full" / f"checkpoint-{step}")
        resumed.fit()
        shut_down(resumed)
        assert same_weights(full.model, resumed.model), f"resumed from checkpoint-{step}"
