"""``auto_find_batch_size`` as transformers: restarts start every plugin afresh, resumes at the checkpoint's size.

The model is ``dist_jobs.py``'s float64 token model (20 training rows) behind a wrapper that raises
CUDA's out-of-memory error for training batches larger than ``limit`` rows, so the halving runs on
CPU. At per-device batch 8 an epoch has 3 steps and the 4th forward (epoch 2's first) runs out of
memory after 3 optimizer steps; batch 4 fits (5 steps per epoch).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import untimed
from dist_jobs import TokenModel, eval_set, train_set

from trainbus.engine import ConfigError, Event, Plugin
from trainbus.plugins import Trainer, TrainingArguments
from trainbus.plugins.averaging.ema import EMA
from trainbus.plugins.checkpoints.io import file_entry
from trainbus.plugins.control.early_stopping import EarlyStopping
from trainbus.plugins.distributed.batch_size import same_state


class OutOfMemoryAbove(torch.nn.Module):
    """The token model; training batches of more than ``limit`` rows run out of memory from forward ``after`` on."""

    def __init__(self, limit: int, after: int = 1) -> None:
        super().__init__()
        self.inner = TokenModel()
        self.limit, self.after, self.forwards = limit, after, 0
        self.sizes: list[int] = []  # the rows of every training batch that ran

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if self.training:
            self.forwards += 1
            if self.forwards >= self.after and input_ids.shape[0] > self.limit:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
            self.sizes.append(input_ids.shape[0])
        return self.inner(input_ids, labels)  # type: ignore[no-any-return]


class StepCounter(Plugin):
    """A user's plugin with state: optimizer steps and batches it saw, checkpointed."""

    def __init__(self) -> None:
        self.steps, self.rows = 0, 0

    def attach(self, engine: Any) -> None:
        self.on(engine, Event.OPTIMIZER_STEP, self.step)
        self.on(engine, Event.BATCH_START, self.batch)

    def step(self, ev: Any) -> None:
        self.steps += 1

    def batch(self, ev: Any) -> None:
        self.rows += int(ev.batch["input_ids"].shape[0])

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "rows": self.rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.rows = state["steps"], state["rows"]


def _trainer(
    out: Path, model: torch.nn.Module, batch: int, plugins: list[Plugin] | None = None, **more: Any
) -> Trainer:
    args = TrainingArguments(**{
        "output_dir": str(out), "per_device_train_batch_size": batch, "num_train_epochs": 2, "learning_rate": 0.05,
        "optim": "adamw_torch", "logging_steps": 1, "save_strategy": "no", "report_to": "none", "disable_tqdm": True,
        "use_cpu": True, "seed": 0, **more,
    })  # fmt: skip
    evaluating = args.eval_strategy != "no"
    return Trainer(model, args, train_dataset=train_set(), eval_dataset=eval_set() if evaluating else None,
                   callbacks=plugins)  # fmt: skip


def _params(trainer: Trainer) -> list[list[float]]:
    return [p.detach().reshape(-1).tolist() for p in trainer.model.parameters()]


def _stateful_plugins() -> list[Plugin]:
    return [EMA(decay=0.9), StepCounter(), EarlyStopping("loss", patience=100)]


# -- 1. a restart starts every plugin afresh ---------------------------------------------------------------
def test_a_restart_starts_every_plugin_afresh_so_ema_ends_as_a_fresh_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the failed attempt at batch 8 takes 3 optimizer steps and evaluates once (EMA updates 3 times,
    # the counter counts, early stopping records a best loss) before its out-of-memory error
    more = {"eval_strategy": "steps", "eval_steps": 3}
    model = OutOfMemoryAbove(limit=4, after=4)
    auto = _trainer(tmp_path / "auto", model, 8, _stateful_plugins(), auto_find_batch_size=True, **more)
    with caplog.at_level(logging.WARNING, logger="trainbus"):
        output = auto.train()
    assert "training again from the start with per-device train batch size 4" in caplog.text
    assert "do not return to their starting state" not in caplog.text
    assert model.sizes == [8, 8, 4] + [4] * 10  # epoch 1 at 8 (20 rows), then two epochs at 4
    fresh = _trainer(tmp_path / "fresh", OutOfMemoryAbove(limit=100), 4, _stateful_plugins(), **more)
    expected = fresh.train()

    ema, fresh_ema = auto.get_plugin(EMA), fresh.get_plugin(EMA)
    assert isinstance(ema, EMA) and isinstance(fresh_ema, EMA)
    assert ema.num_updates == fresh_ema.num_updates == 10
    assert sorted(ema.averages) == sorted(fresh_ema.averages)
    for name, average in ema.averages.items():  # bit for bit
        assert torch.equal(average, fresh_ema.averages[name]), name
    counter = auto.get_plugin(StepCounter)
    assert isinstance(counter, StepCounter) and (counter.steps, counter.rows) == (10, 2 * 20)
    # every plugin's state, as a checkpoint would save it, is the fresh run's
    saved, fresh_saved = auto.state_dict()["plugins"], fresh.state_dict()["plugins"]
    assert sorted(saved) == sorted(fresh_saved)
    assert [name for name in saved if not same_state(saved[name], fresh_saved[name])] == []
    assert _params(auto) == _params(fresh)
    assert untimed(auto.state.log_history) == untimed(fresh.state.log_history)
    assert output.training_loss == expected.training_loss


class Forgetful(StepCounter):
    """A plugin whose ``load_state_dict`` ignores what it is given: it cannot be restarted."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_plugin_that_cannot_return_to_its_start_is_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    forgetful = Forgetful()
    trainer = _trainer(tmp_path, OutOfMemoryAbove(limit=4, after=4), 8, [forgetful], auto_find_batch_size=True)
    with caplog.at_level(logging.WARNING, logger="trainbus"):
        trainer.train()
    assert "plugins ['Forgetful'] do not return to their starting state" in caplog.text
    assert forgetful.steps == 3 + 10  # the failed attempt's steps stayed, as the warning says


def test_same_state_compares_tensors_bit_for_bit_and_nan_as_equal() -> None:
    nan = float("nan")
    state = {"a": torch.tensor([1.0, nan]), "b": [1, (2, None)], "c": nan, "d": {"e": torch.tensor([3])}}
    assert same_state(
        state, {"a": torch.tensor([1.0, nan]), "b": [1, (2, None)], "c": nan, "d": {"e": torch.tensor([3])}}
    )
    assert not same_state(state["a"], torch.tensor([1.0, 2.0]))
    assert not same_state(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))  # dtype counts
    assert not same_state({"a": 1}, {"a": 1, "b": 2}) and not same_state([1, 2], (1, 2))
    assert not same_state(None, torch.tensor(0.0)) and not same_state(0, None)


# -- 2. a resume starts from the batch size the checkpoint trained with -------------------------------------
@pytest.fixture(scope="module")
def halved_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trainer, OutOfMemoryAbove, Path]:
    """An uninterrupted run that halved 8 -> 4 (3 epochs: 15 steps at 4), checkpointing every 6 steps."""
    out = tmp_path_factory.mktemp("halved")
    model = OutOfMemoryAbove(limit=4, after=4)
    trainer = _trainer(out, model, 8, [EMA(decay=0.9)], auto_find_batch_size=True, num_train_epochs=3,
                       save_strategy="steps", save_steps=6)  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 15 and trainer.state.train_batch_size == 4
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["train_batch_size"] == 4 and state["global_step"] == 6  # mid-epoch 2 (5 steps per epoch at 4)
    return trainer, model, out / "checkpoint-6"


@pytest.mark.parametrize("resume_with", ["path", "latest"])
def test_resuming_under_auto_find_batch_size_trains_at_the_checkpoints_batch_size(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, halved_run: tuple[Trainer, OutOfMemoryAbove, Path],
    resume_with: str,
) -> None:  # fmt: skip
    uninterrupted, _, checkpoint = halved_run
    # this model would train at 8 without running out of memory: only the checkpoint's size gives 4
    model = OutOfMemoryAbove(limit=100)
    out = tmp_path / "resumed"
    resumed = _trainer(out, model, 8, [EMA(decay=0.9)], auto_find_batch_size=True, num_train_epochs=3,
                       save_strategy="steps", save_steps=6)  # fmt: skip
    if resume_with == "latest":  # True: the newest checkpoint in output_dir, here the copied checkpoint-6
        shutil.copytree(checkpoint, out / checkpoint.name)
    with caplog.at_level(logging.WARNING, logger="trainbus"):
        output = resumed.train(resume_from_checkpoint=str(checkpoint) if resume_with == "path" else True)
    assert "out of memory" not in caplog.text
    # 9 steps left at 4 rows (the last batch of an epoch has 20 - 16 = 4 rows too)
    assert model.sizes == [4] * 9 and resumed.state.train_batch_size == 4
    assert output.global_step == 15 and resumed.state.global_step == uninterrupted.state.global_step
    assert _params(resumed) == _params(uninterrupted)  # bit for bit
    # every record but the last: its train_loss and runtime are over this session's steps (as HF's)
    assert untimed(resumed.state.log_history)[:-1] == untimed(uninterrupted.state.log_history)[:-1]
    ema, expected_ema = resumed.get_plugin(EMA), uninterrupted.get_plugin(EMA)
    assert isinstance(ema, EMA) and isinstance(expected_ema, EMA)
    assert all(torch.equal(ema.averages[n], t) for n, t in expected_ema.averages.items())
    later = json.loads((out / "checkpoint-12" / "trainer_state.json").read_text())
    assert later["train_batch_size"] == 4  # the next resume starts at 4 again


def test_without_auto_find_batch_size_a_resume_keeps_the_arguments_batch_size(
    tmp_path: Path, halved_run: tuple[Trainer, OutOfMemoryAbove, Path]
) -> None:
    _, _, checkpoint = halved_run
    model = OutOfMemoryAbove(limit=100)
    trainer = _trainer(tmp_path, model, 8, [EMA(decay=0.9)], num_train_epochs=3)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    # checkpoint-6 is one batch into epoch 2; at 8 rows epoch 2 goes on with rows 8-20 (8, then 4) and
    # step 9 ends the plan of 3 epochs of 3 steps
    assert model.sizes == [8, 4, 8] and trainer.state.train_batch_size == 8


def test_a_checkpoint_with_a_bad_batch_size_fails_naming_it(
    tmp_path: Path, halved_run: tuple[Trainer, OutOfMemoryAbove, Path]
) -> None:
    _, _, checkpoint = halved_run
    broken = tmp_path / "checkpoint-6"
    shutil.copytree(checkpoint, broken)
    state_file = broken / "trainer_state.json"
    state_file.write_text(state_file.read_text().replace('"train_batch_size": 4', '"train_batch_size": 0'))
    trainer = _trainer(tmp_path / "out", OutOfMemoryAbove(limit=100), 8, auto_find_batch_size=True)
    with pytest.raises(ConfigError, match=r"trainer_state.json does not match its xxh3_128 .*corrupt or altered"):
        trainer.train(resume_from_checkpoint=str(broken))  # an altered file is reported as such
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["files"][state_file.name] = file_entry(state_file)  # as if a checkpoint had been written so
    (broken / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"trainer_state.json holds train_batch_size=0; it must be null or an"):
        trainer.train(resume_from_checkpoint=str(broken))
    with pytest.raises(ConfigError, match="no complete checkpoint"):
        trainer.train(resume_from_checkpoint=True)  # nothing in its output_dir
