"""Sinks rewind on a resume: after a crash and a resume, JSONL / CSV files hold each record once.

The run crashes after its checkpoint at step 3 has been written and records for steps 4 and 5 were
logged; the resumed run logs them again. Each sink keeps in its state how many records it had written
when the checkpoint was saved, and a resumed run cuts its file back to them first: the files end equal
to the uninterrupted run's (timings aside).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from trainbus.engine import Engine, Event
from trainbus.plugins import EvalCollector, FlowControl, TrainLogger
from trainbus.plugins.checkpoints.checkpoint import Checkpointing
from trainbus.plugins.checkpoints.resuming import resume
from trainbus.plugins.observability.sinks import CsvSink, JsonlSink


class Crash(Exception):
    pass


def crash_at(step: int) -> Any:
    """A handler (not a plugin: the checkpoint names plugins) that kills the run at ``step``'s end."""

    def step_end(ev: Any) -> None:
        if ev.engine.state.global_step == step:
            raise Crash(f"killed at step {step}")

    return step_end


def engine(output_dir: Path) -> Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(0.2), torch.nn.Linear(4, 1))
    data = TensorDataset(torch.randn(20, 3), torch.randn(20, 1))
    return Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.05), train_data=DataLoader(data, batch_size=4, shuffle=True),
        eval_data=DataLoader(data, batch_size=10), max_epochs=2, loss_fn=torch.nn.MSELoss(),
        plugins=[
            EvalCollector(), FlowControl(logging_steps=1, eval_strategy="epoch", save_strategy="steps", save_steps=3),
            TrainLogger(), Checkpointing(output_dir), JsonlSink(output_dir / "logs.jsonl"),
            CsvSink(output_dir / "logs.csv"),
        ],
    )  # fmt: skip


def untimed(record: dict[str, Any]) -> dict[str, Any]:
    """A record without its timings and its run's id (two runs differ in both)."""
    return {k: v for k, v in record.items() if "runtime" not in k and "per_second" not in k and k != "run_id"}


def run_ids(path: Path) -> set[str]:
    return {json.loads(line)["run_id"] for line in path.read_text().splitlines()}


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [untimed(json.loads(line)) for line in path.read_text().splitlines()]


def csv_table(path: Path) -> tuple[list[str], list[dict[str, Any]]]:
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), [untimed(row) for row in reader]


@pytest.mark.parametrize("crash_step", [5, 6])  # 5: mid-epoch; 6: after the epoch's evaluation was logged
def test_files_after_a_crash_and_a_resume_equal_the_uninterrupted_runs(tmp_path: Path, crash_step: int) -> None:
    full = engine(tmp_path / "full")
    full.fit()
    crashed = engine(tmp_path / "run")
    crashed.on(Event.STEP_END, crash_at(crash_step))
    with pytest.raises(Crash):
        crashed.fit()
    assert len(jsonl(tmp_path / "run" / "logs.jsonl")) > 3  # records after the checkpoint at step 3
    resumed = engine(tmp_path / "run")
    resume(resumed, tmp_path / "run" / "checkpoint-3")
    resumed.fit()
    assert jsonl(tmp_path / "run" / "logs.jsonl") == jsonl(tmp_path / "full" / "logs.jsonl")
    assert csv_table(tmp_path / "run" / "logs.csv") == csv_table(tmp_path / "full" / "logs.csv")
    assert jsonl(tmp_path / "run" / "logs.jsonl") == [untimed(r) for r in resumed.state.log_history]
    assert run_ids(tmp_path / "run" / "logs.jsonl") == {crashed.state.run_id} == {resumed.state.run_id}  # one run


def test_a_sink_in_the_same_process_continues_its_file(tmp_path: Path) -> None:
    """A second fit() of the same engine (max_steps raised) appends: nothing written is cut."""
    run = engine(tmp_path / "run")
    run.max_epochs = 1
    run.fit()
    written = jsonl(tmp_path / "run" / "logs.jsonl")
    run.max_epochs = 2
    run.fit()
    assert jsonl(tmp_path / "run" / "logs.jsonl")[: len(written)] == written
    assert len(jsonl(tmp_path / "run" / "logs.jsonl")) == len(run.state.log_history)
