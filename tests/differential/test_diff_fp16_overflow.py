"""fp16 with an overflowed step, the same script through transformers and trainbus (issue #36 item 4).

transformers (through accelerate) steps the learning-rate schedule on an overflowed step of a fused optimizer,
its default ``adamw_torch_fused``: GradScaler calls a fused optimizer's ``step``, which skips inside, so
accelerate's ``optimizer_step_was_skipped`` is False. With a for-loop optimizer GradScaler does not call
``step``, and the schedule waits. trainbus takes the skip on the device with a fused optimizer (no host read,
``MixedPrecision(keep_schedule=True)``) and keeps the host read with a for-loop one: the logs (learning rates,
losses, grad norms) and the weights agree with transformers' in both cases.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_diff import Impl, assert_same_logs, assert_same_weights, regression_trainer, run_both

OVERFLOW_AT = 2  # the global step whose loss is scaled to infinity


class InfiniteLossAt(torch.nn.Module):
    """The regression model of transformers' tests whose loss is infinite at one step (an fp16 overflow)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor(0.5))
        self.b = torch.nn.Parameter(torch.tensor(0.25))
        self.step = 0

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        y = input_x * self.a + self.b
        if labels is None:
            return (y,)
        loss = torch.nn.functional.mse_loss(y, labels)
        self.step += 1
        if self.step == OVERFLOW_AT + 1:
            loss = loss * math.inf
        return (loss, y)


def _run(optim: str, impl: Impl, workdir: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    trainer = regression_trainer(
        impl, workdir, model=InfiniteLossAt(), fp16=True, optim=optim, learning_rate=0.1, max_steps=6,
        logging_steps=1, per_device_train_batch_size=16, save_strategy="no", lr_scheduler_type="linear",
    )  # fmt: skip
    if impl.name == "transformers" and trainer.accelerator.scaler is None:
        # on the CPU accelerate makes no GradScaler for fp16 (an overflow would reach the weights); trainbus
        # scales there too, so transformers gets the scaler it makes on a GPU: the comparison is of the GPU recipe
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
        trainer.accelerator.native_amp = True  # its unscale before clipping, as on a GPU
    trainer.train()
    return {"logs": trainer.state.log_history, "model": trainer.model}


@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch"])
def test_an_overflowed_step_through_both(optim: str, tmp_path: Path) -> None:
    hf, tb = run_both(lambda impl, workdir: _run(optim, impl, workdir), tmp_path)
    assert_same_logs(hf["logs"], tb["logs"])
    assert_same_weights(hf["model"], tb["model"])
    rates = [record["learning_rate"] for record in tb["logs"] if "learning_rate" in record]
    if optim == "adamw_torch_fused":  # the schedule went on through the overflow
        assert rates[OVERFLOW_AT + 1] < rates[OVERFLOW_AT], rates
    else:  # it waited one step
        assert rates[OVERFLOW_AT + 1] == rates[OVERFLOW_AT], rates
