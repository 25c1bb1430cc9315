"""``train()`` called twice on one Trainer: the second run gets a new learning-rate schedule, as transformers'
(it drops a schedule it built itself at every ``train()`` and builds one for the new run), while the
optimizer and the weights go on from the first run. A schedule the script gave stays the script's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from hf_diff import Impl, assert_same_logs, assert_same_weights, regression_trainer, run_both


def _twice(impl: Impl, workdir: Path, given_schedule: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    trainer = regression_trainer(
        impl, workdir, learning_rate=0.1, max_steps=4, logging_steps=1, warmup_steps=1, save_strategy="no",
        per_device_train_batch_size=16,
    )  # fmt: skip
    if given_schedule:
        optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)
        trainer.optimizer = optimizer
        trainer.lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    trainer.train()
    first = list(trainer.state.log_history)
    trainer.train()
    return {"logs": first + trainer.state.log_history, "model": trainer.model}


def test_a_second_train_gets_a_new_schedule(tmp_path: Path) -> None:
    hf, tb = run_both(_twice, tmp_path)
    rates = [record["learning_rate"] for record in tb["logs"] if "learning_rate" in record]
    assert rates[4:] == rates[:4] and rates[1] == 0.1, rates  # warmup then linear decay, both runs
    assert_same_logs(hf["logs"], tb["logs"])
    assert_same_weights(hf["model"], tb["model"])


def test_a_given_schedule_goes_on(tmp_path: Path) -> None:
    hf, tb = run_both(lambda impl, workdir: _twice(impl, workdir, given_schedule=True), tmp_path)
    rates = [record["learning_rate"] for record in tb["logs"] if "learning_rate" in record]
    assert rates == [0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025, 0.025], rates
    assert_same_logs(hf["logs"], tb["logs"])
    assert_same_weights(hf["model"], tb["model"])


def test_checkpoints_found_where_get_output_dir_says(tmp_path: Path) -> None:
    """transformers' own tests find a run's checkpoints with ``trainer._get_output_dir(trial=None)``."""

    def scenario(impl: Impl, workdir: Path) -> list[str]:
        trainer = regression_trainer(impl, workdir, max_steps=4, save_steps=2, per_device_train_batch_size=16)
        trainer.train()
        folder = Path(trainer._get_output_dir(trial=None))
        return sorted(p.name for p in folder.glob("checkpoint-*"))

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb == ["checkpoint-2", "checkpoint-4"]


def test_log_level_governs_the_training_banner__mirrors_test_log_level(tmp_path: Path) -> None:
    """transformers logs "Running training" on its trainer logger; ``log_level`` sets the level of transformers'
    loggers for the run: "debug" shows it, "error" hides it."""
    import io
    import logging

    import transformers

    def scenario(impl: Impl, workdir: Path) -> list[bool]:
        shown = []
        for level in ("debug", "error"):
            transformers.logging.set_verbosity_info()
            stream = io.StringIO()
            handler = logging.StreamHandler(stream)
            root = logging.getLogger("transformers")
            root.addHandler(handler)
            try:
                trainer = regression_trainer(impl, workdir / level, max_steps=1, log_level=level)
                trainer.train()
            finally:
                root.removeHandler(handler)
            shown.append("Running training" in stream.getvalue())
        transformers.logging.set_verbosity_warning()
        return shown

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb == [True, False]
