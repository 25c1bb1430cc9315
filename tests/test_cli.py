"""The ``trainbus`` command: the digits demo in-process (quick mode) and the module entry point."""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainbus.plugins.cli.demo import QUICK_EPOCHS, _clear_old_checkpoints, build_parser, main


def test_quick_demo_trains_checkpoints_logs_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out

    match = re.search(r"test accuracy\s+([0-9.]+)", printed)
    assert match is not None, printed
    assert float(match.group(1)) > 0.8

    # one table row per epoch-end evaluation (early stopping may end the run sooner)
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+[0-9.]+\s+[0-9.]+\s+([0-9.]+)", printed, flags=re.M)
    assert 1 <= len(rows) <= QUICK_EPOCHS
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1))

    # save_total_limit=2: the best and the newest checkpoint remain
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    state = json.loads((checkpoints[-1] / "trainer_state.json").read_text())  # the newest knows the final best
    assert 1 <= len(checkpoints) <= 2
    best = Path(state["best_model_checkpoint"])
    assert best.exists() and best.name in printed
    assert f"checkpoint-{rows[-1][1]}" in {p.name for p in checkpoints}
    for ckpt in checkpoints:
        assert (ckpt / "model.safetensors").exists() and (ckpt / "trainer_state.json").exists()
    assert state["best_metric"] == pytest.approx(max(float(r[2]) for r in rows), abs=1e-4)

    records = [json.loads(line) for line in (out / "logs.jsonl").read_text().splitlines()]
    assert sum("eval_accuracy" in r for r in records) == len(rows)
    assert any("train_loss" in r for r in records)
    header = (out / "logs.csv").read_text().splitlines()[0].split(",")
    assert header[0] == "step" and {"loss", "eval_accuracy", "learning_rate", "grad_norm"} <= set(header)
    assert (out / "model.safetensors").exists()
    assert (out / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the demo's PlotCurves


def test_epochs_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--epochs", "0"])
    assert exc.value.code == 2
    assert "--epochs must be >= 1, got 0" in capsys.readouterr().err


def test_a_command_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args([])
    assert "COMMAND" in capsys.readouterr().err


def test_module_help_runs_in_a_subprocess() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trainbus.plugins.cli.demo", "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "usage: trainbus" in result.stdout and "demo" in result.stdout


def test_old_checkpoints_stop_the_demo_unless_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "checkpoint-7").mkdir()
    (tmp_path / "notes.txt").write_text("kept")
    assert main(["demo", "--quick", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "checkpoint-7" in err and "--overwrite-output-dir" in err
    assert (tmp_path / "checkpoint-7").exists() and not (tmp_path / "logs.jsonl").exists()

    _clear_old_checkpoints(str(tmp_path), overwrite=True)  # set aside, never deleted
    assert not (tmp_path / "checkpoint-7").exists() and (tmp_path / "notes.txt").read_text() == "kept"
    assert [p.name for p in (tmp_path / "previous-runs").glob("*/checkpoint-7")] == ["checkpoint-7"]


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    expected = f"trainbus {importlib.metadata.version('trainbus')}"
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == expected
    result = subprocess.run(
        [sys.executable, "-m", "trainbus.plugins.cli", "--version"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == expected, result.stderr
