"""When training fails, the plugins that hold something open close it (cleanup handlers on TRAIN_END)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainbus.plugins import Trainer, TrainingArguments
from trainbus.plugins.observability.sinks import TensorBoardSink


class FailsAtStep(torch.nn.Module):
    """A regression model whose fourth training forward raises."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
        self.calls = 0

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        if self.training:
            self.calls += 1
            if self.calls == 4:
                raise RuntimeError("the data went bad")
        out = self.linear(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def test_a_failed_run_closes_its_tensorboard_writer_and_progress_bar(tmp_path: Path) -> None:
    rows = [{"x": torch.randn(2), "labels": torch.tensor(0.5)} for _ in range(16)]
    args = TrainingArguments(
        str(tmp_path), per_device_train_batch_size=2, max_steps=8, logging_steps=1, save_strategy="no",
        report_to="tensorboard", disable_tqdm=False, use_cpu=True,
    )  # fmt: skip
    trainer = Trainer(FailsAtStep(), args, train_dataset=rows)
    sink = trainer.get_plugin(TensorBoardSink)
    assert sink is not None
    with pytest.raises(Exception, match="the data went bad"):
        trainer.train()
    assert sink.writer is None  # closed, its events flushed: the steps before the failure are on disk
    bars = trainer.get_plugin("ProgressBars", None)
    assert bars is None or bars.training_bar is None
    assert list(Path(tmp_path).rglob("events.out.tfevents.*"))
