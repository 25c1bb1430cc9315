"""A resume reproduces log_history bit for bit wherever the checkpoint falls (issue #23 item 9).

The TrainLogger checkpoints its open logging window (the losses since the last logging point, held at
SAVE), the sum of the windows logged so far and the run's first step: the first loss logged after a
resume, the NaN filter's running mean and ``train_loss`` (the mean over the whole run, not only the
resumed part) equal the uninterrupted run's exactly.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from facade_helpers import Regressor, quiet_args, regression_data
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbus.engine import Engine, Event, Priority
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, resume
from trainbus.plugins.control.flow import FlowControl
from trainbus.plugins.facade.trainer import Trainer
from trainbus.plugins.observability.logging import TrainLogger
from trainbus.plugins.optimization.accumulation import GradientAccumulation

TIMED = ("runtime", "per_second")


def untimed(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in entry.items() if not any(t in k for t in TIMED)} for entry in history]


def same_history(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Equal entries, bit for bit (NaN equal to NaN: the filter-off run logs NaN)."""
    a, b = untimed(a), untimed(b)
    if len(a) != len(b) or [sorted(x) for x in a] != [sorted(y) for y in b]:
        return False
    for x, y in zip(a, b, strict=True):
        for key in x:
            u, v = x[key], y[key]
            if not (u == v or (isinstance(u, float) and math.isnan(u) and isinstance(v, float) and math.isnan(v))):
                return False
    return True


def build(out: Path, config: dict[str, Any]) -> Engine:
    torch.manual_seed(0)
    model = Regressor()
    rows = regression_data(config["batches"] * 2, seed=3)
    batches = [
        {
            "x": torch.stack([r["x"] for r in rows[i : i + 2]]),
            "labels": torch.stack([r["labels"] for r in rows[i : i + 2]]),
        }
        for i in range(0, len(rows), 2)
    ]
    logger = TrainLogger(nan_inf_filter=config["nan_filter"], include_num_input_tokens_seen="all", input_name="x")
    plugins: list[Any] = [
        FlowControl(logging_steps=config["log_every"], save_strategy="no"),
        logger,
        Checkpointing(out),
    ]
    if config["k"] > 1:
        plugins.insert(0, GradientAccumulation(config["k"]))
    engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=0.05), train_data=batches,
                    max_epochs=config["epochs"], plugins=plugins)  # fmt: skip
    nan_at = config["nan_at"]

    def poison(ev: Any) -> None:  # the run's micro-batch number survives a resume (state.micro_steps)
        if ev.engine.state.micro_steps in nan_at:
            ev.loss = ev.loss + (torch.tensor(float("nan")) - ev.loss.detach())  # a NaN value, a finite gradient

    engine.on(Event.LOSS, poison, priority=Priority.PRODUCER + 1)
    return engine


def steps_of(config: dict[str, Any]) -> int:
    return config["epochs"] * math.ceil(config["batches"] / config["k"])


configs = st.fixed_dictionaries(
    {
        "batches": st.integers(2, 7),
        "k": st.integers(1, 3),
        "epochs": st.integers(1, 2),
        "log_every": st.integers(2, 5),
        "nan_filter": st.booleans(),
        "nan_at": st.sets(st.integers(1, 14), max_size=2),
    }
)


@settings(max_examples=25, deadline=None)
@given(config=configs, data=st.data())
def test_resume_reproduces_log_history_wherever_the_checkpoint_falls(
    tmp_path_factory: pytest.TempPathFactory, config: dict[str, Any], data: st.DataObject
) -> None:
    total = steps_of(config)
    if total < 2:
        return
    at = data.draw(st.integers(1, total - 1), label="checkpoint step")
    reference = build(tmp_path_factory.mktemp("whole"), config)
    reference.fit()

    out = tmp_path_factory.mktemp("cut")
    cut = build(out, config)

    def request(ev: Any) -> None:
        if ev.engine.state.global_step == at:
            ev.engine.control.should_save = True

    def crash(ev: Any) -> None:
        raise RuntimeError("killed right after the checkpoint")

    cut.on(Event.STEP_END, request)
    cut.on(Event.SAVE, crash, priority=Priority.LAST)
    with pytest.raises(RuntimeError, match="killed"):
        cut.fit()
    resumed = build(tmp_path_factory.mktemp("resumed"), config)
    resume(resumed, out / f"checkpoint-{at}")
    resumed.fit()
    assert same_history(resumed.state.log_history, reference.state.log_history), (
        untimed(resumed.state.log_history),
        untimed(reference.state.log_history),
    )
    assert resumed.state.num_input_tokens_seen == reference.state.num_input_tokens_seen


def test_a_checkpoint_inside_a_window_used_to_change_the_first_logged_loss(tmp_path: Path) -> None:
    """The case the issue measured: without the held window the first loss after the resume is the mean of
    the resumed part only; it must be the whole window's."""
    config = {"batches": 6, "k": 1, "epochs": 1, "log_every": 4, "nan_filter": True, "nan_at": set()}
    reference = build(tmp_path / "whole", config)
    reference.fit()
    cut = build(tmp_path / "cut", config)
    cut.on(Event.STEP_END, lambda ev: setattr(ev.engine.control, "should_save", ev.engine.state.global_step == 2))
    cut.fit()
    resumed = build(tmp_path / "resumed", config)
    resume(resumed, tmp_path / "cut" / "checkpoint-2")
    held = resumed.get_plugin(TrainLogger).state_dict()  # type: ignore[union-attr]
    assert [step for _, step in held["held"]] == [0, 1]  # the two losses of steps 1 and 2 (taken before the step)
    resumed.fit()
    assert same_history(resumed.state.log_history, reference.state.log_history)


@pytest.mark.parametrize("checkpoint", [3, 6, 9])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_resumed_trainer_logs_and_reports_train_loss_as_the_uninterrupted_run(
    tmp_path: Path, checkpoint: int, accumulation: int
) -> None:
    """Trainer level: logging every 4 steps, checkpoints every 3 (inside windows); train_loss is the whole run's."""

    def trainer(out: Path) -> Trainer:
        args = quiet_args(out, logging_steps=4, save_strategy="steps", save_steps=3, max_steps=10,
                          gradient_accumulation_steps=accumulation, learning_rate=0.05, per_device_train_batch_size=2,
                          optim="adamw_torch")  # fmt: skip
        return Trainer(model=Regressor(), args=args, train_dataset=regression_data(24, seed=5))

    torch.manual_seed(0)
    whole = trainer(tmp_path / "whole")
    losses: list[float] = []
    whole.on(Event.LOSS, lambda ev: losses.append(float(ev.loss.detach())), priority=Priority.LAST)
    whole_out = whole.train()
    torch.manual_seed(0)
    again = trainer(tmp_path / "again")
    resumed_out = again.train(resume_from_checkpoint=str(tmp_path / "whole" / f"checkpoint-{checkpoint}"))
    assert same_history(again.state.log_history, whole.state.log_history)
    assert resumed_out.training_loss == whole_out.training_loss
    assert resumed_out.metrics["train_loss"] == whole_out.metrics["train_loss"]
    # the mean of every step's loss over the whole run (the micro-batch losses are already window-normalised)
    assert whole_out.metrics["train_loss"] == pytest.approx(sum(losses) / 10, rel=1e-6)
