"""A mid-epoch resume is bit-exact when making a batch draws from the global generators in this process.

The Trainer fetches one batch ahead (accelerate's order), so when a checkpoint is written the next batch
was already made, its random draws (a masked-LM collator's masks, a random crop) taken before the step's
dropout. The checkpoint keeps the RNG states from before that batch (``in_flight``); the resume sets them
right before the resumed epoch's first fetch, then the checkpoint's own before the second. A bare Engine
with ``ResumableData`` (no fetch ahead) gets the checkpoint's states right before its first fetch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.facade_helpers import quiet_args
from trainbus.engine import Engine
from trainbus.plugins import Trainer
from trainbus.plugins.checkpoints.checkpoint import Checkpointing
from trainbus.plugins.checkpoints.resuming import resume
from trainbus.plugins.data.loading import ResumableData, build_dataloader


class NoisyRegressor(torch.nn.Module):
    """Dropout in the forward: the draws after the batch is made must be the uninterrupted run's too."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.lin(self.drop(x)).squeeze(-1)
        result = {"logits": out}
        if labels is not None:
            result["loss"] = torch.nn.functional.mse_loss(out, labels)
        return result


def rows(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(n, 4, generator=g)
    return [{"x": x, "labels": x.sum()} for x in xs]


def random_masking_collator(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Masks random features with torch's global generator, as DataCollatorForLanguageModeling does."""
    x = torch.stack([s["x"] for s in samples])
    keep = torch.rand(x.shape) > 0.25
    return {"x": x * keep, "labels": torch.stack([s["labels"] for s in samples])}


def _trainer(output_dir: Path, **kwargs: Any) -> Trainer:
    args = quiet_args(
        output_dir, num_train_epochs=2, per_device_train_batch_size=4, learning_rate=0.05, logging_steps=1,
        save_strategy="steps", save_steps=3, seed=11, **kwargs,
    )  # fmt: skip
    return Trainer(NoisyRegressor(), args, train_dataset=rows(40), data_collator=random_masking_collator)


def test_trainer_resume_mid_epoch_with_a_random_collator_and_dropout_is_bit_exact(tmp_path: Path) -> None:
    full = _trainer(tmp_path / "full")
    full.train()
    assert full.rng_in_flight is None  # nothing in flight once the run ended
    resumed = _trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))  # mid-epoch: 3 of 10 batches
    losses = [r["loss"] for r in full.state.log_history if "loss" in r]
    again = [r["loss"] for r in resumed.state.log_history if "loss" in r]
    assert again == losses  # the history up to the checkpoint is restored, the rest made again
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_loader_that_draws_nothing_costs_no_rng_reads(tmp_path: Path) -> None:
    trainer = Trainer(NoisyRegressor(), quiet_args(tmp_path, max_steps=3), train_dataset=rows(16))
    seen: list[Any] = []
    trainer._note_in_flight = seen.append  # type: ignore[method-assign]
    trainer.train()
    assert seen and all(s is None for s in seen)  # probed once per epoch, then never read


def _engine(output_dir: Path, max_steps: int) -> Engine:
    torch.manual_seed(3)
    model = NoisyRegressor()
    loader = build_dataloader(rows(40), batch_size=4, collate_fn=random_masking_collator, shuffle=True, seed=5)
    return Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), train_data=loader, max_steps=max_steps,
        plugins=[ResumableData(), Checkpointing(str(output_dir), save_strategy="steps", save_steps=3)],
    )  # fmt: skip


def test_engine_resume_mid_epoch_with_a_random_collator_is_bit_exact(tmp_path: Path) -> None:
    full = _engine(tmp_path / "full", 8)
    full.fit()
    resumed = _engine(tmp_path / "resumed", 8)
    resume(resumed, tmp_path / "full" / "checkpoint-6")  # mid-epoch: 6 of 10 batches
    resumed.fit()
    for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)
