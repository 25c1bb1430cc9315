"""A Trainer subclass that overrides ``compute_loss`` / ``training_step`` resumes bit for bit (#37 item 5).

transformers checkpoints the model, optimizer, scheduler, RNG and trainer state; what a subclass keeps on
itself is lost, so a resume starts it over: an EMA teacher's weights, learned task weights outside the
model, a noise generator of its own, a step counter driving a schedule. trainbus checkpoints the state a
subclass's own code assigns on ``self`` (tensors and modules that changed, generators, numbers and
strings that changed) and restores it on resume; what it cannot hold is named in a warning. Each
subclass below is stopped mid-epoch and resumed in a fresh Trainer; the resumed weights equal the
uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import copy
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.facade_helpers import quiet_args
from tests.test_resume_in_flight import NoisyRegressor, rows
from trainbus.plugins import Trainer
from trainbus.plugins.facade.subclass_state import SubclassState


class Distillation(Trainer):
    """A distillation ``compute_loss``: a teacher with dropout, updated as the student's EMA every step, and a
    temperature annealed by a step counter of the subclass's own."""

    def __init__(self, *args: Any, teacher: torch.nn.Module, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.teacher = teacher
        self.distill_steps = 0

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        with torch.no_grad():
            soft = self.teacher(**inputs)["logits"]
            for t, s in zip(self.teacher.parameters(), model.parameters(), strict=True):
                t.mul_(0.9).add_(s, alpha=0.1)  # the teacher follows the student (mean teacher)
        temperature = 1.0 + 1.0 / (1 + self.distill_steps)
        self.distill_steps += 1
        hard = torch.nn.functional.mse_loss(outputs["logits"], labels)
        loss = hard + 0.5 * torch.nn.functional.mse_loss(outputs["logits"] / temperature, soft / temperature)
        return (loss, outputs) if return_outputs else loss


class MultiTask(Trainer):
    """Two task losses weighed by learned log-variances (uncertainty weighting) that live on the subclass and
    that ``create_optimizer`` adds to the optimizer; a task dropped at random from a ``random.Random`` of its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.log_vars = torch.nn.Parameter(torch.zeros(2))
        self.task_rng = random.Random(4)
        super().__init__(*args, **kwargs)

    def create_optimizer(self, model: Any = None) -> Any:
        optimizer = super().create_optimizer()
        optimizer.add_param_group({"params": [self.log_vars], "weight_decay": 0.0})
        return optimizer

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        losses = torch.stack([torch.nn.functional.mse_loss(outputs["logits"], labels),
                              (outputs["logits"] - labels).abs().mean()])  # fmt: skip
        keep = torch.tensor([1.0, float(self.task_rng.random() > 0.3)])
        loss = (keep * (torch.exp(-self.log_vars) * losses + self.log_vars)).sum()
        return (loss, outputs) if return_outputs else loss


class Adversarial(Trainer):
    """An adversarial ``training_step``: the inputs perturbed by noise from a generator of its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.noise = torch.Generator().manual_seed(12)

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        inputs["x"] = inputs["x"] + 0.2 * torch.randn(inputs["x"].shape, generator=self.noise)
        loss = self.compute_loss(model, inputs)
        self.accelerator.backward(loss)
        return loss.detach()


class FreeAdversarial(Trainer):
    """'Free' adversarial training: a perturbation made at the first step, kept and pushed along the input
    gradient's sign from step to step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.delta: torch.Tensor | None = None

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        model.train()
        inputs = self._prepare_inputs(inputs)
        if self.delta is None:
            self.delta = torch.zeros_like(inputs["x"])
        x = (inputs["x"] + self.delta).requires_grad_(True)
        loss = self.compute_loss(model, {**inputs, "x": x})
        self.accelerator.backward(loss)
        self.delta = (self.delta + 0.02 * x.grad.sign()).clamp(-0.1, 0.1).detach()
        return loss.detach()


class DynamicWeights(Trainer):
    """Multi-task weights from each task's loss history (dynamic weight averaging), kept in a defaultdict."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.history: defaultdict[str, list[float]] = defaultdict(list)

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        losses = {"mse": torch.nn.functional.mse_loss(outputs["logits"], labels),
                  "l1": (outputs["logits"] - labels).abs().mean()}  # fmt: skip
        weights = {k: 1.0 if len(self.history[k]) < 2 else self.history[k][-1] / self.history[k][-2] for k in losses}
        for k, v in losses.items():
            self.history[k].append(float(v.detach()))
        loss = sum(weights[k] * v for k, v in losses.items())
        return (loss, outputs) if return_outputs else loss


def make(kind: type[Trainer], output_dir: Path, **more: Any) -> Trainer:
    torch.manual_seed(0)
    model = NoisyRegressor()
    extra: dict[str, Any] = {"teacher": copy.deepcopy(model)} if issubclass(kind, Distillation) else {}
    args = quiet_args(
        output_dir, num_train_epochs=2, per_device_train_batch_size=4, learning_rate=0.05, logging_steps=1,
        save_strategy="steps", save_steps=3, seed=11, **more,
    )  # fmt: skip
    return kind(model, args, train_dataset=rows(24), **extra)


def assert_resumes_exactly(tmp_path: Path, kind: type[Trainer], steps: tuple[int, ...], **more: Any) -> None:
    full = make(kind, tmp_path / "full", **more)
    full.train()
    for step in steps:
        resumed = make(kind, tmp_path / f"from-{step}", **more)
        resumed.train(resume_from_checkpoint=str(tmp_path / "full" / f"checkpoint-{step}"))
        for a, b in zip(full.model.parameters(), resumed.model.parameters(), strict=True):
            assert torch.equal(a, b), f"{kind.__name__} resumed from checkpoint-{step}"


@pytest.mark.parametrize(
    "kind", [Distillation, MultiTask, Adversarial, FreeAdversarial, DynamicWeights], ids=lambda k: k.__name__
)
def test_a_subclass_with_state_of_its_own_resumes_bit_exact(tmp_path: Path, kind: type[Trainer]) -> None:
    assert_resumes_exactly(tmp_path, kind, (3, 9))  # 6 steps an epoch: mid-epoch 0 and mid-epoch 1


def test_a_restored_defaultdict_stays_one(tmp_path: Path) -> None:
    full = make(DynamicWeights, tmp_path / "full")
    full.train()
    resumed = make(DynamicWeights, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-9"))
    assert isinstance(resumed.history, defaultdict) and resumed.history == full.history


def test_with_accumulation_and_a_resume_of_a_resume(tmp_path: Path) -> None:
    full = make(MultiTask, tmp_path / "full", gradient_accumulation_steps=2)
    full.train()
    first = make(MultiTask, tmp_path / "first", gradient_accumulation_steps=2)
    first.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))
    second = make(MultiTask, tmp_path / "second", gradient_accumulation_steps=2)  # from the resumed run's own
    second.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-6"))
    for run in (first, second):
        assert torch.equal(run.log_vars, full.log_vars)
        for a, b in zip(full.model.parameters(), run.model.parameters(), strict=True):
            assert torch.equal(a, b)


def test_a_frozen_teacher_is_not_written_into_checkpoints(tmp_path: Path) -> None:
    """Only what changed: a teacher that stays as built costs the checkpoint nothing."""

    class Frozen(Distillation):
        def compute_loss(
            self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            with torch.no_grad():
                soft = self.teacher(**inputs)["logits"]
            mse = torch.nn.functional.mse_loss
            loss = mse(outputs["logits"], labels) + mse(outputs["logits"], soft)
            return (loss, outputs) if return_outputs else loss

    trainer = make(Frozen, tmp_path)
    trainer.teacher.eval()
    trainer.train()
    assert trainer.get_plugin("SubclassState").state_dict() == {"attributes": {}}  # nor the unchanged counter
    trainer.distill_steps = 5
    changed = {"distill_steps": {"kind": "value", "value": 5}}
    assert trainer.get_plugin("SubclassState").state_dict() == {"attributes": changed}


class KeepsAHistory(Adversarial):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: set[int] = set()

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        self.seen.add(len(self.seen))
        return super().training_step(model, inputs, num_items_in_batch)


class PullsAnAuxiliaryTask(Adversarial):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.aux = iter(range(1000))

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        next(self.aux)
        return super().training_step(model, inputs, num_items_in_batch)


@pytest.mark.parametrize(
    ("kind", "named"),
    [(KeepsAHistory, r"KeepsAHistory\.seen \(a set\)"),
     (PullsAnAuxiliaryTask, r"PullsAnAuxiliaryTask\.aux \(a range_iterator\)")],
)  # fmt: skip
def test_state_a_checkpoint_cannot_hold_is_named_in_a_warning(tmp_path: Path, kind: type[Trainer], named: str) -> None:
    trainer = make(kind, tmp_path, max_steps=3)
    with pytest.warns(UserWarning, match=named + ".*not be restored"):
        trainer.train()


def test_a_subclass_whose_source_cannot_be_read_is_recorded_too(tmp_path: Path) -> None:
    """The names are observed as the script's code assigns them, not read from its source: a class made by
    exec (a notebook cell, ``python -c``) is checkpointed as any other."""
    namespace: dict[str, Any] = {"Trainer": Trainer, "__name__": "notebook"}
    exec("class Typed(Trainer):\n    def log(self, logs, start_time=None):\n        self.count = len(logs)\n"
         "        super().log(logs, start_time)\n", namespace)  # fmt: skip
    trainer = make(namespace["Typed"], tmp_path, max_steps=3)
    trainer.train()
    saved = trainer.get_plugin(SubclassState).state_dict()["attributes"]
    assert list(saved) == ["count"], saved
