"""The Trainer's readers of a checkpoint under ``save_async``: what transformers calls right after a save finds
``checkpoint-N`` on disk (a callback's ``on_save``, a direct ``_save_checkpoint``), while a run whose callbacks
do not read it keeps writing in the background."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.facade_helpers import Regressor, quiet_args, regression_data
from trainbus.plugins import Trainer, TrainerCallback
from trainbus.plugins.checkpoints import writing
from trainbus.plugins.checkpoints.directory import list_checkpoints


class SlowWrites:
    """Holds every background write until released, and records the thread that wrote."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.threads: list[str] = []
        real = writing.PendingCheckpoint.write

        def write(pending: Any) -> Path:
            self.threads.append(threading.current_thread().name)
            if threading.current_thread() is not threading.main_thread():
                self.release.wait(timeout=30)
            return real(pending)

        monkeypatch.setattr(writing.PendingCheckpoint, "write", write)


class ReadsOnSave(TrainerCallback):
    def __init__(self, slow: SlowWrites) -> None:
        self.slow = slow
        self.found: list[tuple[int, list[int]]] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == 2:  # before this step's save
            threading.Timer(0.3, self.slow.release.set).start()

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.found.append((state.global_step, [step for step, _ in list_checkpoints(args.output_dir)]))


def _trainer(tmp_path: Path, **more: Any) -> Trainer:
    args = quiet_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=2, save_async=True)
    return Trainer(Regressor(), args, train_dataset=regression_data(16), **more)


def test_a_callbacks_on_save_finds_the_checkpoint_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = SlowWrites(monkeypatch)
    reader = ReadsOnSave(slow)  # its on_step_end lets the writes go 0.3 s later: on_save must wait for them
    _trainer(tmp_path, callbacks=[reader]).train()
    assert reader.found == [(2, [2]), (4, [2, 4])]
    assert slow.threads == ["trainbus-checkpoint-writer"] * 2


def test_without_a_reader_the_next_steps_run_while_the_write_is_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = SlowWrites(monkeypatch)
    seen: list[tuple[int, list[int]]] = []

    class Steps(TrainerCallback):  # no on_save: nothing waits at the save
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.append((state.global_step, [step for step, _ in list_checkpoints(args.output_dir)]))
            if state.global_step == 3:
                slow.release.set()

    trainer = _trainer(tmp_path, callbacks=[Steps()])
    trainer.train()
    assert seen[2] == (3, [])  # step 3 ran with checkpoint-2 still being written
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2, 4]  # train() returned with both on disk


def test_a_direct_save_checkpoint_returns_with_it_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = _trainer(tmp_path)
    trainer.train()
    slow = SlowWrites(monkeypatch)
    timer = threading.Timer(0.2, slow.release.set)
    timer.start()
    trainer.state.global_step = 9
    trainer._save_checkpoint(trainer.model, None)
    timer.join()
    assert 9 in [step for step, _ in list_checkpoints(tmp_path)]
