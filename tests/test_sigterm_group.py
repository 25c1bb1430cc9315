"""SIGTERM to the whole process group, as SLURM sends it, with DataLoader workers (#29 item 2).

The workers get the signal too. They must not die first: the run stops at the next step boundary with a
stop checkpoint, exits with status 143, and the checkpoint resumes bit for bit. A stop checkpoint is always
resumable, also under ``save_only_model=True`` (which writes model-only checkpoints otherwise).

The subprocess runs this file as a script (``python tests/test_sigterm_group.py OUT [model_only]``): a bare
Engine with Checkpointing and Preemption over a DataLoader of 2 forked workers, writing its step to
``OUT/progress``; it leads its own process group, which the test signals with ``os.killpg``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainbus.engine import Engine, Event
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, list_checkpoints, resume
from trainbus.plugins.control.preemption import ENGINE_RESUME, Preemption, TrainingInterrupted

ROOT = Path(__file__).resolve().parent.parent
STEPS = 40


def make_engine(out: Path, workers: int, *, model_only: bool = False, slow: float = 0.0) -> Engine:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 2, generator=torch.Generator().manual_seed(1)),
                         torch.randn(64, 1, generator=torch.Generator().manual_seed(2)))  # fmt: skip
    loader = DataLoader(data, batch_size=4, num_workers=workers)
    model = torch.nn.Linear(2, 1)
    plugins = [Checkpointing(out, save_only_model=model_only, save_strategy="steps", save_steps=100), Preemption()]
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.05), max_steps=STEPS, train_data=loader,
                    loss_fn=torch.nn.MSELoss(), plugins=plugins)  # fmt: skip
    if slow:

        def pace(ev: Any) -> None:
            (out / "progress").write_text(str(ev.engine.state.global_step))
            time.sleep(slow)

        engine.on(Event.STEP_END, pace)
    return engine


def run_and_signal_the_group(out: Path, *extra: str) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen([sys.executable, __file__, str(out), *extra], cwd=ROOT, env=env, text=True,
                           stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not (out / "progress").exists() or int((out / "progress").read_text() or 0) < 3:
            assert run.poll() is None and time.monotonic() < deadline, "the run did not start stepping"
            time.sleep(0.05)
        os.killpg(run.pid, signal.SIGTERM)  # the main process and its DataLoader workers
        _, err = run.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
    return run.returncode, err


def test_sigterm_to_the_process_group_stops_at_a_step_with_a_checkpoint_that_resumes_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    code, err = run_and_signal_the_group(out)
    assert code == 143, err
    assert "exited unexpectedly" not in err and "killed by signal" not in err, err
    (saved,) = list_checkpoints(out)
    stopped = saved[0]
    assert 3 <= stopped < STEPS and f"training stopped by SIGTERM at step {stopped}" in err
    assert "resume(engine, True)" in err  # the Engine's words: this is a bare Engine
    clean = make_engine(tmp_path / "clean", workers=0)
    clean.fit()
    resumed = make_engine(out, workers=0)
    resume(resumed, True)
    resumed.fit()
    assert resumed.state.global_step == STEPS
    for name, value in clean.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


def test_a_stop_checkpoint_under_save_only_model_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    code, err = run_and_signal_the_group(out, "model_only")
    assert code == 143, err
    (saved,) = list_checkpoints(out)
    assert "resume" in err
    resumed = make_engine(out, workers=0, model_only=True)
    assert resume(resumed, True) == saved[1]  # a full checkpoint: optimizer, RNG, plugins' states
    resumed.fit()
    assert resumed.state.global_step == STEPS


class Reporting(TensorDataset):
    """Writes, from the worker that loads an item, whether SIGTERM and SIGINT are ignored there during training."""

    def __init__(self, folder: Path) -> None:
        super().__init__(torch.zeros(4, 2), torch.zeros(4, 1))
        self.folder = folder

    def __getitem__(self, index: int) -> Any:
        # while training a worker's stop handler ignores the signal (and ends the worker once training is over)
        ignored = [getattr(signal.getsignal(s), "__name__", "") == "stop_unless_training"
                   for s in (signal.SIGTERM, signal.SIGINT)]  # fmt: skip
        (self.folder / f"{os.getpid()}-{index}").write_text(repr(ignored))
        return super().__getitem__(index)


def test_dataloader_workers_ignore_stop_signals_only_while_preemption_runs(tmp_path: Path) -> None:
    (tmp_path / "before").mkdir(), (tmp_path / "during").mkdir(), (tmp_path / "after").mkdir()
    list(DataLoader(Reporting(tmp_path / "before"), batch_size=2, num_workers=1))
    model = torch.nn.Linear(2, 1)
    loader = DataLoader(Reporting(tmp_path / "during"), batch_size=2, num_workers=2)
    Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), max_steps=2, train_data=loader,
           loss_fn=torch.nn.MSELoss(), plugins=[Preemption()]).fit()  # fmt: skip
    list(DataLoader(Reporting(tmp_path / "after"), batch_size=2, num_workers=1))
    reports = {when: {p.read_text() for p in (tmp_path / when).iterdir()} for when in ("before", "during", "after")}
    assert reports == {"before": {"[False, False]"}, "during": {"[True, True]"}, "after": {"[False, False]"}}
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the main process's own handlers are back


def make_trainer(out: Path, workers: int, slow: float = 0.0) -> Any:
    from tests.facade_helpers import Regressor, quiet_args, regression_data
    from trainbus.plugins import Trainer

    torch.manual_seed(0)
    args = quiet_args(out, max_steps=STEPS, save_strategy="steps", save_steps=100, save_only_model=True, seed=3,
                      per_device_train_batch_size=2, learning_rate=0.05, dataloader_num_workers=workers)  # fmt: skip
    trainer = Trainer(model=Regressor(), args=args, train_dataset=regression_data(32, seed=2))
    if slow:

        def pace(ev: Any) -> None:
            (out / "progress").write_text(str(ev.engine.state.global_step))
            time.sleep(slow)

        trainer.on(Event.STEP_END, pace)
    return trainer


def test_a_trainer_with_workers_and_save_only_model_stops_on_a_group_sigterm_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    code, err = run_and_signal_the_group(out, "trainer")
    assert code == 143, err
    assert "exited unexpectedly" not in err and "killed by signal" not in err, err
    assert "resume with trainer.train(resume_from_checkpoint=True)" in err  # the Trainer's words
    clean = make_trainer(tmp_path / "clean", workers=0)
    clean.train()
    resumed = make_trainer(out, workers=0)
    resumed.train(resume_from_checkpoint=True)  # the stop checkpoint is whole, though save_only_model=True
    for name, value in clean.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name


def test_the_exit_message_never_promises_a_resume_from_a_model_only_checkpoint() -> None:
    whole = TrainingInterrupted(signal.SIGTERM, 3, "out/checkpoint-3")
    assert str(whole).endswith("checkpoint saved: out/checkpoint-3; resume with " + ENGINE_RESUME)
    trainer = TrainingInterrupted(signal.SIGTERM, 3, "out/checkpoint-3", "trainer.train(resume_from_checkpoint=True)")
    assert str(trainer).endswith("resume with trainer.train(resume_from_checkpoint=True)")
    model_only = TrainingInterrupted(signal.SIGTERM, 3, "out/checkpoint-3", resumable=False)
    assert "resume with" not in str(model_only) and "it cannot be resumed from" in str(model_only)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    if "trainer" in sys.argv[2:]:
        make_trainer(target, workers=2, slow=0.05).train()
    else:
        make_engine(target, workers=2, model_only="model_only" in sys.argv[2:], slow=0.05).fit()
