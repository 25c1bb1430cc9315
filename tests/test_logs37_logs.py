"""Logs are data (#37 item 1): a fresh run never deletes or rewrites another run's records; a resume cuts back only
its own run's. Each record carries its run's id; a file holding another run's records is set aside beside itself
(``logs.<time>.jsonl``), named in a warning, and kept byte for byte. On a bare Engine and through the Trainer."""

from __future__ import annotations

import csv
import json
import warnings
from pathlib import Path

import pytest

from tests.logs37_helpers import Crash, engine, records, trainer
from trainbus.plugins.checkpoints.directory import previous_runs
from trainbus.plugins.checkpoints.resuming import resume
from trainbus.plugins.observability.sinks import JsonlSink

MOVED = r"held records of another run; this run \(run_id [0-9a-f]{32}\) moved that file to"


def rows(table: Path) -> list[dict[str, str]]:
    """A CSV's rows without timings and run ids, empty cells left out."""
    with table.open(newline="") as f:
        return [{k: v for k, v in row.items() if v and "runtime" not in k and "per_second" not in k and k != "run_id"}
                for row in csv.DictReader(f)]  # fmt: skip


def aside(folder: Path, name: str) -> list[Path]:
    """The files a sink set aside for ``name`` (``logs.jsonl`` -> ``logs.<time>.jsonl``), oldest first."""
    stem, suffix = name.rsplit(".", 1)
    return sorted(folder.glob(f"{stem}.*Z*.{suffix}"))


def test_a_fresh_engine_run_without_checkpoints_keeps_the_earlier_runs_logs(tmp_path: Path) -> None:
    first = engine(tmp_path, 4, save=False, sinks=tmp_path)
    first.fit()
    written = {name: (tmp_path / name).read_bytes() for name in ("logs.jsonl", "logs.csv")}
    second = engine(tmp_path, 3, seed=1, save=False, sinks=tmp_path)
    with pytest.warns(UserWarning, match=MOVED):
        second.fit()
    for name, content in written.items():
        (kept,) = aside(tmp_path, name)
        assert kept.read_bytes() == content  # the first run's records, byte for byte
    assert {r["run_id"] for r in records(tmp_path / "logs.jsonl")} == {second.state.run_id}
    assert [r["step"] for r in records(tmp_path / "logs.jsonl") if "loss" in r] == [1, 2, 3]
    assert first.state.run_id != second.state.run_id


def test_a_fresh_trainer_run_with_save_strategy_no_keeps_the_earlier_runs_logs(tmp_path: Path) -> None:
    first = trainer(tmp_path, report_to=["jsonl", "csv"])
    first.train()
    written = {name: (tmp_path / name).read_bytes() for name in ("logs.jsonl", "logs.csv")}
    with pytest.warns(UserWarning, match=MOVED):
        trainer(tmp_path, seed=1, report_to=["jsonl", "csv"]).train()
    for name, content in written.items():
        (kept,) = aside(tmp_path, name)
        assert kept.read_bytes() == content
    assert {r["run_id"] for r in records(tmp_path / "logs.jsonl")} != {first.state.run_id}


def test_a_sink_file_shared_by_two_experiments_keeps_both(tmp_path: Path) -> None:
    shared = tmp_path / "all-experiments.jsonl"
    runs = [engine(tmp_path / f"exp{i}", 3, seed=i, save=False) for i in range(2)]
    for run in runs:
        run.add_plugin(JsonlSink(shared))
    runs[0].fit()
    before = shared.read_bytes()
    with pytest.warns(UserWarning, match=MOVED):
        runs[1].fit()
    (kept,) = aside(tmp_path, shared.name)
    assert kept.read_bytes() == before
    assert {r["run_id"] for r in records(shared)} == {runs[1].state.run_id}


def test_resuming_a_set_aside_checkpoint_by_path_never_cuts_the_other_runs_file(tmp_path: Path) -> None:
    engine(tmp_path, 6, sinks=tmp_path).fit()  # run A: checkpoints 2, 4, 6 and its logs
    with pytest.warns(UserWarning):
        engine(tmp_path, 8, seed=1, sinks=tmp_path).fit()  # run B, fresh: A's checkpoints and logs go aside
    b_logs = {name: (tmp_path / name).read_bytes() for name in ("logs.jsonl", "logs.csv")}
    (a_checkpoints,) = previous_runs(tmp_path)
    branch = engine(tmp_path, 8, sinks=tmp_path)
    resume(branch, a_checkpoints / "checkpoint-4")  # A's, by its path: a new run here
    with pytest.warns(UserWarning, match=MOVED):
        branch.fit()
    for name, content in b_logs.items():  # B's records whole, never cut back to A's count nor appended to
        assert [p.read_bytes() for p in aside(tmp_path, name)].count(content) == 1
    steps = [r["step"] for r in records(tmp_path / "logs.jsonl") if "loss" in r]
    assert steps == [5, 6, 7, 8]  # one run's records, each step once
    assert {r["run_id"] for r in records(tmp_path / "logs.jsonl")} == {branch.state.run_id}


def test_a_trainer_resuming_a_set_aside_checkpoint_never_cuts_the_other_runs_file(tmp_path: Path) -> None:
    saving = {"save_strategy": "steps", "save_steps": 4, "report_to": ["jsonl"]}
    trainer(tmp_path, **saving).train()  # run A
    with pytest.warns(UserWarning):
        trainer(tmp_path, seed=1, **saving).train()  # run B, fresh
    b_logs = (tmp_path / "logs.jsonl").read_bytes()
    (a_checkpoints,) = previous_runs(tmp_path)
    with pytest.warns(UserWarning, match=MOVED):
        trainer(tmp_path, **saving).train(resume_from_checkpoint=str(a_checkpoints / "checkpoint-4"))
    assert [p.read_bytes() for p in aside(tmp_path, "logs.jsonl")].count(b_logs) == 1
    assert [r["step"] for r in records(tmp_path / "logs.jsonl") if "loss" in r] == [5, 6, 7, 8]


def test_a_resume_cuts_back_only_its_own_records(tmp_path: Path) -> None:
    """Another run's record appended to this run's file (a shared file) survives this run's resume whole."""
    clean = engine(tmp_path / "clean", 8, sinks=tmp_path / "clean")
    clean.fit()
    crashed = engine(tmp_path / "run", 8, sinks=tmp_path / "run", crash_at=5)
    with pytest.raises(Crash):
        crashed.fit()
    log = tmp_path / "run" / "logs.jsonl"
    foreign = json.dumps({"loss": 9.0, "step": 1, "run_id": "f" * 32}) + "\n"
    with log.open("a") as f:
        f.write(foreign)  # another experiment logging into the same file
    before = log.read_bytes()
    table = tmp_path / "run" / "logs.csv"
    with table.open(newline="") as f:
        header = next(csv.reader(f))
    with table.open("a", newline="") as f:
        csv.DictWriter(f, fieldnames=header, restval="").writerow({"step": 1, "loss": 9.0, "run_id": "f" * 32})
    table_before = table.read_bytes()
    resumed = engine(tmp_path / "run", 8, sinks=tmp_path / "run")
    resume(resumed, tmp_path / "run" / "checkpoint-4")
    with pytest.warns(UserWarning, match=MOVED):
        resumed.fit()
    (kept,) = aside(tmp_path / "run", "logs.jsonl")
    assert kept.read_bytes() == before  # the other run's record, and this run's as they were: moved, not cut
    untimed = [{k: v for k, v in r.items() if "runtime" not in k and "per_second" not in k and k != "run_id"}
               for r in records(log)]  # fmt: skip
    expected = [{k: v for k, v in r.items() if "runtime" not in k and "per_second" not in k and k != "run_id"}
                for r in records(tmp_path / "clean" / "logs.jsonl")]  # fmt: skip
    assert untimed == expected  # this run's file: each of its records once, as the uninterrupted run's
    assert {r["run_id"] for r in records(log)} == {crashed.state.run_id}
    (kept_table,) = aside(tmp_path / "run", "logs.csv")
    assert kept_table.read_bytes() == table_before
    assert rows(table) == rows(tmp_path / "clean" / "logs.csv")  # the CSV likewise


def test_a_resume_of_the_runs_own_file_cuts_and_warns_nothing(tmp_path: Path) -> None:
    crashed = engine(tmp_path, 8, sinks=tmp_path, crash_at=5)
    with pytest.raises(Crash):
        crashed.fit()
    resumed = engine(tmp_path, 8, sinks=tmp_path)
    resume(resumed, True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.fit()
    assert not aside(tmp_path, "logs.jsonl")
    assert [r["step"] for r in records(tmp_path / "logs.jsonl") if "loss" in r] == list(range(1, 9))
