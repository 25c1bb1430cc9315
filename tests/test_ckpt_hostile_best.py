"""The best checkpoint is named relative to its run directory (#29 item 5).

``state.best_model_checkpoint`` is a path as the run wrote it (transformers' value in
trainer_state.json, kept as HF writes it). Trusted as a path it broke three ways: after moving the
run directory the best was forgotten and rotated away; after copying it the copy loaded the best
from the original; a relative output_dir resumed from another working directory lost it; and a
forged state (rehashed) made the run load weights from outside its directory. What trainbus trusts
is the name ``checkpoint-N`` inside the directory of the checkpoint it resumed from.
"""

from __future__ import annotations

import builtins
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ckpt_hostile_helpers import make_engine, rehash, rewrite_json, same_weights, weights
from trainbus.engine import Event
from trainbus.plugins.checkpoints import io as cio
from trainbus.plugins.checkpoints.checkpoint import LoadBestModelAtEnd, list_checkpoints, resume


def best_run(output_dir: Path, max_steps: int = 4) -> Any:
    """Checkpoints every step, at most 2 kept; step 2 is the best (marked before its save)."""
    engine = make_engine(output_dir, max_steps, LoadBestModelAtEnd(), save_steps=1, save_total_limit=2)

    def mark(ev: Any) -> None:
        if ev.engine.state.global_step == 2:
            ev.engine.state.best_global_step = 2

    engine.on(Event.STEP_END, mark)
    return engine


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("best") / "run"
    best_run(root).fit()
    assert [step for step, _ in list_checkpoints(root)] == [2, 4]
    return root


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    seen: list[Path] = []
    real_open, real_os_open = builtins.open, os.open

    def spy_open(file: Any, *a: Any, **k: Any) -> Any:
        if isinstance(file, str | os.PathLike):
            seen.append(Path(file).absolute())
        return real_open(file, *a, **k)

    def spy_os_open(file: Any, *a: Any, **k: Any) -> Any:
        seen.append(Path(os.fsdecode(file)).absolute())
        return real_os_open(file, *a, **k)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    yield seen


def other_weights(directory: Path) -> None:
    """The checkpoint holds other (sound, consistently hashed) weights: another run's."""
    tensors = {k: v + 1 for k, v in weights(directory).items()}
    (directory / "model.safetensors").unlink()
    cio.write_tensors(directory / "model.safetensors", tensors)
    rehash(directory, "model.safetensors")


def test_a_moved_run_directory_keeps_its_best(template: Path, tmp_path: Path) -> None:
    moved = tmp_path / "moved"
    shutil.copytree(template, moved)  # the original is gone: moved
    fresh = best_run(moved, max_steps=6)
    resume(fresh, True)
    assert Path(fresh.state.best_model_checkpoint or "") == moved / "checkpoint-2"
    fresh.fit()
    assert [step for step, _ in list_checkpoints(moved)] == [2, 6]  # the best kept by rotation
    assert same_weights(fresh.model, moved / "checkpoint-2")  # and loaded at the end


def test_a_copied_run_directory_reads_its_own_best_not_the_originals(
    template: Path, tmp_path: Path, opened: list[Path]
) -> None:
    original, copy = tmp_path / "original", tmp_path / "copy"
    shutil.copytree(template, original)
    shutil.copytree(template, copy)
    fresh = best_run(copy, max_steps=6)
    import json

    state = json.loads((copy / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] == str(template / "checkpoint-2")  # as the run wrote it (HF's value)
    rewrite_json(
        copy / "checkpoint-4",
        "trainer_state.json",
        lambda s: s.update(best_model_checkpoint=str(original / "checkpoint-2")),
    )
    other_weights(original / "checkpoint-2")
    opened.clear()  # the copies above read the original: from here on nothing may
    resume(fresh, True)
    fresh.fit()
    assert same_weights(fresh.model, copy / "checkpoint-2")
    assert not [p for p in opened if original in p.parents], "read the original run's files"


def test_a_relative_output_dir_resumed_from_another_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    best_run(Path("out")).fit()
    monkeypatch.chdir(tmp_path / "b")
    fresh = best_run(Path("../a/out"), max_steps=6)
    resume(fresh, True)
    assert Path(fresh.state.best_model_checkpoint or "").resolve() == tmp_path / "a" / "out" / "checkpoint-2"
    fresh.fit()
    assert [step for step, _ in list_checkpoints(tmp_path / "a" / "out")] == [2, 6]
    assert same_weights(fresh.model, tmp_path / "a" / "out" / "checkpoint-2")


#: forged values of best_model_checkpoint; those whose last part is checkpoint-2 name the run's own best
FORGED = ["outside", "../outside/checkpoint-2", "/etc", "checkpoint-9", "checkpoint-2/..", "../outside"]


@pytest.mark.parametrize("forged", FORGED)
def test_a_forged_best_never_loads_weights_from_outside_the_run(
    template: Path, tmp_path: Path, opened: list[Path], forged: str
) -> None:
    import warnings

    run, outside = tmp_path / "run", tmp_path / "outside"
    shutil.copytree(template, run)
    shutil.copytree(template / "checkpoint-2", outside / "checkpoint-2")
    other_weights(outside / "checkpoint-2")
    shutil.copytree(outside / "checkpoint-2", outside, dirs_exist_ok=True)  # a checkpoint of other weights there too
    value = str(outside / "checkpoint-2") if forged == "outside" else forged
    rewrite_json(run / "checkpoint-4", "trainer_state.json", lambda s: s.update(best_model_checkpoint=value))
    fresh = best_run(run, max_steps=6)
    opened.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resume(fresh, True)
        fresh.fit()
    best = fresh.state.best_model_checkpoint
    assert best is None or Path(best).parent == run, best
    assert not [p for p in opened if outside in p.parents or p.parent == outside], "read files outside the run"
    assert not same_weights(fresh.model, outside / "checkpoint-2")
    if Path(value).name == "checkpoint-2":  # the name is the run's own best: kept, inside
        assert same_weights(fresh.model, run / "checkpoint-2")
    else:
        messages = [str(w.message) for w in caught]
        assert any("best_model_checkpoint" in m and "forgotten" in m for m in messages), messages


def test_load_best_at_the_end_refuses_a_path_that_is_not_a_checkpoint_of_the_run(
    template: Path, tmp_path: Path
) -> None:
    from types import SimpleNamespace

    run, outside = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(template, run)
    shutil.copytree(template / "checkpoint-2", outside)
    engine = best_run(run)
    engine.state.best_model_checkpoint = str(outside)  # set by a plugin: no checkpoint-N name
    own = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with pytest.warns(UserWarning, match=r"LoadBestModelAtEnd: .*elsewhere.* is not a checkpoint-N"):
        LoadBestModelAtEnd().load(SimpleNamespace(engine=engine))
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in own.items())
