"""TrainLogger: window means, NaN/Inf filtering as HF, one host sync per logging window, tokens seen."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from facade_helpers import Regressor, quiet_args, regression_data, tiny_bert, token_data
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import Engine, Event
from trainbus.engine.testing import SyncCounter
from trainbus.plugins.control.flow import FlowControl
from trainbus.plugins.facade.trainer import Trainer
from trainbus.plugins.observability.logging import ConsoleSink, TrainLogger
from trainbus.plugins.optimization.accumulation import GradientAccumulation


def make_engine(batches: int, log_every: int, k: int = 1, nan_at: set[int] | None = None) -> tuple[Engine, list[float]]:
    """An engine whose micro-batch losses are recorded (after accumulation scaling) in the returned list."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(3, 2), torch.randn(3, 1)) for _ in range(batches)]
    plugins: list[Any] = [FlowControl(logging_steps=log_every, save_strategy="no"), TrainLogger()]
    if k > 1:
        plugins.insert(0, GradientAccumulation(k))
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        train_data=data,
        max_epochs=1,
        loss_fn=torch.nn.MSELoss(),
        plugins=plugins,
    )
    losses: list[float] = []
    micro = [0]

    def poison(ev: Any) -> None:
        micro[0] += 1
        if nan_at and micro[0] in nan_at:
            ev.loss = ev.loss + (torch.tensor(float("nan")) - ev.loss.detach())  # NaN value, finite gradient

    engine.on(Event.LOSS, poison, priority=-50)
    engine.on(Event.BACKWARD_END, lambda ev: losses.append(float(ev.loss.detach())), priority=-500)
    return engine, losses


def reference_logs(losses: list[float], k: int, log_every: int, nan_filter: bool = True) -> list[float]:
    """HF's window arithmetic: sum micro losses (a NaN adds the running mean), divide by steps in the window."""
    out: list[float] = []
    window, last_logged, step = 0.0, 0, 0
    for i, loss in enumerate(losses):
        if nan_filter and not math.isfinite(loss):
            window += window / (1 + step - last_logged)
        else:
            window += loss
        last_micro = (i + 1) % k == 0 or i == len(losses) - 1
        if last_micro:
            step += 1
            if step % log_every == 0:
                out.append(window / (step - last_logged))
                window, last_logged = 0.0, step
    return out


@given(batches=st.integers(1, 12), log_every=st.integers(1, 4), k=st.integers(1, 3))
def test_logged_loss_is_the_window_mean(batches: int, log_every: int, k: int) -> None:
    engine, losses = make_engine(batches, log_every, k)
    engine.fit()
    logged = [h["loss"] for h in engine.state.log_history if "loss" in h]
    assert logged == pytest.approx(reference_logs(losses, k, log_every), rel=1e-5)


@given(batches=st.integers(2, 10), log_every=st.integers(1, 3), data=st.data())
def test_nan_losses_are_filtered_as_hf(batches: int, log_every: int, data: st.DataObject) -> None:
    nan_at = set(data.draw(st.lists(st.integers(1, batches), max_size=3)))
    engine, losses = make_engine(batches, log_every, nan_at=nan_at)
    engine.fit()
    logged = [h["loss"] for h in engine.state.log_history if "loss" in h]
    expected = reference_logs(losses, 1, log_every)
    assert len(logged) == len(expected)
    for a, b in zip(logged, expected):
        assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-5)
    assert all(math.isfinite(v) for v in logged if 1 not in nan_at)


def test_nan_filter_off_logs_nan() -> None:
    engine, _ = make_engine(4, 2, nan_at={1})
    engine.get_plugin(TrainLogger).nan_inf_filter = False  # type: ignore[union-attr]
    engine.fit()
    assert math.isnan(engine.state.log_history[0]["loss"])


@pytest.mark.parametrize("log_every", [1, 3, 1000])
def test_at_most_one_host_sync_per_logging_window(tmp_path: Path, log_every: int) -> None:
    steps = 12
    # SGD: torch's CPU AdamW reads its step counter with .item() (a CPU tensor, not a device sync)
    args = quiet_args(tmp_path, max_steps=steps, logging_steps=log_every, max_grad_norm=1.0, optim="sgd")
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(48))
    with SyncCounter(on_device=lambda t: True) as counter:  # every read counts, the CPU's too
        trainer.train()
    windows = steps // log_every
    # + the read of the last partial window at TRAIN_END, and per epoch the DataLoader's seed draw
    # and the seeded sampler's permutation (CPU reads the counter also sees, via .item() and .tolist())
    epochs = -(-steps // 12)  # 48 samples, batch 4
    assert counter.count <= windows + 1 + 2 * epochs
    assert len([h for h in trainer.state.log_history if "loss" in h]) == windows


def test_logs_have_hf_keys(tmp_path: Path) -> None:
    args = quiet_args(tmp_path, max_steps=4, logging_steps=2, learning_rate=0.1, lr_scheduler_type="linear")
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(16))
    trainer.train()
    first, second = [h for h in trainer.state.log_history if "loss" in h]
    assert set(first) == {"loss", "grad_norm", "learning_rate", "epoch", "step"}
    assert first["step"] == 2 and first["epoch"] == 0.5
    assert first["learning_rate"] == pytest.approx(0.1 * 3 / 4)  # the lr step 2 used (before its update)
    final = trainer.state.log_history[-1]
    assert {"train_runtime", "train_samples_per_second", "train_steps_per_second", "train_loss"} <= set(final)
    assert final["train_loss"] == pytest.approx((first["loss"] * 2 + second["loss"] * 2) / 4)


@pytest.mark.parametrize("mode", ["all", "non_padding"])
def test_num_input_tokens_seen(tmp_path: Path, mode: str) -> None:
    data = token_data(8)
    for d in data[:4]:
        d["attention_mask"] = torch.tensor([1] * 5 + [0] * 3)
    args = quiet_args(tmp_path, max_steps=2, logging_steps=1, include_num_input_tokens_seen=mode)
    trainer = Trainer(tiny_bert(), args, train_dataset=data)
    trainer.train()
    expected = 8 * 8 if mode == "all" else 4 * 5 + 4 * 8
    assert trainer.state.num_input_tokens_seen == expected
    assert [h["num_input_tokens_seen"] for h in trainer.state.log_history if "loss" in h][-1] == expected


def test_console_sink_prints_like_hf_printer() -> None:
    engine, _ = make_engine(2, 1)
    stream = io.StringIO()
    engine.add_plugin(ConsoleSink(stream))
    engine.fit()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("{'loss': '") and "'epoch': '0.5'" in lines[0]
    assert "total_flos" not in stream.getvalue()


def test_eval_metrics_are_logged_with_epoch(tmp_path: Path) -> None:
    args = quiet_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1)
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(8), eval_dataset=regression_data(4))
    trainer.train()
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert [(h["step"], h["epoch"]) for h in evals] == [(1, 0.5), (2, 1.0)]
