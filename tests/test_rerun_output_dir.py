"""A script rerun into its own output_dir (#27 item 6): it trains as under transformers 5, and nothing is lost.

The rule (plugins/checkpoints/lock.py): the ``checkpoint-N`` directly in output_dir are one run's, the
run that last started there fresh and its resumes. A fresh ``train()`` moves the earlier run's into
``output_dir/previous-runs/<time>/`` (a warning names it) and then writes transformers' checkpoint
names; ``resume_from_checkpoint=True`` never looks there, so it never resumes another run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.differential.hf_diff import (
    assert_same_logs,
    assert_same_weights,
    checkpoint_names,
    implementation,
    read_state,
    regression_trainer,
    state_summary,
)
from tests.facade_helpers import Regressor, quiet_args, regression_data
from trainbus.engine import ConfigError
from trainbus.plugins import Trainer, TrainerCallback
from trainbus.plugins.checkpoints import directory
from trainbus.plugins.checkpoints.directory import PREVIOUS_RUNS, previous_runs

ROOT = Path(__file__).resolve().parent.parent
NAMING_THE_DIR = {"training_args.json", "manifest.json", "trainer_state.json"}  # these hold output_dir's path


def tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def ckpt_files(root: Path) -> dict[str, bytes]:
    """The checkpoints directly in root, file by file, less the files that name the directory.

    trainbus_state.json less its event_counts (a resumed run fires TRAIN_START and EPOCH_START once more) and its
    run_id (each run has its own).
    """
    return {name: _less_event_counts(name, data) for name, data in tree(root).items()
            if name.startswith("checkpoint-") and Path(name).name not in NAMING_THE_DIR}  # fmt: skip


def _less_event_counts(name: str, data: bytes) -> bytes:
    if Path(name).name != "trainbus_state.json":
        return data
    document = json.loads(data)
    del document["state"]["event_counts"], document["state"]["run_id"]
    return json.dumps(document, sort_keys=True).encode()


def trainer(out: Path, **kwargs: Any) -> Trainer:
    torch.manual_seed(0)
    kwargs = {"max_steps": 12, "save_strategy": "steps", "save_steps": 4, "learning_rate": 0.05, "logging_steps": 2,
              **kwargs}  # fmt: skip
    return Trainer(Regressor(), quiet_args(out, **kwargs), train_dataset=regression_data(48))


class StopAt(TrainerCallback):
    """An interruption at a step (a crash as a resume sees it: the checkpoints written so far stay)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"interrupted at step {self.step}")


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


# -- against transformers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("resume", [None, False])
def test_a_rerun_trains_as_transformers_and_keeps_the_earlier_run(tmp_path: Path, resume: bool | None) -> None:
    results = {}
    for name in ("transformers", "trainbus"):
        impl, out = implementation(name), tmp_path / name
        regression_trainer(impl, out, save_steps=5, logging_steps=5, seed=1).train()
        first = tree(out)
        rerun = regression_trainer(impl, out, save_steps=5, logging_steps=5, learning_rate=0.05)
        if resume is None:
            rerun.train()
        else:
            rerun.train(resume_from_checkpoint=resume)
        results[name] = (rerun, first, {n: state_summary(read_state(out / n), out) for n in checkpoint_names(out)})
    (hf, _, hf_states), (tb, tb_first, tb_states) = results["transformers"], results["trainbus"]
    assert_same_logs(hf.state.log_history, tb.state.log_history)  # the rerun trains as transformers does
    assert_same_weights(hf.model, tb.model)
    names = ["checkpoint-5", "checkpoint-10", "checkpoint-15", "checkpoint-20", "checkpoint-24"]
    assert checkpoint_names(tmp_path / "transformers") == checkpoint_names(tmp_path / "trainbus") == names
    assert hf_states == tb_states  # and its checkpoints say what transformers' say
    (aside,) = previous_runs(tmp_path / "trainbus")  # the first run's checkpoints, byte for byte
    assert tree(aside) == {k: v for k, v in tb_first.items() if k.startswith("checkpoint-")}


def test_a_rerun_with_save_total_limit_keeps_transformers_numbers_and_loses_nothing(tmp_path: Path) -> None:
    """transformers 5's rotation counts the earlier run's checkpoints with the rerun's: by time it deletes
    the earlier run's, and when they are under a second apart (by step) the rerun's own and the earlier
    run's it wrote over; either way two remain of the six written. trainbus sets the earlier run aside."""
    finals = {}
    for name in ("transformers", "trainbus"):
        impl, out = implementation(name), tmp_path / name
        regression_trainer(impl, out, save_steps=5, max_steps=20).train()
        rerun = regression_trainer(impl, out, save_steps=5, max_steps=10, save_total_limit=2)
        rerun.train()
        finals[name] = rerun
    assert_same_logs(finals["transformers"].state.log_history, finals["trainbus"].state.log_history)
    hf, tb = tmp_path / "transformers", tmp_path / "trainbus"
    assert len([p for p in hf.rglob("checkpoint-*") if p.is_dir()]) == 2  # four of the earlier run's are lost
    assert checkpoint_names(tb) == ["checkpoint-5", "checkpoint-10"]
    assert [read_state(tb / n)["max_steps"] for n in checkpoint_names(tb)] == [10, 10]  # the rerun's
    (aside,) = previous_runs(tb)
    assert checkpoint_names(aside) == ["checkpoint-5", "checkpoint-10", "checkpoint-15", "checkpoint-20"]
    assert [read_state(aside / n)["max_steps"] for n in checkpoint_names(aside)] == [20] * 4


# -- what a rerun does with the earlier run -----------------------------------------------------------------
def test_a_fresh_rerun_moves_the_earlier_run_aside_warning_where(tmp_path: Path) -> None:
    solo = trainer(tmp_path / "solo")
    solo.train()
    out = tmp_path / "out"
    trainer(out, max_steps=16).train()
    before = tree(out)
    with pytest.warns(UserWarning, match="checkpoints of an earlier run") as caught:
        rerun = trainer(out)
        rerun.train()
    (aside,) = previous_runs(out)
    (message,) = [str(w.message) for w in caught if "earlier run" in str(w.message)]
    assert str(aside) in message and "checkpoint-4, checkpoint-8, checkpoint-12, checkpoint-16" in message
    assert tree(aside) == {k: v for k, v in before.items() if k.startswith("checkpoint-")}  # nothing lost
    assert ckpt_files(out) == ckpt_files(tmp_path / "solo")  # the rerun's checkpoints: a clean run's
    for name, value in weights(solo.model).items():
        assert torch.equal(rerun.model.state_dict()[name], value), name
    resumed = trainer(out, max_steps=20)  # True continues the rerun (its checkpoint-12), not the earlier run
    resumed.train(resume_from_checkpoint=True)
    assert [r["step"] for r in resumed.state.log_history if "loss" in r] == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    assert checkpoint_names(aside) == ["checkpoint-4", "checkpoint-8", "checkpoint-12", "checkpoint-16"]


def test_overwrite_output_dir_changes_nothing_and_a_second_train_is_a_new_run(tmp_path: Path) -> None:
    trainer(tmp_path).train()
    again = trainer(tmp_path, overwrite_output_dir=True)  # HF 5 has no such argument; 4.x's Trainer ignored it
    again.train()
    again.train()  # the same Trainer's second train(): a fresh run too
    assert len(previous_runs(tmp_path)) == 2
    for aside in previous_runs(tmp_path):
        assert checkpoint_names(aside) == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]
    assert checkpoint_names(tmp_path) == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]


def test_a_rerun_without_saves_sets_the_earlier_run_aside_too(tmp_path: Path) -> None:
    """save_strategy="no" still saves when a callback or a signal asks: every fresh train() is a new run."""
    trainer(tmp_path).train()
    before = {k: v for k, v in tree(tmp_path).items() if k.startswith("checkpoint-")}
    trainer(tmp_path, save_strategy="no").train()
    (aside,) = previous_runs(tmp_path)
    assert checkpoint_names(tmp_path) == [] and tree(aside) == before


# -- attacks ---------------------------------------------------------------------------------------------------
#: a child that trains 12 steps into argv[1] and is SIGKILLed after step 6 (checkpoint-4 written)
KILLED = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    from tests.test_rerun_output_dir import trainer
    from trainbus.plugins import TrainerCallback

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 6:
                os.kill(os.getpid(), signal.SIGKILL)

    t = trainer(sys.argv[1])
    t.add_callback(Kill())
    t.train()
    """
)


def test_a_killed_run_resumed_is_the_same_run_and_a_fresh_rerun_starts_over(tmp_path: Path) -> None:
    killed = tmp_path / "killed"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}  # as pytest's sys.path
    run = subprocess.run([sys.executable, "-c", KILLED, str(killed)], cwd=ROOT, env=env, timeout=300)
    assert run.returncode == -signal.SIGKILL
    assert checkpoint_names(killed) == ["checkpoint-4"]
    solo = trainer(tmp_path / "solo")
    solo.train()
    shutil.copytree(killed, tmp_path / "fresh")
    resumed = trainer(killed)
    resumed.train(resume_from_checkpoint=True)  # the killed run, started again: it goes on from its checkpoint-4
    assert not (killed / PREVIOUS_RUNS).exists()
    fresh = trainer(tmp_path / "fresh")
    with pytest.warns(UserWarning, match=r"\(checkpoint-4\): this fresh run moved them"):
        fresh.train()
    for other in (resumed, fresh):  # both end as the uninterrupted run, bit for bit
        for name, value in weights(solo.model).items():
            assert torch.equal(other.model.state_dict()[name], value), name
    assert ckpt_files(killed) == ckpt_files(tmp_path / "fresh") == ckpt_files(tmp_path / "solo")


def test_rerun_twice_keeps_both_earlier_runs_apart(tmp_path: Path) -> None:
    runs = []
    for lr in (0.01, 0.02, 0.03):
        trainer(tmp_path, learning_rate=lr).train()
        runs.append({k: v for k, v in tree(tmp_path).items() if k.startswith("checkpoint-")})
    folders = previous_runs(tmp_path)
    assert len(folders) == 2  # written in the same second, the second folder's name gets "-2"
    assert sorted(tree(folder).items() for folder in folders) == sorted(run.items() for run in runs[:2])
    assert tree(tmp_path / "checkpoint-12") == {k.split("/", 1)[1]: v for k, v in runs[2].items()
                                                if k.startswith("checkpoint-12/")}  # fmt: skip
    assert len({run["checkpoint-12/model.safetensors"] for run in runs}) == 3  # three different runs


def test_resume_after_a_fresh_rerun_takes_the_reruns_checkpoint_not_the_earlier_runs(tmp_path: Path) -> None:
    trainer(tmp_path, max_steps=16).train()  # the earlier run: checkpoint-4 .. checkpoint-16
    interrupted = trainer(tmp_path, learning_rate=0.02)
    interrupted.add_callback(StopAt(10))
    with pytest.raises(KeyboardInterrupt), pytest.warns(UserWarning, match="earlier run"):
        interrupted.train()  # the rerun: checkpoint-4 and checkpoint-8, then a crash
    assert checkpoint_names(tmp_path) == ["checkpoint-4", "checkpoint-8"]
    resumed = trainer(tmp_path, learning_rate=0.02)
    resumed.train(resume_from_checkpoint=True)  # transformers would take the earlier run's checkpoint-16
    assert resumed.state.global_step == 12
    clean = trainer(tmp_path / "clean", learning_rate=0.02)
    clean.train()
    for name, value in weights(clean.model).items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    assert resumed.state.log_history[:-1] == clean.state.log_history[:-1]  # the last record has timings


def test_resume_with_only_earlier_runs_names_them_and_an_explicit_path_starts_a_new_run(tmp_path: Path) -> None:
    trainer(tmp_path / "solo").train()
    out = tmp_path / "out"
    trainer(out).train()
    interrupted = trainer(out)
    interrupted.add_callback(StopAt(2))
    with pytest.raises(KeyboardInterrupt), pytest.warns(UserWarning, match="earlier run"):
        interrupted.train()  # a fresh rerun that saved nothing
    (aside,) = previous_runs(out)
    with pytest.raises(ConfigError, match=rf"previous-runs \({aside.name}\): they belong to another run"):
        trainer(out).train(resume_from_checkpoint=True)
    assert checkpoint_names(aside) == ["checkpoint-4", "checkpoint-8", "checkpoint-12"]
    branch = trainer(out)
    branch.train(resume_from_checkpoint=str(aside / "checkpoint-8"))  # asked for by its path: resumed
    assert branch.state.global_step == 12 and checkpoint_names(out) == ["checkpoint-12"]
    solo = {k: v for k, v in ckpt_files(tmp_path / "solo").items() if k.startswith("checkpoint-12/")}
    assert ckpt_files(out) == solo
    trainer(out, max_steps=16).train(resume_from_checkpoint=str(out / "checkpoint-12"))  # in output_dir: this run
    assert len(previous_runs(out)) == 1 and checkpoint_names(out) == ["checkpoint-12", "checkpoint-16"]
    other = trainer(tmp_path / "elsewhere", max_steps=4)
    other.train()
    with pytest.warns(UserWarning, match=r"\(checkpoint-12, checkpoint-16\): this fresh run moved them"):
        trainer(out, max_steps=8).train(resume_from_checkpoint=str(tmp_path / "elsewhere" / "checkpoint-4"))
    assert len(previous_runs(out)) == 2 and checkpoint_names(out) == ["checkpoint-8"]


def _dying_replace(monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """directory's os.replace raises SystemExit after ``after`` renames, as a kill between two renames would
    stop it (no handler of ours runs for a kill, and none catches SystemExit on the way)."""
    real_replace, done = os.replace, []

    def replace(src: Any, dst: Any) -> None:
        if len(done) == after:
            raise SystemExit("killed")
        done.append(src)
        real_replace(src, dst)

    monkeypatch.setattr(directory.os, "replace", replace)


def test_a_run_killed_while_moving_the_earlier_run_aside_is_finished_by_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trainer(tmp_path).train()
    before = {k: v for k, v in tree(tmp_path).items() if k.startswith("checkpoint-")}
    with monkeypatch.context() as patch:
        _dying_replace(patch, after=1)
        with pytest.raises(SystemExit):
            trainer(tmp_path).train()
    (aside,) = previous_runs(tmp_path)
    assert checkpoint_names(tmp_path) == ["checkpoint-8", "checkpoint-12"] and (aside / directory.JOURNAL).exists()
    # a resume finishes the move first: the earlier run is not this run, so there is nothing to resume
    with pytest.raises(ConfigError, match=r"no complete checkpoint.*Earlier runs' checkpoints"):
        trainer(tmp_path).train(resume_from_checkpoint=True)
    assert not (aside / directory.JOURNAL).exists() and checkpoint_names(tmp_path) == []
    assert {k.split("/", 2)[2]: v for k, v in tree(tmp_path).items() if k.startswith(PREVIOUS_RUNS)} == before
    trainer(tmp_path).train()
    assert previous_runs(tmp_path) == [aside]  # nothing more to set aside


def test_finishing_a_move_leaves_a_checkpoint_written_since(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (1, 2, 3):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "old").write_text(str(step))
    with monkeypatch.context() as patch:
        _dying_replace(patch, after=1)
        with pytest.raises(SystemExit):
            directory.set_aside(tmp_path)
    shutil.rmtree(tmp_path / "checkpoint-3")
    (tmp_path / "checkpoint-3").mkdir()  # written after the kill (another inode): not the earlier run's
    (tmp_path / "checkpoint-3" / "new").write_text("3")
    (aside,) = previous_runs(tmp_path)
    assert directory.finish_set_aside(tmp_path) == [aside]
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint-1", "checkpoint-2"]
    assert checkpoint_names(tmp_path) == ["checkpoint-3"] and (tmp_path / "checkpoint-3" / "new").exists()
    assert directory.finish_set_aside(tmp_path) == []
