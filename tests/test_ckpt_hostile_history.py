"""A damaged log-history segment costs at most that history, never the checkpoint (#29 item 4).

Full segments of the log history are hard-linked from checkpoint to checkpoint (history.py), so
one flipped bit in one inode is in every checkpoint that links it. A resume keeps the newest
checkpoint and loses only the records of the damaged segment, with a warning naming it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ckpt_hostile_helpers import flip_byte, make_engine, same_weights
from trainbus.plugins.checkpoints import history
from trainbus.plugins.checkpoints.checkpoint import list_checkpoints, resume, save_checkpoint


@pytest.fixture
def small_segments(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(history, "SEGMENT", 2)
    history._CACHE.clear()
    return 2


def test_a_flipped_bit_in_a_linked_segment_loses_that_segment_only(tmp_path: Path, small_segments: int) -> None:
    run = make_engine(tmp_path, max_steps=6)
    run.fit()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 4, 6]
    first = history.segment_name(0)
    linked = {(tmp_path / f"checkpoint-{s}" / first).stat().st_ino for s in (2, 4, 6)}
    assert len(linked) == 1  # one inode in all three checkpoints
    flip_byte(tmp_path / "checkpoint-6" / first)
    fresh = make_engine(tmp_path, max_steps=8)
    with pytest.warns(UserWarning, match=rf"{first} .*damaged.*2 log records .*lost"):
        assert resume(fresh, True) == tmp_path / "checkpoint-6"
    assert fresh.state.global_step == 6 and same_weights(fresh.model, tmp_path / "checkpoint-6")
    assert [r["step"] for r in fresh.state.log_history] == [3, 4, 5, 6]  # segments 1 and 2 kept, 0 lost
    fresh.fit()  # and the run goes on, writing segments of its own
    again = make_engine(tmp_path, max_steps=8)
    resume(again, tmp_path / "checkpoint-8")
    assert [r["step"] for r in again.state.log_history] == [3, 4, 5, 6, 7, 8]


def test_a_missing_or_unparsable_segment_is_that_history_only(tmp_path: Path, small_segments: int) -> None:
    run = make_engine(tmp_path, max_steps=4)
    run.fit()
    directory = tmp_path / "checkpoint-4"
    (directory / history.segment_name(1)).unlink()
    fresh = make_engine(tmp_path, max_steps=4)
    with pytest.warns(UserWarning, match=rf"{history.segment_name(1)} .*damaged"):
        resume(fresh, directory)
    assert [r["step"] for r in fresh.state.log_history] == [1, 2]


def test_a_manifest_listing_segments_badly_is_still_damage(tmp_path: Path, small_segments: int) -> None:
    """What the manifest says is not a segment's to forgive: a name outside the directory falls back."""
    run = make_engine(tmp_path, max_steps=4)
    run.fit()
    directory = tmp_path / "checkpoint-4"
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest[history.MANIFEST_KEY] = ["../checkpoint-2/log_history-000000.json"]
    (directory / "manifest.json").write_text(json.dumps(manifest))
    fresh = make_engine(tmp_path, max_steps=4)
    with pytest.warns(UserWarning, match="skipping the damaged checkpoint .*checkpoint-4"):
        assert resume(fresh, True) == tmp_path / "checkpoint-2"


def test_the_last_checkpoint_before_a_flip_is_not_written_from_the_damaged_file(
    tmp_path: Path, small_segments: int
) -> None:
    """A segment damaged between two saves of one run is linked again (its mtime did not move): the
    newer checkpoint loses that history too, never more, and never the checkpoint."""
    run = make_engine(tmp_path, max_steps=4)
    run.fit()
    flip_byte(tmp_path / "checkpoint-4" / history.segment_name(0))
    run.state.log_history.append({"loss": 0.1, "step": 5})
    run.state.global_step = 5
    save_checkpoint(run, tmp_path)
    fresh = make_engine(tmp_path, max_steps=6)
    with pytest.warns(UserWarning, match="log records .*lost"):
        assert resume(fresh, True) == tmp_path / "checkpoint-5"
    assert [r["step"] for r in fresh.state.log_history] == [3, 4, 5]
