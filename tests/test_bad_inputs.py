"""Each bad input of issue #23's list fails at TrainingArguments / Trainer construction (or at the first place
it can be seen), with an error naming the value and what is allowed, in a Trainer user's terms."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from facade_helpers import Regressor, quiet_args, regression_data
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from trainbus.engine import ConfigError
from trainbus.plugins import Trainer, TrainingArguments
from trainbus.plugins.facade.argument_checks import field_types


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"learning_rate": "0.01"}, r"learning_rate must be a number, got '0.01' \(a str\); pass the number itself"),
        ({"weight_decay": "x"}, r"weight_decay must be a number, got 'x' \(a str\)"),
        ({"num_train_epochs": "3"}, r"num_train_epochs must be a number, got '3' \(a str\); .* e\.g\. 3"),
        ({"max_grad_norm": "1"}, r"max_grad_norm must be a number or None, got '1'|max_grad_norm must be a number"),
        ({"seed": "abc"}, r"seed must be an int, got 'abc' \(a str\)"),
        ({"seed": 1.5}, r"seed must be an int, got 1\.5 \(a float\)"),
        ({"learning_rate": math.inf}, r"learning_rate must be a finite number, got inf"),
        ({"learning_rate": math.nan}, r"learning_rate must be a finite number, got nan"),
        ({"learning_rate": -1e-3}, r"learning_rate must be >= 0, got -0\.001"),
        ({"label_names": "labels"}, r"label_names must be None or a list of str \(e\.g\. \['labels'\]\), got 'labels'"),
        ({"output_dir": 123}, r"output_dir must be a str, a path or None, got 123 \(an int\)"),
        ({"fp16": "yes"}, r"fp16 must be True or False, got 'yes' \(a str\)"),
        ({"report_to": 5}, r"report_to must be None, a str or a list of str, got 5"),
        ({"per_device_train_batch_size": True}, r"per_device_train_batch_size must be an int, got True \(a bool\)"),
        ({"lr_scheduler_kwargs": [1]}, r"lr_scheduler_kwargs must be a dict, a str or None, got \[1\]"),
    ],
)
def test_a_bad_value_names_the_field_the_value_and_what_is_allowed(kwargs: dict[str, Any], message: str) -> None:
    kwargs.setdefault("output_dir", "out")
    with pytest.raises(ConfigError, match=message):
        TrainingArguments(**kwargs)


def test_infinity_is_allowed_where_it_means_something() -> None:
    """max_grad_norm=inf: the norm is computed and logged, nothing is clipped."""
    assert TrainingArguments("x", max_grad_norm=math.inf).max_grad_norm == math.inf
    with pytest.raises(ConfigError, match="max_grad_norm must be a finite number, got nan"):
        TrainingArguments("x", max_grad_norm=math.nan)


def test_an_output_dir_that_is_a_file_fails_at_construction(tmp_path: Path) -> None:
    file = tmp_path / "taken"
    file.write_text("")
    with pytest.raises(ConfigError, match=r"output_dir '.*taken' exists and is not a directory"):
        TrainingArguments(str(file))
    assert TrainingArguments(tmp_path / "new").output_dir == str(tmp_path / "new")  # a pathlib.Path is fine


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(sorted(field_types(TrainingArguments))), data=st.data())
def test_a_value_of_a_foreign_type_is_refused_for_every_field(name: str, data: st.DataObject) -> None:
    """No field takes an object of a type its annotation does not name: the error names the field."""

    class Foreign:
        def __repr__(self) -> str:
            return "<foreign>"

    with pytest.raises(ConfigError, match=rf"TrainingArguments: {name} must be .*, got <foreign>"):
        TrainingArguments(**{"output_dir": "x", name: Foreign()})


def test_a_model_that_is_not_a_module_fails_at_trainer_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model must be a torch\.nn\.Module .* got 'x' \(str\)"):
        Trainer(model="x", args=quiet_args(tmp_path))  # type: ignore[arg-type]


def test_a_dataset_of_tuples_gets_a_trainer_message_not_an_engine_one(tmp_path: Path) -> None:
    x, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
    trainer = Trainer(model=torch.nn.Linear(3, 2), args=quiet_args(tmp_path, max_steps=2, optim="sgd"),
                      train_dataset=TensorDataset(x, y))  # fmt: skip
    with pytest.raises(ConfigError) as raised:
        trainer.train()
    text = str(raised.value)
    assert "Engine" not in text and "loss_fn" not in text
    assert "batches are tuples" in text and "compute_loss_func" in text and "override compute_loss" in text


class NoLoss(torch.nn.Module):
    """Returns logits only, whatever it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize("subclass", [False, True])
def test_a_model_without_a_loss_gets_the_trainer_message(tmp_path: Path, subclass: bool) -> None:
    """The default path and Trainer.compute_loss (called by an overriding training_step) word it the same way."""

    class Stepping(Trainer):
        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
            return super().training_step(model, inputs, num_items_in_batch)

    data = [{"x": torch.randn(3), "labels": torch.tensor(i % 2)} for i in range(8)]
    cls = Stepping if subclass else Trainer
    trainer = cls(model=NoLoss(), args=quiet_args(tmp_path, max_steps=1, optim="sgd"), train_dataset=data)
    with pytest.raises(ConfigError, match=r"the model returned no loss .* got Tensor\)\. The Trainer takes") as raised:
        trainer.train()
    assert "Engine" not in str(raised.value) and "tuples" not in str(raised.value)


def test_label_smoothing_with_float_labels_says_so(tmp_path: Path) -> None:
    trainer = Trainer(model=Regressor(), args=quiet_args(tmp_path, max_steps=1, label_smoothing_factor=0.1,
                      optim="sgd"), train_dataset=regression_data(8))  # fmt: skip
    with pytest.raises(ConfigError, match=r"label smoothing needs class indices as labels .* torch\.float32 labels"):
        trainer.train()


def test_resuming_with_another_optimizer_class_says_so(tmp_path: Path) -> None:
    common = {"save_strategy": "steps", "save_steps": 2, "max_steps": 2, "learning_rate": 0.01}
    Trainer(model=Regressor(), args=quiet_args(tmp_path, optim="adamw_torch", **common),
            train_dataset=regression_data(8)).train()  # fmt: skip
    resumed = Trainer(model=Regressor(), args=quiet_args(tmp_path, optim="sgd", **{**common, "max_steps": 4}),
                      train_dataset=regression_data(8))  # fmt: skip
    with pytest.raises(
        ConfigError, match=r"another optimizer class than this run's SGD: its hyperparameters \[.*'betas'"
    ):
        resumed.train(resume_from_checkpoint=True)
    # the same class resumes
    again = Trainer(model=Regressor(), args=quiet_args(tmp_path, optim="adamw_torch", **{**common, "max_steps": 4}),
                    train_dataset=regression_data(8))  # fmt: skip
    assert again.train(resume_from_checkpoint=True).global_step == 4
