"""Best checkpoints: a schedule that can never record a best is refused when fit() starts (#28 item 6).

Evaluation at each epoch's end, a checkpoint every 2 steps and LoadBestModelAtEnd: the step's
checkpoint is written before the evaluation that makes it best, so no checkpoint is ever marked
best, rotation deletes them and the end loads nothing. transformers refuses
``load_best_model_at_end`` with mismatched strategies; a bare Engine now does the same before the
first step (naming both schedules and the remedies), and keeps working compositions working.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from trainbus.engine import CompositionWarning, ConfigError, Engine
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, LoadBestModelAtEnd, list_checkpoints
from trainbus.plugins.control.best_model import BestMetric
from trainbus.plugins.control.flow import FlowControl
from trainbus.plugins.evaluation.collector import EvalCollector


def engine(out: Path, *plugins: Any, max_steps: int = 9) -> Engine:
    """3 batches per epoch, an eval set, the loss as the metric; the plugins given."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    return Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, eval_data=data[:1],
        max_steps=max_steps, loss_fn=torch.nn.MSELoss(), plugins=[EvalCollector(), *plugins],
    )  # fmt: skip


def test_epoch_evaluations_with_step_saves_are_refused_before_the_first_step(tmp_path: Path) -> None:
    """The issue's composition: FlowControl evaluates per epoch, Checkpointing saves every 2 steps."""
    run = engine(
        tmp_path,
        FlowControl(eval_strategy="epoch", save_strategy="no"),
        BestMetric("loss"),
        Checkpointing(tmp_path, save_total_limit=2, save_strategy="steps", save_steps=2),
        LoadBestModelAtEnd(),
    )
    refused = r"LoadBestModelAtEnd .*epoch.* every 2 steps.*save_strategy='best'"
    with pytest.raises(ConfigError, match=refused) as caught:
        run.fit()
    assert "load_best_model_at_end" not in str(caught.value)  # the Engine's words (#28 item 10)
    assert run.state.global_step == 0 and list_checkpoints(tmp_path) == []


@pytest.mark.parametrize(
    ("flow", "shortcut"),
    [
        (dict(eval_strategy="epoch", save_strategy="steps", save_steps=2), None),
        (dict(eval_strategy="steps", eval_steps=2, save_strategy="epoch"), None),
        (dict(eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=2), None),
        (dict(eval_strategy="steps", eval_steps=3, save_strategy="no"), dict(save_strategy="epoch")),
    ],
)
def test_mismatched_schedules_are_refused(tmp_path: Path, flow: dict[str, Any], shortcut: Any) -> None:
    run = engine(tmp_path, FlowControl(**flow), BestMetric("loss"), Checkpointing(tmp_path, **(shortcut or {})),
                 LoadBestModelAtEnd())  # fmt: skip
    with pytest.raises(ConfigError, match="LoadBestModelAtEnd can never load a best checkpoint"):
        run.fit()


@pytest.mark.parametrize(
    ("flow", "best"),
    [
        (dict(eval_strategy="epoch", save_strategy="epoch"), {}),
        (dict(eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=4), {}),
        (dict(eval_strategy="steps", eval_steps=4, save_strategy="steps", save_steps=2), {}),
        (dict(eval_strategy="epoch", save_strategy="best"), {}),
        (dict(eval_strategy="epoch", save_strategy="steps", save_steps=2), {"save_on_best": True}),
    ],
)
def test_schedules_that_record_a_best_train_and_load_it(tmp_path: Path, flow: dict[str, Any], best: Any) -> None:
    run = engine(tmp_path, FlowControl(**flow), BestMetric("loss", **best), Checkpointing(tmp_path),
                 LoadBestModelAtEnd())  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompositionWarning)
        run.fit()
    assert run.state.best_model_checkpoint is not None
    assert Path(run.state.best_model_checkpoint).name == f"checkpoint-{run.state.best_global_step}"


def test_what_cannot_be_proven_is_a_warning_not_a_refusal(tmp_path: Path) -> None:
    """No BestMetric (a handler may set the best step), nothing scheduling evaluations (a handler may
    evaluate): the run trains, with a warning naming what is missing."""
    run = engine(tmp_path, FlowControl(eval_strategy="epoch", save_strategy="epoch"), Checkpointing(tmp_path),
                 LoadBestModelAtEnd(), max_steps=3)  # fmt: skip
    with pytest.warns(CompositionWarning, match="LoadBestModelAtEnd: no BestMetric"):
        run.fit()
    run = engine(tmp_path / "b", FlowControl(save_strategy="epoch"), BestMetric("loss"),
                 Checkpointing(tmp_path / "b"), LoadBestModelAtEnd(), max_steps=3)  # fmt: skip
    with pytest.warns(CompositionWarning, match="LoadBestModelAtEnd: nothing schedules an evaluation"):
        run.fit()
