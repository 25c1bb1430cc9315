"""A save's rotation does not read every checkpoint's manifest (#29 item 8).

With ``save_total_limit=None`` (HF's default) nothing is rotated, yet every save read the manifest
of every checkpoint in output_dir: saves grew with the run (5.2x slower at 200 checkpoints). The
reads are counted here (timing lives in benchmarks/checkpoint_rotation.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.ckpt_hostile_helpers import make_engine
from trainbus.plugins.checkpoints import verified
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, list_checkpoints


def counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    reads: list[int] = []
    real = verified.read_manifest
    monkeypatch.setattr(verified, "read_manifest", lambda *a, **k: reads.append(1) or real(*a, **k))
    return reads


def reads_per_save(engine: Any, saves: int, reads: list[int]) -> list[int]:
    """Manifest reads of each of ``saves`` saves through the plugin, at steps after every existing one."""
    plugin = engine.get_plugin(Checkpointing)
    counts = []
    for _ in range(saves):
        engine.state.global_step += 1
        before = len(reads)
        plugin.save(SimpleNamespace(engine=engine))
        counts.append(len(reads) - before)
    return counts


def test_without_a_limit_a_save_reads_no_other_manifest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counts = {}
    for existing in (3, 40):
        out = tmp_path / f"run-{existing}"
        engine = make_engine(out, 2)
        engine.fit()
        for step in range(3, 3 + existing):
            shutil.copytree(out / "checkpoint-2", out / f"checkpoint-{step}")
        engine.state.global_step = 2 + existing
        reads = counting_reads(monkeypatch)
        real_listdir = os.listdir
        monkeypatch.setattr(
            os, "listdir", lambda path=".": reads.append(1) if Path(path) == out else None or real_listdir(path)
        )
        counts[existing] = reads_per_save(engine, 3, reads)
        monkeypatch.undo()
    # the run's first save (in fit()) tidied output_dir once; after it a save neither reads nor lists anything
    assert counts[3] == counts[40] == [0, 0, 0], counts


def test_with_a_limit_a_save_costs_what_it_keeps_not_what_the_run_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Manifest reads and path resolutions (a few system calls each) per save stay flat over 40 saves."""
    engine = make_engine(tmp_path, 2, save_total_limit=2)
    engine.fit()
    reads = counting_reads(monkeypatch)
    real_resolve = Path.resolve
    monkeypatch.setattr(Path, "resolve", lambda self, *a, **k: reads.append(1) or real_resolve(self, *a, **k))
    counts = reads_per_save(engine, 40, reads)
    monkeypatch.undo()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [41, 42]
    assert max(counts[2:]) == min(counts[2:]) <= 12, counts  # the kept ones and the new one: not the 40 written


def test_the_rotation_benchmark_runs_both_rows(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from benchmarks import checkpoint_rotation

    monkeypatch.setattr(os, "sync", lambda: None)  # untimed there, and slow on a machine others write on
    results = checkpoint_rotation.main(["--job", "tiny", "--rounds", "2", "--many", "20"])
    assert set(results) == set(checkpoint_rotation.MODES)
    assert all(len(times) == 2 and min(times) > 0 for row in results.values() for times in row.values())
    assert "ms with 20 checkpoints" in capsys.readouterr().out
