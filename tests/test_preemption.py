"""Preemption (#23 item 6): SIGTERM / a first Ctrl-C stop at the next step boundary with a checkpoint, the run
ends with TrainingInterrupted (exit status 143 / 130) and a message, a second Ctrl-C stops at once, and the
resume is bit-exact. Handlers exist only during train(), in the main thread.

The subprocess tests run this file as a script (``python tests/test_preemption.py MODE OUT``): a Trainer
whose steps take 0.1 s, writing its step to ``OUT/progress`` so the parent can signal it mid-run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainbus.engine import ConfigError, Event
from trainbus.plugins.control.preemption import Preemption, TrainingInterrupted

HERE = Path(__file__).resolve()
STEPS = 12


def make_trainer(out: Path, slow: float = 0.0) -> Any:
    from facade_helpers import Regressor, quiet_args, regression_data

    from trainbus.plugins import Trainer

    torch.manual_seed(0)
    args = quiet_args(out, max_steps=STEPS, logging_steps=4, save_strategy="steps", save_steps=100,
                      per_device_train_batch_size=2, learning_rate=0.05, optim="adamw_torch", seed=3)  # fmt: skip
    trainer = Trainer(model=Regressor(), args=args, train_dataset=regression_data(16, seed=2))
    if slow:

        def pace(ev: Any) -> None:
            (out / "progress").write_text(str(ev.engine.state.global_step))
            time.sleep(slow)

        trainer.on(Event.STEP_END, pace)
    return trainer


def snapshot(trainer: Any) -> dict[str, Any]:
    timed = ("runtime", "per_second")
    return {
        "params": {n: p.detach().reshape(-1).tolist() for n, p in trainer.model.named_parameters()},
        "log_history": [
            {k: v for k, v in e.items() if not any(t in k for t in timed)} for e in trainer.state.log_history
        ],
        "global_step": trainer.state.global_step,
    }


# -- in this process ------------------------------------------------------------------------------------
def test_handlers_exist_only_during_train_and_nothing_changes_at_import_or_construction(tmp_path: Path) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    trainer = make_trainer(tmp_path)
    assert trainer.get_plugin(Preemption) is not None  # installed by the Trainer by default
    assert {s: signal.getsignal(s) for s in before} == before
    during: list[Any] = []
    trainer.on(Event.STEP_END, lambda ev: during.append(signal.getsignal(signal.SIGTERM)))
    trainer.train()
    plugin = trainer.get_plugin(Preemption)
    assert during and all(getattr(h, "__self__", None) is plugin for h in during)
    assert {s: signal.getsignal(s) for s in before} == before


def test_handlers_come_back_when_training_fails(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    trainer = make_trainer(tmp_path)

    def fail(ev: Any) -> None:
        if ev.engine.state.global_step == 2:
            raise ConfigError("a failure at step 2")

    trainer.on(Event.STEP_END, fail)
    with pytest.raises(ConfigError, match="a failure at step 2"):
        trainer.train()
    assert signal.getsignal(signal.SIGTERM) is before


def test_training_outside_the_main_thread_installs_no_handler(tmp_path: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    trainer = make_trainer(tmp_path)
    seen: list[Any] = []
    trainer.on(Event.STEP_END, lambda ev: seen.append(signal.getsignal(signal.SIGTERM)))
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _capture(trainer.train, errors))
    thread.start()
    thread.join(60)
    assert errors == [] and seen and all(h is before for h in seen)


def _capture(fn: Any, errors: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as exc:  # the test thread reports any failure
        errors.append(exc)


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_at_the_step_boundary_saves_and_resumes_bit_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], signum: int, code: int
) -> None:
    whole = make_trainer(tmp_path / "whole")
    whole.train()
    cut = make_trainer(tmp_path / "cut")
    cut.on(Event.STEP_START, lambda ev: os.kill(os.getpid(), signum) if ev.engine.state.global_step == 4 else None)
    with pytest.raises(TrainingInterrupted) as raised:
        cut.train()
    stop = raised.value
    assert (stop.code, stop.signal, stop.step) == (code, signum, 5)  # the signal came during step 5
    assert stop.checkpoint == str(tmp_path / "cut" / "checkpoint-5") and Path(stop.checkpoint).is_dir()
    assert isinstance(stop, SystemExit) and not isinstance(stop, Exception)  # `except Exception` does not eat it
    err = capsys.readouterr().err
    name = signal.Signals(signum).name
    assert f"{name} received; training stops at the next step boundary" in err
    assert f"training stopped by {name} at step 5" in err and f"exiting with status {code}" in err
    resumed = make_trainer(tmp_path / "cut")
    resumed.train(resume_from_checkpoint=True)
    assert snapshot(resumed) == snapshot(whole)


def test_check_every_must_be_a_positive_int() -> None:
    with pytest.raises(ConfigError, match="check_every must be a positive int or None, got 0"):
        Preemption(check_every=0)


# -- a real process, signalled from outside ---------------------------------------------------------------
def launch(mode: str, out: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(HERE), mode, str(out)], cwd=HERE.parent, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def wait_for_step(out: Path, process: subprocess.Popen[str], step: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        progress = out / "progress"
        written = progress.read_text().strip() if progress.exists() else ""  # read once: it is rewritten
        if written.isdigit() and int(written) >= step:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.02)
    process.kill()
    pytest.fail("the run did not reach its step in time")


def test_sigterm_from_outside_saves_exits_143_and_the_resume_is_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    process = launch("train", out)
    wait_for_step(out, process, 3)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    assert "training stopped by SIGTERM at step" in err and "checkpoint saved:" in err, err
    checkpoints = sorted(out.glob("checkpoint-*"))
    assert len(checkpoints) == 1 and f"at step {checkpoints[0].name.split('-')[1]} " in err
    assert 3 <= int(checkpoints[0].name.split("-")[1]) < STEPS
    resume = launch("resume", out)
    assert resume.wait(timeout=120) == 0, resume.communicate()
    whole = launch("whole", tmp_path / "whole")
    assert whole.wait(timeout=120) == 0, whole.communicate()
    assert json.loads((out / "result.json").read_text()) == json.loads((tmp_path / "whole" / "result.json").read_text())


def test_a_second_ctrl_c_stops_at_once(tmp_path: Path) -> None:
    process = launch("train-slow", tmp_path)
    wait_for_step(tmp_path, process, 2)
    process.send_signal(signal.SIGINT)
    time.sleep(0.3)  # the step takes 2 s: the stop is still pending
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode in (-signal.SIGINT, 130), err  # Python ends an unhandled KeyboardInterrupt by SIGINT
    assert "SIGINT received" in err and "KeyboardInterrupt" in err, err
    assert "training stopped by" not in err and not list(tmp_path.glob("checkpoint-*"))


def _main(mode: str, out: Path) -> None:
    sys.path.insert(0, str(HERE.parent))
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    trainer = make_trainer(out, slow={"train": 0.1, "train-slow": 2.0}.get(mode, 0.0))
    if mode == "resume":
        trainer.train(resume_from_checkpoint=True)
    else:
        trainer.train()  # "train": SIGTERM ends it with TrainingInterrupted (status 143)
    (out / "result.json").write_text(json.dumps(snapshot(trainer)))


if __name__ == "__main__":
    _main(sys.argv[1], Path(sys.argv[2]))
