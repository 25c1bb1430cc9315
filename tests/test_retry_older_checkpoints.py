"""A retried fit() after a resume keeps the run's own checkpoints, also an older release's (issue 37, item 7).

With run ids (tests/test_logs37_identity.py) a retried fit() knows the checkpoints are its run's. An older
release's checkpoints carry no id, and a fit() that failed before it saved left the claim judging "as
before": the step it reached has no checkpoint, so ``holds_state`` said "not this run's" and the retry
set the run's own checkpoints aside ("this fresh run moved them").
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.ckpt_hostile_helpers import make_engine
from trainbus.engine import Event
from trainbus.plugins.checkpoints import io as cio
from trainbus.plugins.checkpoints.checkpoint import resume
from trainbus.plugins.checkpoints.directory import previous_runs
from trainbus.plugins.checkpoints.history import OWN_STATE
from trainbus.plugins.checkpoints.identity import MANIFEST_KEY


class Crash(RuntimeError):
    pass


def crash_at(step: int) -> Any:
    def crash(ev: Any) -> None:
        if ev.engine.state.global_step == step:
            raise Crash(f"step {step}")

    return crash


def without_ids(root: Path) -> None:
    """``root``'s checkpoints as an older release wrote them: no run id in the manifest nor the state."""
    for checkpoint in root.glob("checkpoint-*"):
        own = json.loads((checkpoint / OWN_STATE).read_text())
        own["state"].pop("run_id", None)
        (checkpoint / OWN_STATE).write_text(json.dumps(own))
        manifest = json.loads((checkpoint / cio.MANIFEST).read_text())
        manifest.pop(MANIFEST_KEY, None)
        manifest["files"][OWN_STATE] = cio.file_entry(checkpoint / OWN_STATE)
        (checkpoint / cio.MANIFEST).write_text(json.dumps(manifest))


def test_a_retried_fit_keeps_an_older_releases_checkpoints(tmp_path: Path) -> None:
    first = make_engine(tmp_path, 8)
    first.on(Event.STEP_END, crash_at(5))
    with pytest.raises(Crash):
        first.fit()  # checkpoints 2 and 4
    without_ids(tmp_path)
    resumed = make_engine(tmp_path, 8)
    resumed.on(Event.STEP_END, crash_at(5))
    resume(resumed, True)
    with pytest.raises(Crash):
        resumed.fit()  # fails again at step 5, before its next checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "this fresh run moved them" would be an error
        resumed.fit()
    assert not previous_runs(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [f"checkpoint-{s}" for s in (2, 4, 6, 8)]
