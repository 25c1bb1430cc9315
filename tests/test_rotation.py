"""Invariant 7: rotation keeps at most save_total_limit complete checkpoints (+1 when the best is
not the newest); the best and the newest always exist; incomplete checkpoints are never resumed from."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as hs

from trainbus.engine import Engine
from trainbus.engine.events import SaveEvent
from trainbus.plugins.checkpoints.checkpoint import (
    Checkpointing,
    checkpoints_to_keep,
    latest_checkpoint,
    list_checkpoints,
    resume,
)


def reference_keep(steps: list[int], limit: int, best: int | None) -> set[int]:
    """HF's rule, written independently: newest ``limit``; an older best takes the oldest slot
    of those, but never the newest's (so limit 1 keeps 2)."""
    newest_first = sorted(steps, reverse=True)
    keep = newest_first[:limit]
    if best is not None and best in steps and best not in keep:
        if len(keep) > 1:
            keep = keep[:-1]
        keep.append(best)
    return set(keep)


@given(
    steps=hs.lists(hs.integers(1, 60), min_size=1, max_size=10, unique=True).map(sorted),
    limit=hs.integers(1, 5),
    data=hs.data(),
)
def test_kept_set_invariants(steps: list[int], limit: int, data: Any) -> None:
    best = data.draw(hs.one_of(hs.none(), hs.sampled_from(steps)))
    keep = checkpoints_to_keep(steps, limit, best)
    newest = steps[-1]
    assert keep <= set(steps)
    assert newest in keep
    if best is not None:
        assert best in keep
    assert len(keep) <= limit + (1 if best is not None and best != newest else 0)
    assert len(keep) == min(len(steps), max(limit, 2 if best not in (None, newest) else 1))
    assert keep == reference_keep(steps, limit, best)


def test_zero_limit_is_rejected() -> None:
    with pytest.raises(ValueError, match="save_total_limit"):
        checkpoints_to_keep([1, 2], 0, None)


def _engine() -> Engine:
    model = torch.nn.Linear(2, 1)
    return Engine(model, torch.optim.SGD(model.parameters(), lr=0.1))


@given(
    gaps=hs.lists(hs.integers(1, 4), min_size=1, max_size=7),
    limit=hs.one_of(hs.none(), hs.integers(1, 3)),
    new_best=hs.lists(hs.booleans(), min_size=7, max_size=7),
    corrupt_newest=hs.booleans(),
)
def test_rotation_on_disk(
    tmp_path_factory: pytest.TempPathFactory,
    gaps: list[int],
    limit: int | None,
    new_best: list[bool],
    corrupt_newest: bool,
) -> None:
    out = tmp_path_factory.mktemp("run")
    # incomplete directories at higher steps: one without a manifest, one another live process is writing
    junk = [out / "checkpoint-1000", out / f"checkpoint-2000.tmp-{os.getppid()}"]
    for directory in junk:
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"half")
    engine = _engine()
    plugin = Checkpointing(out, save_total_limit=limit)
    engine.add_plugin(plugin)
    state = engine.state
    step, best, saved = 0, None, []
    for gap, is_best in zip(gaps, new_best, strict=False):
        step += gap
        state.global_step = step
        if is_best:
            state.best_global_step, best = step, step
        plugin.save(SaveEvent(engine))
        saved.append(step)
        complete = [s for s, _ in list_checkpoints(out)]
        assert complete[-1] == step, "the newest checkpoint must exist"
        if best is not None:
            assert state.best_model_checkpoint == str(out / f"checkpoint-{best}")
            assert best in complete, "the best checkpoint must never be deleted"
        if limit is not None:
            assert len(complete) <= limit + (1 if best not in (None, step) else 0)
            assert set(complete) == reference_keep(saved, limit, best)
        else:
            assert complete == saved
        assert all(directory.exists() for directory in junk), "rotation must not touch incomplete directories"
        assert latest_checkpoint(out) == out / f"checkpoint-{step}"
    if corrupt_newest and len(list_checkpoints(out)) > 1:
        (out / f"checkpoint-{step}" / "manifest.json").unlink()
        step = list_checkpoints(out)[-1][0]
    fresh = _engine()
    fresh.add_plugin(Checkpointing(out))
    assert resume(fresh, True) == out / f"checkpoint-{step}"
    assert fresh.state.global_step == step


def test_a_new_run_never_deletes_its_newest_checkpoint_for_older_runs_higher_steps(tmp_path: Any) -> None:
    # an earlier, longer run left checkpoint-238 and checkpoint-289 in the same directory
    old = _engine()
    old_plugin = Checkpointing(tmp_path, save_total_limit=2)
    old.add_plugin(old_plugin)
    for step in (238, 289):
        old.state.global_step = step
        old_plugin.save(SaveEvent(old))
    engine = _engine()
    plugin = Checkpointing(tmp_path, save_total_limit=2)
    engine.add_plugin(plugin)
    for step in (85, 102):
        engine.state.global_step = step
        plugin.save(SaveEvent(engine))
        assert (tmp_path / f"checkpoint-{step}").exists(), "the checkpoint just written must survive rotation"
    # the old run's checkpoints rotated out first, oldest step first
    assert [step for step, _ in list_checkpoints(tmp_path)] == [85, 102]


def test_a_checkpoint_rotation_cannot_delete_is_warned_about_and_the_run_goes_on(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno
    import warnings

    from trainbus.plugins.checkpoints.checkpoint import Checkpointing, list_checkpoints

    real_replace = os.replace

    def no_delete(src: Any, dst: Any) -> None:  # a checkpoint on a read-only mount, a busy NFS file...
        if ".del-" in str(dst):
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        real_replace(src, dst)

    model = torch.nn.Linear(2, 1)
    engine = Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=[(torch.ones(2, 2), torch.ones(2, 1))] * 4,
        max_steps=4, loss_fn=torch.nn.MSELoss(),
        plugins=[Checkpointing(tmp_path, save_total_limit=1, save_strategy="steps", save_steps=1)],
    )  # fmt: skip
    monkeypatch.setattr(os, "replace", no_delete)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.fit().global_step == 4  # the run goes on to its end
    messages = [str(w.message) for w in caught]
    assert any("could not delete" in m and "checkpoint-1" in m and "Permission denied" in m for m in messages)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [1, 2, 3, 4]  # kept, nothing half-deleted
    monkeypatch.setattr(os, "replace", real_replace)
    engine.state.global_step = 5
    engine.control.should_save = False
    engine.get_plugin(Checkpointing).save(SaveEvent(engine))  # type: ignore[union-attr]
    assert [step for step, _ in list_checkpoints(tmp_path)] == [5]  # the next rotation catches up
