"""Issue #27 items 5 and 6 on trainbus alone (the comparisons with transformers: differential/test_diff_issue27.py).

A length-grouped run resumed mid-epoch trains bit for bit as the uninterrupted one; 4.x's
``group_by_length``; the exception types of the Trainer's checks; NEFTune's hook across runs and failures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from facade_helpers import Regressor, quiet_args

from trainbus.engine import ConfigError
from trainbus.engine.errors import ConfigKeyError, ConfigRuntimeError, ConfigTypeError
from trainbus.plugins.data.length_grouping import (
    GroupedEvalDraw,
    LengthGroupedOrder,
    eval_sampler,
    grouped_sampler_of,
)
from trainbus.plugins.facade.arguments import TrainingArguments
from trainbus.plugins.facade.trainer import Trainer
from trainbus.plugins.facade.trainer_checks import check_train_kwargs, check_trainer_arguments, model_from_init
from trainbus.plugins.optimization.regularization import NEFTune


class PooledTokens(torch.nn.Module):
    """Mean of the dropped-out embeddings of the non-padding tokens -> a number; dropout draws globally."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(40, 8, padding_idx=0)
        self.head = torch.nn.Linear(8, 1)
        self.dropout = torch.nn.Dropout(0.2)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        mask = (input_ids != 0).unsqueeze(-1).float()
        prediction = self.head((self.dropout(self.embed(input_ids)) * mask).sum(1) / mask.sum(1)).squeeze(-1)
        out = {"logits": prediction}
        if labels is not None:
            out["loss"] = torch.nn.functional.mse_loss(prediction, labels)
        return out


def token_rows(count: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 16, (count,), generator=generator).tolist()
    return [{"input_ids": torch.randint(1, 40, (n,), generator=generator), "labels": n / 16} for n in lengths]


def pad(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    ids = torch.nn.utils.rnn.pad_sequence([r["input_ids"] for r in rows], batch_first=True)
    return {"input_ids": ids, "labels": torch.tensor([float(r["labels"]) for r in rows])}


# -- group_by_length: a mid-epoch resume ------------------------------------------------------------------
def grouped_trainer(output_dir: Path, **kwargs: Any) -> Trainer:
    args = quiet_args(
        output_dir,
        train_sampling_strategy="group_by_length",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=2,  # 24 rows: 6 steps per epoch
        learning_rate=0.05,
        logging_steps=1,
        save_strategy="steps",
        save_steps=2,
        seed=3,
        **kwargs,
    )
    return Trainer(PooledTokens(), args, train_dataset=token_rows(24), data_collator=pad)


def test_the_trainer_keeps_the_grouped_order_in_its_checkpoints(tmp_path: Path) -> None:
    trainer = grouped_trainer(tmp_path)
    assert trainer.get_plugin(LengthGroupedOrder) is not None
    trainer.train()
    sampler = grouped_sampler_of(trainer.train_data)
    assert sampler is not None and sampler.drawn is not None and sampler.drawn[0] == 1


# mid epoch 0, the end of epoch 0, mid epoch 1
@pytest.mark.parametrize("checkpoint", ["checkpoint-4", "checkpoint-6", "checkpoint-8"])
def test_a_grouped_run_resumed_mid_epoch_trains_bit_for_bit(tmp_path: Path, checkpoint: str) -> None:
    def with_order(trainer: Trainer) -> Trainer:  # the Trainer attaches it itself (the test above)
        if trainer.get_plugin(LengthGroupedOrder) is None:
            trainer.add_plugin(LengthGroupedOrder())
        return trainer

    full = with_order(grouped_trainer(tmp_path / "full"))
    full.train()
    resumed = with_order(grouped_trainer(tmp_path / "resumed", ignore_data_skip=False))
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / checkpoint))
    for name, value in full.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], value), name
    step = int(checkpoint.split("-")[1])
    losses = [(r["step"], r["loss"]) for r in full.state.log_history if "loss" in r and r["step"] > step]
    assert losses == [(r["step"], r["loss"]) for r in resumed.state.log_history if "loss" in r and r["step"] > step]
    assert len(losses) == 12 - step


def test_eval_sets_keep_their_order_and_draw_as_transformers_4_does() -> None:
    import transformers

    draw = GroupedEvalDraw(range(7))
    torch.manual_seed(4)
    assert list(draw) == list(range(7))  # the set's order
    after = torch.get_rng_state()
    torch.manual_seed(4)
    torch.randperm(7)  # 4.x's LengthGroupedSampler draw for the eval set, the only random part
    assert torch.equal(torch.get_rng_state(), after)
    chosen = eval_sampler(token_rows(7), "group_by_length")
    assert isinstance(chosen, GroupedEvalDraw) == (int(transformers.__version__.split(".")[0]) < 5)
    assert eval_sampler(token_rows(7), "random") is None


# -- TrainingArguments --------------------------------------------------------------------------------------
def test_group_by_length_is_transformers_4_spelling(tmp_path: Path) -> None:
    assert TrainingArguments(str(tmp_path), group_by_length=True).train_sampling_strategy == "group_by_length"
    assert TrainingArguments(str(tmp_path)).train_sampling_strategy == "random"
    with pytest.raises(ConfigError, match=r"group_by_length=True .*'sequential'"):
        TrainingArguments(str(tmp_path), group_by_length=True, train_sampling_strategy="sequential")


def test_schedules_are_checked_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reduce_lr_on_plateau' requires an eval strategy"):
        TrainingArguments(str(tmp_path), lr_scheduler_type="reduce_lr_on_plateau")
    with pytest.raises(ValueError, match="unknown lr scheduler 'cosin'; did you mean 'cosine'"):
        TrainingArguments(str(tmp_path), lr_scheduler_type="cosin")
    assert TrainingArguments(str(tmp_path), eval_use_gather_object=True).eval_use_gather_object is True


def test_a_value_of_the_wrong_type_is_a_type_error(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="learning_rate must be a number") as caught:
        TrainingArguments(str(tmp_path), learning_rate="0.1")
    assert isinstance(caught.value, ConfigError)


# -- the Trainer's checks, with transformers' exception types ----------------------------------------------
def test_trainer_argument_checks_raise_transformers_types() -> None:
    model = Regressor()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0)
    cases: list[tuple[dict[str, Any], type[Exception], str]] = [
        ({"model": None}, RuntimeError, "either a `model` or `model_init`"),
        ({"model_init": Regressor}, ValueError, "but not both"),
        ({"optimizers": (sgd, None), "optimizer_cls_and_kwargs": (torch.optim.SGD, {})}, RuntimeError, "both"),
        ({"model": None, "model_init": Regressor, "optimizers": (None, schedule)}, RuntimeError, "model_init"),
        ({"data_collator": object()}, TypeError, "data_collator must be a callable"),
    ]
    for overrides, kind, match in cases:
        given = {
            "model": model,
            "model_init": None,
            "optimizers": (None, None),
            "optimizer_cls_and_kwargs": None,
            "data_collator": None,
        }
        given.update(overrides)
        with pytest.raises(kind, match=match) as caught:
            check_trainer_arguments(**given)
        assert isinstance(caught.value, ConfigError)
    check_trainer_arguments(model, None, (sgd, None), None, lambda rows: rows)  # a valid combination


def test_model_init_is_called_as_transformers_calls_it() -> None:
    trial = object()
    assert model_from_init(lambda: "plain") == "plain"
    assert model_from_init(lambda t: t, trial) is trial
    assert isinstance(model_from_init(Regressor), Regressor)
    with pytest.raises(ConfigRuntimeError, match="0 or 1 argument"):
        model_from_init(lambda a, b: None)
    with pytest.raises(ConfigRuntimeError, match="should not return None"):
        model_from_init(lambda: None)


def test_train_keywords() -> None:
    with pytest.raises(ConfigTypeError, match=r"unexpected keyword arguments \['resume'\]"):
        check_train_kwargs({"resume": True})
    check_train_kwargs({"trial": None, "ignore_keys_for_eval": None})
    check_train_kwargs({"ignore_keys_for_eval": ["x"]}, handled=("ignore_keys_for_eval",))
    with pytest.raises(ConfigError, match="ignore_keys_for_eval"):
        check_train_kwargs({"ignore_keys_for_eval": ["x"]})


def test_key_error_reads_as_its_message() -> None:
    error = ConfigKeyError("metric 'x' is missing")
    assert isinstance(error, KeyError) and isinstance(error, ValueError) and str(error) == "metric 'x' is missing"


# -- NEFTune's hook ------------------------------------------------------------------------------------------
def test_neftune_hook_is_removed_when_training_raises_and_back_at_the_next_train(tmp_path: Path) -> None:
    from trainbus.plugins.facade.callbacks import TrainerCallback

    ids = torch.tensor([[1, 2, 3]])
    noisy: list[bool] = []

    class Probe(TrainerCallback):
        """Looks ``ids`` up twice in training mode after each step (noise: they differ); raises while ``fail``."""

        fail = True

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            noisy.append(not torch.equal(embeddings(ids), embeddings(ids)))
            if self.fail:
                raise RuntimeError("boom")

    args = quiet_args(tmp_path, neftune_noise_alpha=5.0, max_steps=2, per_device_train_batch_size=2)
    probe = Probe()
    trainer = Trainer(PooledTokens(), args, train_dataset=token_rows(8), data_collator=pad, callbacks=[probe])
    embeddings = trainer.model.get_input_embeddings()
    with pytest.raises(Exception, match="boom"):
        trainer.train()
    assert len(embeddings._forward_hooks) == 0  # removed although training raised
    assert noisy == [True]
    probe.fail = False
    trainer.train()
    assert noisy == [True, True, True]  # the hook was back for the second run's two steps
    assert len(embeddings._forward_hooks) == 0
    trainer.model.train()
    assert torch.equal(embeddings(ids), embeddings.weight[ids])  # and gone after it: no noise
    assert trainer.get_plugin(NEFTune) is not None
