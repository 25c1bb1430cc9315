"""A run's identity (#37 item 2): an id written when the run starts, in every checkpoint and log record, carried
across resumes and restarts; "same run" is decided by it, never by the absence of a difference. Checkpoints
without one (older releases) are judged as before, conservatively. On a bare Engine and through the Trainer."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest

from tests.logs37_helpers import Crash, Wide, engine, records, steps, trainer, tree
from trainbus.plugins.checkpoints import io as cio
from trainbus.plugins.checkpoints.directory import previous_runs
from trainbus.plugins.checkpoints.identity import checkpoint_run_id
from trainbus.plugins.checkpoints.resuming import load_checkpoint, resume

SET_ASIDE = "this fresh run moved them"


def test_resuming_another_dirs_checkpoint_with_nothing_to_compare_never_takes_outputs_checkpoints(
    tmp_path: Path,
) -> None:
    """No TrainLogger (no log history to differ in) and parameter names that are none of X's files'."""
    x, y = tmp_path / "x", tmp_path / "y"
    engine(x, 16, logger=False, model=Wide(), limit=4).fit()  # X: another run's checkpoints 10, 12, 14, 16
    before = tree(x)
    engine(y, 10, logger=False, seed=1).fit()
    branch = engine(x, 16, logger=False, seed=1, limit=4)
    resume(branch, y / "checkpoint-10")
    with pytest.warns(UserWarning, match=SET_ASIDE):
        branch.fit()
    (aside,) = previous_runs(x)
    assert tree(aside) == {k: v for k, v in before.items() if k.startswith("checkpoint-")}  # all four, intact
    assert steps(x) == [12, 14, 16] and checkpoint_run_id(x / "checkpoint-12") == branch.state.run_id


def test_a_foreign_checkpoint_copied_into_the_dir_never_passes_for_the_runs_own(tmp_path: Path) -> None:
    """The directory rule says "same run" (the checkpoint is directly in output_dir); the ids say otherwise."""
    x, y = tmp_path / "x", tmp_path / "y"
    engine(x, 8, logger=False, model=Wide()).fit()
    before = tree(x)
    engine(y, 10, logger=False, seed=1).fit()
    shutil.copytree(y / "checkpoint-10", x / "checkpoint-10")  # copied in by hand
    resumed = engine(x, 14, logger=False, seed=1, limit=2)
    assert resume(resumed, True) == x / "checkpoint-10"
    with pytest.warns(UserWarning, match=SET_ASIDE):
        resumed.fit()
    (aside,) = previous_runs(x)
    assert {k: v for k, v in tree(aside).items() if not k.startswith("checkpoint-10/")} == {
        k: v for k, v in before.items() if k.startswith("checkpoint-")
    }  # the other run's checkpoints: none rotated away, none overwritten
    assert steps(x) == [12, 14]


def test_a_trainer_resuming_a_copied_in_checkpoint_sets_the_other_runs_aside(tmp_path: Path) -> None:
    x, y = tmp_path / "x", tmp_path / "y"
    saving = {"save_strategy": "steps", "save_steps": 2}
    trainer(x, **saving).train()  # run B in X: checkpoints 2 .. 8
    before = tree(x)
    trainer(y, seed=1, max_steps=10, **saving).train()
    shutil.copytree(y / "checkpoint-10", x / "checkpoint-10")
    resumed = trainer(x, seed=1, max_steps=12, save_total_limit=2, **saving)
    with pytest.warns(UserWarning, match=SET_ASIDE):
        resumed.train(resume_from_checkpoint=True)
    (aside,) = previous_runs(x)
    kept = {k: v for k, v in tree(aside).items() if not k.startswith("checkpoint-10/")}
    assert kept == {k: v for k, v in before.items() if k.startswith("checkpoint-")}
    assert resumed.state.global_step == 12 and steps(x) == [12]


def test_the_id_is_in_every_checkpoint_and_record_and_carried_across_a_resume(tmp_path: Path) -> None:
    crashed = engine(tmp_path, 8, sinks=tmp_path, crash_at=5)
    with pytest.raises(Crash):
        crashed.fit()
    run = crashed.state.run_id
    assert run is not None and {checkpoint_run_id(tmp_path / f"checkpoint-{s}") for s in (2, 4)} == {run}
    own = json.loads((tmp_path / "checkpoint-4" / "trainbus_state.json").read_text())["state"]
    assert own["run_id"] == run  # in the trainer state too
    resumed = engine(tmp_path, 8, sinks=tmp_path)
    resume(resumed, True)
    assert resumed.state.run_id == run
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed.fit()
    assert {checkpoint_run_id(tmp_path / f"checkpoint-{s}") for s in (2, 4, 6, 8)} == {run}
    assert {r["run_id"] for r in records(tmp_path / "logs.jsonl")} == {run}
    assert not previous_runs(tmp_path)


def test_a_retried_fit_after_a_resume_keeps_the_runs_own_checkpoints(tmp_path: Path) -> None:
    with pytest.raises(Crash):
        engine(tmp_path, 8, crash_at=5).fit()
    resumed = engine(tmp_path, 8, crash_at=5)
    resume(resumed, tmp_path / "checkpoint-4")
    with pytest.raises(Crash):
        resumed.fit()  # fails again at step 5, before its next checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing set aside: "this fresh run moved them" would be an error
        resumed.fit()  # the same engine tried again: the same run (it used to set its own checkpoints aside)
    assert not previous_runs(tmp_path) and steps(tmp_path) == [2, 4, 6, 8]


def test_a_trainer_restart_carries_the_id(tmp_path: Path) -> None:
    saving = {"save_strategy": "steps", "save_steps": 2, "report_to": ["jsonl"]}
    first = trainer(tmp_path, max_steps=4, **saving)
    first.train()
    again = trainer(tmp_path, **saving)
    again.train(resume_from_checkpoint=True)
    assert again.state.run_id == first.state.run_id
    assert {checkpoint_run_id(tmp_path / f"checkpoint-{s}") for s in (2, 4, 6, 8)} == {first.state.run_id}
    assert {r["run_id"] for r in records(tmp_path / "logs.jsonl")} == {first.state.run_id}


def _without_ids(root: Path) -> None:
    """Make ``root``'s checkpoints look written by an older release: no run_id in manifest nor state."""
    for checkpoint in root.glob("checkpoint-*"):
        manifest = json.loads((checkpoint / cio.MANIFEST).read_text())
        manifest.pop("run_id", None)
        state = json.loads((checkpoint / "trainbus_state.json").read_text())
        state["state"].pop("run_id", None)
        (checkpoint / "trainbus_state.json").write_text(json.dumps(state, indent=1, sort_keys=True))
        manifest["files"]["trainbus_state.json"] = cio.file_entry(checkpoint / "trainbus_state.json")
        (checkpoint / cio.MANIFEST).write_text(json.dumps(manifest))


def test_checkpoints_without_ids_are_judged_conservatively(tmp_path: Path) -> None:
    """An older release's checkpoints with nothing to compare (no log history, other parameter names), loaded by a
    caller that does not say where it read: not this run's (the weight comparison compared nothing, and said so)."""
    x, y = tmp_path / "x", tmp_path / "y"
    engine(x, 8, logger=False, model=Wide()).fit()
    engine(y, 8, logger=False, seed=1).fit()
    _without_ids(x)
    _without_ids(y)
    before = tree(x)
    branch = engine(x, 12, logger=False, seed=1, limit=1)
    load_checkpoint(branch, y / "checkpoint-8")
    assert getattr(branch.state, "run_id", None) is None  # an older release's state
    with pytest.warns(UserWarning, match=SET_ASIDE):
        branch.fit()
    (aside,) = previous_runs(x)
    assert tree(aside) == {k: v for k, v in before.items() if k.startswith("checkpoint-")}
    assert steps(x) == [12]
