"""Run protection for a bare Engine with Checkpointing (#28 item 1): the Trainer's rule, held by the plugin.

A fresh ``fit()`` into an output_dir holding another run's checkpoints moves them to
``output_dir/previous-runs/<time>/`` with a warning, so rotation never deletes them and a later
``resume(engine, True)`` never loads them; a resume of the run's own checkpoint continues that run (its
checkpoints stay); a resume from a checkpoint elsewhere starts a new run (output_dir's are set aside). The
output_dir lock is held from TRAIN_START to TRAIN_END, whatever the composition.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from trainbus.engine import Engine, Event
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, list_checkpoints, resume
from trainbus.plugins.checkpoints.directory import previous_runs
from trainbus.plugins.checkpoints.lock import LOCK_FILE, OutputDirInUse, OutputDirLock


class Crash(Exception):
    pass


def engine(out: Path, max_steps: int, *, limit: int | None = None, crash_at: int | None = None, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(2, 2), torch.randn(2, 1)) for _ in range(4)]
    built = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), max_steps=max_steps, train_data=data,
                   loss_fn=torch.nn.MSELoss(), plugins=[Checkpointing(out, save_total_limit=limit,
                   save_strategy="steps", save_steps=2)])  # fmt: skip
    if crash_at is not None:

        def crash(ev: object) -> None:
            if built.state.global_step == crash_at:
                raise Crash(f"killed at step {crash_at}")

        built.on(Event.STEP_END, crash)
    return built


def steps(root: Path) -> list[int]:
    return [step for step, _ in list_checkpoints(root)]


def test_a_fresh_engine_run_sets_another_runs_checkpoints_aside_and_a_resume_never_loads_them(tmp_path: Path) -> None:
    engine(tmp_path, 20, seed=1).fit()  # another run: checkpoint-2 .. checkpoint-20
    assert steps(tmp_path)[-1] == 20
    crashed = engine(tmp_path, 8, limit=2, crash_at=5)
    moved = r"earlier run .*checkpoint-20\): this fresh run moved them to .*, where rotation and resume\(engine, True\)"
    with pytest.warns(UserWarning, match=moved), pytest.raises(Crash):
        crashed.fit()
    (aside,) = previous_runs(tmp_path)
    assert [p.name for p in sorted(aside.iterdir(), key=lambda p: int(p.name.split("-")[1]))] == [
        f"checkpoint-{s}" for s in range(2, 21, 2)
    ]  # rotation (limit 2) deleted none of them
    assert steps(tmp_path) == [2, 4]
    restarted = engine(tmp_path, 8, limit=2)
    assert resume(restarted, True) == tmp_path / "checkpoint-4"  # this run's, not the other run's step 20
    restarted.fit()
    assert restarted.state.global_step == 8 and steps(tmp_path) == [6, 8]
    assert len(previous_runs(tmp_path)) == 1  # resuming its own checkpoint set nothing more aside


def test_a_resumed_engine_run_bit_exact_with_the_uninterrupted_one(tmp_path: Path) -> None:
    clean = engine(tmp_path / "clean", 8)
    clean.fit()
    with pytest.raises(Crash):
        engine(tmp_path / "run", 8, crash_at=5).fit()
    restarted = engine(tmp_path / "run", 8)
    resume(restarted, tmp_path / "run" / "checkpoint-4")  # by its path, directly in output_dir: the same run
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing set aside, nothing to warn about
        restarted.fit()
    assert steps(tmp_path / "run") == [2, 4, 6, 8] and not previous_runs(tmp_path / "run")
    for name, value in clean.model.state_dict().items():
        assert torch.equal(restarted.model.state_dict()[name], value), name


def test_a_resume_from_elsewhere_starts_a_new_run_and_sets_output_dirs_aside(tmp_path: Path) -> None:
    engine(tmp_path / "elsewhere", 4, seed=3).fit()
    engine(tmp_path / "out", 12).fit()  # a run of its own in out
    branch = engine(tmp_path / "out", 8, seed=3)
    resume(branch, tmp_path / "elsewhere" / "checkpoint-4")
    with pytest.warns(UserWarning, match=r"\(checkpoint-2, .*checkpoint-12\): this fresh run moved them"):
        branch.fit()
    assert steps(tmp_path / "out") == [6, 8] and len(previous_runs(tmp_path / "out")) == 1


def test_a_resume_of_a_set_aside_checkpoint_starts_a_new_run(tmp_path: Path) -> None:
    engine(tmp_path, 6, seed=1).fit()
    with pytest.warns(UserWarning, match="this fresh run moved them"):
        engine(tmp_path, 4).fit()  # a fresh run: the first one goes aside
    (aside,) = previous_runs(tmp_path)
    branch = engine(tmp_path, 8, seed=1)
    resume(branch, aside / "checkpoint-6")  # the set-aside run, by its path: a new run here
    with pytest.warns(UserWarning, match=r"\(checkpoint-2, checkpoint-4\): this fresh run moved them"):
        branch.fit()
    assert steps(tmp_path) == [8] and len(previous_runs(tmp_path)) == 2


def test_the_same_engine_fitted_again_goes_on_with_its_own_checkpoints(tmp_path: Path) -> None:
    run = engine(tmp_path, 4)
    run.fit()
    run.state.max_steps = run.max_steps = 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run.fit()
    assert steps(tmp_path) == [2, 4, 6] and not previous_runs(tmp_path)


def test_the_lock_is_held_during_an_engine_fit_and_released_after(tmp_path: Path) -> None:
    run = engine(tmp_path, 2)
    seen: list[bool] = []

    def probe(ev: object) -> None:
        seen.append((tmp_path / LOCK_FILE).exists())
        with pytest.raises(OutputDirInUse):
            OutputDirLock(tmp_path)._take()  # another open file description: as another process would see it

    run.on(Event.STEP_END, probe)
    run.fit()
    assert seen == [True, True] and not (tmp_path / LOCK_FILE).exists() and not OutputDirLock._held


def test_the_trainer_passes_its_own_words(tmp_path: Path) -> None:
    from tests.facade_helpers import Regressor, quiet_args, regression_data
    from trainbus.plugins import Trainer

    def trainer() -> Trainer:
        args = quiet_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
        return Trainer(Regressor(), args, train_dataset=regression_data(8))

    trainer().train()
    with pytest.warns(UserWarning, match=r"where rotation and train\(resume_from_checkpoint=True\) never look"):
        trainer().train()
