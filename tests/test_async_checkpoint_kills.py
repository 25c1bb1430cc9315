"""Kill tests of asynchronous checkpoints (#36 item 3): the ways a user gets hurt while a background write runs.

SIGKILL in each phase of a write, at random moments, twice, of an Engine and a Trainer (every checkpoint-N left
complete and equal to an uninterrupted run's, none published lost, the resume from True takes the newest and ends
bit-exact, leftovers tidied; child processes: tests/async_kill_jobs.py, many trials: benchmarks/async_kill_trials.py);
SIGTERM during a write (the stop checkpoint waits for it); a full disk at each phase of a write (the error at the
next step or the end, nothing lost or left, the best not the failed one); saves back to back (one write in flight,
the wait logged, the bytes of synchronous saves); a save as training ends (on disk at fit's return, best loaded).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import async_kill_jobs as jobs
from tests.facade_helpers import Regressor, quiet_args, regression_data
from trainbus.engine import Engine, Event, Priority
from trainbus.plugins import Trainer
from trainbus.plugins.checkpoints import io as cio
from trainbus.plugins.checkpoints import verified, writing
from trainbus.plugins.checkpoints.checkpoint import (
    Checkpointing,
    CheckpointWriteError,
    LoadBestModelAtEnd,
    list_checkpoints,
    resume,
)
from trainbus.plugins.checkpoints.directory import LEFTOVER, checkpoint_dirs
from trainbus.plugins.checkpoints.lock import holds_lock

PHASES = list(jobs.PHASES)
#: the checkpoint a resume takes after a kill in each phase of the write of checkpoint T: T or the one before
RESUMED = {phase: 0 if i >= 3 else -jobs.SAVE_STEPS for i, phase in enumerate(PHASES)}


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The uninterrupted synchronous run of each kind (made once, when a test first needs it)."""
    root = tmp_path_factory.mktemp("reference")
    return functools.cache(lambda kind: jobs.reference(kind, root / kind))


def writes(events: list[tuple[float, str]]) -> list[tuple[int, float, float]]:
    """(step, start, end) of each write the events show, in order; fails if two were ever in flight at once."""
    spans, open_ = [], None
    for t, what in events:
        word, _, rest = what.partition(" ")
        if word == "start":
            assert open_ is None, f"a write started while {open_} was in flight"
            open_ = (int(rest), t)
        elif word in ("end", "fail") and open_ is not None:
            spans.append((open_[0], open_[1], t))
            open_ = None
    return spans


# -- SIGKILL and SIGTERM during background writes (child processes) ---------------------------------------
@pytest.mark.parametrize("phase", PHASES)
def test_sigkill_in_each_phase_of_a_background_write_loses_nothing_and_resumes_bit_exact(
    tmp_path: Path, refs: Any, phase: str
) -> None:
    record = jobs.kill_trial("engine", tmp_path, refs("engine"), PHASES.index(phase), phase=phase)
    assert record["exit"] == -signal.SIGKILL, record["output"]
    jobs.check_trial(record)
    assert record["resumed_from"] == str(tmp_path / "run" / f"checkpoint-{record['target'] + RESUMED[phase]}")
    writes(record["events"])
    if phase.startswith("rotation deleting"):  # a complete checkpoint renamed .del: removed, never put back
        assert any(".del-" in name for name in record["left"]["leftovers"]), record["left"]


@pytest.mark.parametrize("seed", [101])
def test_sigkill_at_a_random_moment_of_a_background_write(tmp_path: Path, refs: Any, seed: int) -> None:
    record = jobs.kill_trial("engine", tmp_path, refs("engine"), seed)
    assert record["exit"] == -signal.SIGKILL, record["output"]
    jobs.check_trial(record)
    writes(record["events"])


def test_sigkill_of_a_trainer_during_a_background_write(tmp_path: Path, refs: Any) -> None:
    """The facade: killed with its manifest written, not synced; Trainer.train(resume_from_checkpoint=True)."""
    record = jobs.kill_trial("trainer", tmp_path, refs("trainer"), 5, phase="manifest written, not synced")
    assert record["exit"] == -signal.SIGKILL, record["output"]
    jobs.check_trial(record)
    assert record["resumed_from"] == str(tmp_path / "run" / f"checkpoint-{record['target']}")


def stop_saves(record: dict[str, Any]) -> tuple[int, list[tuple[int, float, float]]]:
    """The stop checkpoint's step and the writes of the run; checks what every SIGTERM trial promises: exit 143,
    the write in flight (T) ended after the signal and before the stop save started, both complete and kept."""
    assert record["exit"] == 143, record["output"]
    assert "training stopped by SIGTERM at step" in record["output"], record["output"]
    target, spans = record["target"], writes(record["events"])
    stop = spans[-1][0]
    ended_t = next(end for step, _, end in spans if step == target)
    assert ended_t > record["signalled"], spans  # the signal came during T's write
    assert stop > target and all(start >= ended_t for step, start, _ in spans if step == stop)  # after T
    assert record["left"] == {"steps": [target, stop], "leftovers": []}, record["left"]
    jobs.check_trial(record)
    assert record["resumed_from"] == str(Path(record["output_dir"]) / f"checkpoint-{stop}")
    return stop, spans


def test_a_run_killed_again_during_its_resume_still_ends_bit_exact(tmp_path: Path, refs: Any) -> None:
    """Killed between tensor files of checkpoint-9, resumed from 6, killed again with checkpoint-15's manifest
    written (its .tmp is put back), resumed from 15: the first run's leftovers were tidied by the second."""
    ref, out = refs("engine"), tmp_path / "run"
    for n, (step, phase) in enumerate([(9, "between tensor files"), (15, "manifest written, not synced")]):
        events = tmp_path / f"events-{n}"
        process = jobs.launch(kind="engine", out=out, events=events, result=tmp_path / "r.json", slow=jobs.SLOW,
                              pace=jobs.PACE, hold=[step, jobs.PHASES[phase], 3600], resume=n > 0)  # fmt: skip
        jobs.wait_for(events, "holding ", process)
        os.kill(process.pid, signal.SIGKILL)
        process.join(jobs.TIMEOUT)
        assert process.exitcode == -signal.SIGKILL, jobs.output(events)
        left = jobs.inspect_after_kill(out, ref)
        assert left["leftovers"] == [f"checkpoint-{step}.tmp-{process.pid}"], left  # only this run's
    assert left["steps"] == [9, 12, 15]
    result = jobs.run_to_end(kind="engine", out=out, events=tmp_path / "end", result=tmp_path / "r.json", resume=True)
    assert result["resumed_from"] == str(out / "checkpoint-15") and result["digest"] == ref.digest
    assert jobs.inspect_after_kill(out, ref) == {"steps": [21, 24], "leftovers": []}


@pytest.mark.parametrize("kind", ["engine", "trainer"])
def test_sigterm_during_a_background_write_keeps_it_and_saves_a_complete_stop_checkpoint(
    tmp_path: Path, refs: Any, kind: str
) -> None:
    """Preemption: the signal comes in step T+1 (paused 1 s) while the writer is held 1.5 s at the start of
    checkpoint T's write; the stop save waits for T, is written synchronously, once, and the run exits 143; the
    resume takes it, bit-exact. (Holds, not timing: a loaded machine changes nothing.)"""
    record = jobs.kill_trial(kind, tmp_path, refs(kind), 3, signal.SIGTERM, phase="before any file", hold=1.5,
                             training="stepping")  # fmt: skip
    stop, spans = stop_saves(record)
    assert stop == record["target"] + 1 and [step for step, _, _ in spans].count(stop) == 1, spans
    assert any(w == "waiting" and t > record["signalled"] for t, w in record["events"])  # the stop save waited for T


@pytest.fixture(scope="module")
def sigterm_while_waiting(refs: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """SIGTERM while the training thread waits, at its next save T+3, for checkpoint T's write (held 1 s). The
    kernel may deliver it to the writer thread: the handler then runs once the wait has ended, before or after
    that save chose to write in the background (both orders must keep every promise)."""
    work = tmp_path_factory.mktemp("sigterm-waiting")
    return jobs.kill_trial("engine", work, refs("engine"), 4, signal.SIGTERM, phase="before any file", hold=1.0,
                           training="waiting")  # fmt: skip


def test_sigterm_while_a_save_waits_for_the_write_in_flight_stops_with_that_save(
    sigterm_while_waiting: dict[str, Any],
) -> None:
    stop, _ = stop_saves(sigterm_while_waiting)
    assert stop == sigterm_while_waiting["target"] + jobs.SAVE_STEPS


def test_sigterm_while_a_save_waits_writes_the_stop_checkpoint_once(sigterm_while_waiting: dict[str, Any]) -> None:
    """The signal, during the save, asks again for a save at the same step (the loop's last pass of the epoch):
    Checkpointing waits for the whole checkpoint of this step instead of writing it twice."""
    stop, spans = stop_saves(sigterm_while_waiting)
    assert [step for step, _, _ in spans].count(stop) == 1, spans


def test_a_file_size_limit_in_a_background_write_ends_the_run_with_the_error(tmp_path: Path, refs: Any) -> None:
    """A real write error (RLIMIT_FSIZE: EFBIG, as a full disk) from the save at step 12, in a run that catches
    nothing: it ends with CheckpointWriteError naming checkpoint-12, before its next save; 6 and 9 are intact."""
    ref, out, events = refs("engine"), tmp_path / "run", tmp_path / "events"
    process = jobs.launch(kind="engine", out=out, events=events, result=tmp_path / "r.json", fsize=[12, 1 << 20])
    process.join(jobs.TIMEOUT)
    log, seen = jobs.output(events), [what for _, what in jobs.read_events(events)]
    assert process.exitcode == 1, log
    assert "CheckpointWriteError" in log and "checkpoint-12" in log and "File too large" in log, log
    assert any(w.startswith("fail 12") for w in seen), seen  # the write failed (in the writer thread)
    assert "start 15" not in seen and not (tmp_path / "r.json").exists()
    assert jobs.inspect_after_kill(out, ref) == {"steps": [6, 9], "leftovers": []}
    result = jobs.run_to_end(kind="engine", out=out, events=tmp_path / "again", result=tmp_path / "r.json", resume=True)
    assert result["resumed_from"] == str(out / "checkpoint-9") and result["digest"] == ref.digest


# -- in this process: a full disk, saves back to back, the end of training --------------------------------
def small_engine(out: Path, *plugins: Any, max_steps: int = 8, **checkpointing: Any) -> Engine:
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(3)]
    options = {"save_strategy": "steps", "save_steps": 2, "save_async": True, **checkpointing}
    return Engine(model, torch.optim.AdamW(model.parameters(), lr=0.01), train_data=data, eval_data=data[:1],
                  max_steps=max_steps, loss_fn=torch.nn.MSELoss(),
                  plugins=[Checkpointing(out, **options), *plugins])  # fmt: skip


#: where a write can meet a full disk: the module attribute the writer calls there
FAULTS = {"tensor file": (cio, "write_tensors"), "manifest": (cio, "write_manifest"), "fsync": (cio, "sync_files"),
          "rename": (writing, "publish_directory")}  # fmt: skip


def slow_writes(monkeypatch: pytest.MonkeyPatch, seconds: float, full_disk_at: str = "", where: str = "") -> None:
    """Each tensor file written ``seconds`` late; the write of checkpoint ``full_disk_at`` fails with ENOSPC at
    ``where`` (a tensor file is left half written first), as on a full disk."""

    def patched(place: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            time.sleep(seconds if place == "tensor file" else 0)
            if place == where and f"{full_disk_at}.tmp-" in str(args[0]):
                if place == "tensor file":
                    args[0].write_bytes(b"\0" * 64)
                raise OSError(errno.ENOSPC, "No space left on device", str(args[0]))
            return original(*args, **kwargs)

        return call

    for place in {"tensor file", where} - {""}:
        module, name = FAULTS[place]
        monkeypatch.setattr(module, name, patched(place, getattr(module, name)))


def every_save_is_the_best(ev: Any) -> None:
    """A stand-in for BestMetric finding a new best at each save (step 2, 4, ...)."""
    state = ev.engine.state
    if state.global_step % 2 == 0:
        state.best_global_step, state.best_metric = state.global_step, -float(state.global_step)


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if LEFTOVER.match(p.name))


@pytest.mark.parametrize("where", list(FAULTS))
def test_a_full_disk_in_a_background_write_raises_at_the_next_step_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    out = tmp_path / "run"
    whole = small_engine(tmp_path / "whole")
    whole.fit()
    slow_writes(monkeypatch, 0.0, "checkpoint-4", where)
    engine = small_engine(out, save_total_limit=2)
    engine.on(Event.STEP_END, every_save_is_the_best, priority=Priority.PRODUCER)
    writer = engine.get_plugin(Checkpointing).writer  # type: ignore[union-attr]
    # step 5 starts once the failed write has ended: its error must come at step 5's end, not later
    engine.on(Event.STEP_START, lambda ev: writer.wait() if ev.engine.state.global_step == 4 else None)
    with pytest.raises(CheckpointWriteError, match=r"checkpoint-4 failed.*No space left") as raised:
        engine.fit()
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == errno.ENOSPC
    assert engine.state.global_step == 5  # the next step
    assert engine.state.best_model_checkpoint == str(out / "checkpoint-2")  # not the failed one
    assert [step for step, _ in checkpoint_dirs(out)] == [2] and leftovers(out) == []
    verified.read_manifest(out / "checkpoint-2", verify=True)
    monkeypatch.undo()
    again = small_engine(out, save_total_limit=2)
    assert resume(again, True) == out / "checkpoint-2"
    again.fit()
    assert jobs.digest(again.model, again.optimizer) == jobs.digest(whole.model, whole.optimizer)


def test_a_full_disk_at_the_last_save_ends_fit_with_the_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing catches it: fit() ends with the error (the end of training waits for the write); 4 and 6 intact."""
    slow_writes(monkeypatch, 0.02, "checkpoint-8", "tensor file")
    engine = small_engine(tmp_path, save_total_limit=2)
    engine.on(Event.STEP_END, every_save_is_the_best, priority=Priority.PRODUCER)
    with pytest.raises(CheckpointWriteError, match="checkpoint-8"):
        engine.fit()
    assert engine.state.best_model_checkpoint == str(tmp_path / "checkpoint-6")
    assert [step for step, _ in list_checkpoints(tmp_path)] == [4, 6] and leftovers(tmp_path) == []
    assert not holds_lock(tmp_path)  # the lock was released after the write ended
    monkeypatch.undo()
    assert resume(small_engine(tmp_path, save_total_limit=2), True) == tmp_path / "checkpoint-6"


def test_a_full_disk_in_a_trainers_background_write_ends_train_with_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_writes(monkeypatch, 0.0, "checkpoint-4", "fsync")
    args = quiet_args(tmp_path, max_steps=8, save_strategy="steps", save_steps=2, save_async=True, learning_rate=0.05)
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(32))
    with pytest.raises(CheckpointWriteError, match="checkpoint-4"):
        trainer.train()
    # at step 5's end, or at the latest when the save at step 6 waits for the failed write: before its take
    assert trainer.state.global_step <= 6
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2] and leftovers(tmp_path) == []


def logged_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, str]]:
    """``start N`` / ``end N`` events around every ``PendingCheckpoint.write``, from whichever thread runs it."""
    events: list[tuple[float, str]] = []
    original = writing.PendingCheckpoint.write

    def write(pending: Any) -> Path:
        events.append((time.monotonic(), f"start {(step := pending.final.name.split('-')[-1])}"))
        try:
            return original(pending)
        finally:
            events.append((time.monotonic(), f"end {step}"))

    monkeypatch.setattr(writing.PendingCheckpoint, "write", write)
    return events


def test_saves_back_to_back_wait_one_write_at_a_time_and_write_what_a_synchronous_save_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    synchronous = small_engine(tmp_path / "sync", max_steps=6, save_steps=1, save_async=False)
    synchronous.fit()
    slow_writes(monkeypatch, 0.03)  # 4 tensor files: a write takes > 0.12 s, a step ~1 ms
    events = logged_writes(monkeypatch)
    engine = small_engine(tmp_path / "async", max_steps=6, save_steps=1)
    with caplog.at_level(logging.INFO, logger="trainbus.checkpoint"):
        engine.fit()
    assert [step for step, _, _ in writes(events)] == [1, 2, 3, 4, 5, 6]  # one at a time: none starts in another
    waits = [r for r in caplog.records if "for the background checkpoint write" in r.getMessage()]
    assert [r.getMessage().split(" waited")[0] for r in waits[:5]] == [f"the save at step {s}" for s in range(2, 7)]
    assert waits[0].levelno == logging.WARNING  # the first as a warning, the others as info (not one per step)
    for step, path in list_checkpoints(tmp_path / "async"):
        verified.read_manifest(path, verify=True)
        theirs = tmp_path / "sync" / path.name  # the host buffers were never reused under a write in flight
        for file in sorted(path.glob("*.safetensors")):
            assert file.read_bytes() == (theirs / file.name).read_bytes(), (step, file.name)
    assert jobs.digest(engine.model, engine.optimizer) == jobs.digest(synchronous.model, synchronous.optimizer)


def zero_and_note(model: torch.nn.Module, best: str | None, complete: list[bool]) -> None:
    """Before the best is loaded: note whether it is complete, zero the weights (after the run they are the
    checkpoint's only if it was loaded)."""
    complete.append(verified.is_complete(Path(best or "")))
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()


class ZeroThenLoadBest(LoadBestModelAtEnd):
    complete: list[bool]

    def load_best(self, engine: Engine) -> Any:
        zero_and_note(engine.model, engine.state.best_model_checkpoint, self.complete)
        return super().load_best(engine)


@pytest.mark.filterwarnings("ignore:ZeroThenLoadBest:UserWarning")  # no BestMetric: every_save_is_the_best
def test_a_save_at_the_last_step_is_on_disk_when_fit_returns_and_the_best_model_is_loaded_from_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    slow_writes(monkeypatch, 0.05)
    loader = ZeroThenLoadBest()
    loader.complete = []
    engine = small_engine(tmp_path, loader, max_steps=4)
    engine.on(Event.STEP_END, every_save_is_the_best, priority=Priority.PRODUCER)  # the last (4) is the best
    last: dict[str, torch.Tensor] = {}
    engine.on(Event.SAVE, lambda ev: last.update({k: v.clone() for k, v in ev.engine.model.state_dict().items()}))
    with caplog.at_level(logging.INFO, logger="trainbus.checkpoint"):
        engine.fit()
    assert "the end of training waited" in caplog.text  # the last write was in flight when training ended
    assert not engine.get_plugin(Checkpointing).writer.busy  # type: ignore[union-attr]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2, 4] and leftovers(tmp_path) == []
    verified.read_manifest(tmp_path / "checkpoint-4", verify=True)
    assert engine.state.best_model_checkpoint == str(tmp_path / "checkpoint-4") and loader.complete == [True]
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, last[name]), name  # loaded from checkpoint-4 after the zeroing
    assert f"loaded the best model from {tmp_path / 'checkpoint-4'}" in caplog.text


class ZeroThenLoadBestTrainer(Trainer):
    complete: list[bool]

    def _load_best_model(self) -> None:
        zero_and_note(self.model, self.state.best_model_checkpoint, self.complete)
        super()._load_best_model()


def test_a_trainer_loads_the_best_model_from_its_last_checkpoint_written_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_writes(monkeypatch, 0.1)
    args = quiet_args(tmp_path, max_steps=8, save_strategy="steps", save_steps=2, eval_strategy="steps",
                      eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss", save_async=True,
                      learning_rate=0.05)  # fmt: skip
    data, held_out = regression_data(32), regression_data(8, seed=5)
    trainer = ZeroThenLoadBestTrainer(Regressor(), args, train_dataset=data, eval_dataset=held_out)
    trainer.complete = []
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-8")  # the best is the last
    assert trainer.complete == [True]
    saved = cio.read_tensors(tmp_path / "checkpoint-8" / "model.safetensors", owned=True)
    assert saved and all(torch.equal(trainer.model.state_dict()[k], v) for k, v in saved.items())
    assert any(v.abs().sum() > 0 for v in saved.values())
