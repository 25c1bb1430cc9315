"""Issue #27 items 5 and 6: length-grouped batches, optimizer groups, HF's exception types, the plateau
schedule's check, ``eval_use_gather_object`` and NEFTune's hook, each run under transformers.Trainer and
trainbus.plugins.Trainer (hf_diff.run_both) and compared.

Test names: ``test_<what>__mirrors_<transformers test>`` where transformers' tests have the scenario.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from hf_diff import (
    RegressionData,
    assert_same_arrays,
    assert_same_logs,
    assert_same_metrics,
    assert_same_weights,
    regression_trainer,
    run_both,
)

from trainbus.engine import ConfigError

#: transformers 4.x rounds logged losses to 4 decimals; 5 logs them as computed
LOG_ATOL = 5e-5 if int(__import__("transformers").__version__.split(".")[0]) < 5 else 1e-6


# -- length-grouped batches --------------------------------------------------------------------------------
class PooledTokens(torch.nn.Module):
    """Mean of the (dropped-out) embeddings of the non-padding tokens -> one number, MSE to the label.

    Its loss per example does not depend on the padding, so a batch's loss depends only on which examples
    it holds; the dropout draws from torch's global generator, as a transformers model's does.
    """

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Embedding(40, 8, padding_idx=0)
        self.head = torch.nn.Linear(8, 1)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(40, 8, generator=generator))
            self.embed.weight[0].zero_()
            self.head.weight.copy_(torch.randn(1, 8, generator=generator) * 0.3)
            self.head.bias.zero_()
        self.dropout = torch.nn.Dropout(0.2)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        mask = (input_ids != 0).unsqueeze(-1).float()
        pooled = (self.dropout(self.embed(input_ids)) * mask).sum(1) / mask.sum(1)
        prediction = self.head(pooled).squeeze(-1)
        out = {"logits": prediction}
        if labels is not None:
            out["loss"] = torch.nn.functional.mse_loss(prediction, labels)
        return out


def token_rows(count: int, seed: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 16, (count,), generator=generator).tolist()
    return [
        {"input_ids": torch.randint(1, 40, (n,), generator=generator), "labels": float(n % 5) / 5, "idx": i}
        for i, n in enumerate(lengths)
    ]


class RecordingPadCollator:
    """Pads ``input_ids`` with 0 and records the ``idx`` of every batch it makes."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        self.batches.append([int(r["idx"]) for r in rows])
        ids = [torch.as_tensor(r["input_ids"]) for r in rows]
        return {
            "input_ids": torch.nn.utils.rnn.pad_sequence(ids, batch_first=True),
            "labels": torch.tensor([float(r["labels"]) for r in rows]),
        }


def grouping(impl: Any, spelling: str) -> dict[str, Any]:
    """Length grouping as this implementation spells it: transformers 4.x has only ``group_by_length``."""
    fields = {f.name for f in dataclasses.fields(impl.TrainingArguments)}
    if spelling == "group_by_length" or "train_sampling_strategy" not in fields:
        return {"group_by_length": True}
    return {"train_sampling_strategy": "group_by_length"}


def grouped_run(impl: Any, d: Any, spelling: str, **kwargs: Any) -> tuple[Any, RecordingPadCollator]:
    collator = RecordingPadCollator()
    args = impl.args(
        d,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=3,
        learning_rate=0.05,
        logging_steps=1,
        eval_strategy="epoch",
        save_strategy="no",
        remove_unused_columns=False,
        seed=7,
        **grouping(impl, spelling),
        **kwargs,
    )
    trainer = impl.Trainer(
        model=PooledTokens(),
        args=args,
        train_dataset=token_rows(24, seed=1),
        eval_dataset=token_rows(8, seed=2),
        data_collator=collator,
    )
    trainer.train()
    return trainer, collator


@pytest.mark.parametrize("spelling", ["train_sampling_strategy", "group_by_length"])
def test_group_by_length_trains_on_transformers_batches__mirrors_test_group_by_length(tmp_path, spelling):
    # transformers' test only checks the grouping; here the whole run: the same batches in all three
    # epochs (the shuffle drawn from the global generator after the dropout of the epochs before and the
    # evaluations between them), so the same losses from step 1, eval losses and final weights.
    # trainbus takes both spellings (4.x's group_by_length=True); transformers the one its version has
    def scenario(impl, d):
        return grouped_run(impl, d, spelling if impl.name == "trainbus" else "train_sampling_strategy")

    (hf, hf_collator), (tb, tb_collator) = run_both(scenario, tmp_path)
    # eval batches come after the train batches of their epoch; transformers groups those by length too
    hf_train = [b for b in hf_collator.batches if len(b) == 2]
    tb_train = [b for b in tb_collator.batches if len(b) == 2]
    assert len(tb_train) == 36 and tb_train == hf_train
    assert tb_train[:12] != tb_train[12:24]  # another order each epoch
    assert_same_logs(hf.state.log_history, tb.state.log_history, atol=LOG_ATOL)
    assert_same_weights(hf.model, tb.model)


# -- optimizer groups -------------------------------------------------------------------------------------
def _group_names(model: torch.nn.Module, groups: list[list[torch.nn.Parameter]]) -> list[list[str]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in params] for params in groups]


@pytest.mark.parametrize("layers", ["bias_and_norm", "no_bias"])
@pytest.mark.parametrize("how", ["optim", "optimizer_cls_and_kwargs"])
def test_optimizer_groups_listed_as_transformers__mirrors_test_get_optimizer_group(tmp_path, layers, how):
    # HF: two groups, the weight-decay one first, both there even when one is empty; get_optimizer_group()
    # is each group's list of parameters, get_optimizer_group(param) the group (dict) holding it
    def scenario(impl, d):
        torch.manual_seed(0)
        if layers == "bias_and_norm":
            model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
        else:
            model = torch.nn.Sequential(torch.nn.Linear(3, 4, bias=False), torch.nn.Linear(4, 2, bias=False))
        extra = {"optimizer_cls_and_kwargs": (torch.optim.SGD, {"lr": 0.1})} if how != "optim" else {}
        trainer = impl.Trainer(model=model, args=impl.args(d, weight_decay=0.1), **extra)
        trainer.create_optimizer()
        groups = trainer.get_optimizer_group()
        first = next(model.parameters())
        group = trainer.get_optimizer_group(first)
        return {
            "names": _group_names(model, groups),
            "decay": [g["weight_decay"] for g in trainer.optimizer.param_groups],
            "first_in": group is trainer.optimizer.param_groups[0] and any(p is first for p in group["params"]),
            "lrs": trainer.get_learning_rates(),
            "trainer": trainer,
            "model": model,
        }

    hf, tb = run_both(scenario, tmp_path)
    for key in ("names", "decay", "first_in", "lrs"):
        assert tb[key] == hf[key], (key, hf[key], tb[key])
    assert len(tb["names"]) == 2 and tb["decay"] == [0.1, 0.0]
    # trainbus finds every parameter's group (HF's `in` compares tensor values after the first, and fails)
    for index, params in enumerate(tb["trainer"].get_optimizer_group()):
        for param in params:
            assert tb["trainer"].get_optimizer_group(param) is tb["trainer"].optimizer.param_groups[index]


# -- HF's exception types ----------------------------------------------------------------------------------
class OldStyleCollator:
    """A collator with only the pre-4.x ``collate_batch`` method: not a callable."""

    def collate_batch(self, features: list[Any]) -> Any:
        return features


class NotAConfig:
    pass


def _model() -> torch.nn.Module:
    from hf_diff import RegressionModel

    return RegressionModel()


def _sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _mistake(impl: Any, d: Any, case: str) -> None:
    train = RegressionData(length=16)
    if case == "optimizers_and_optimizer_cls_and_kwargs":
        model = _model()
        impl.Trainer(
            model=model,
            args=impl.args(d),
            optimizers=(_sgd(model), None),
            optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}),
        )
    elif case == "no_model":
        impl.Trainer(args=impl.args(d))
    elif case == "model_init_and_optimizers":
        impl.Trainer(model_init=_model, args=impl.args(d), optimizers=(_sgd(_model()), None))
    elif case == "collator_not_callable":
        impl.Trainer(model=_model(), args=impl.args(d), data_collator=OldStyleCollator())
    elif case == "model_init_of_two_arguments":
        impl.Trainer(model_init=lambda trial, extra: _model(), args=impl.args(d))
    elif case == "model_init_returns_none":
        impl.Trainer(model_init=lambda: None, args=impl.args(d))
    elif case == "train_unknown_keyword":
        impl.Trainer(model=_model(), args=impl.args(d, max_steps=1), train_dataset=train).train(resume=True)
    elif case == "plateau_without_eval_strategy":
        impl.args(d, lr_scheduler_type="reduce_lr_on_plateau")
    elif case == "accelerator_config_class":
        impl.args(d, accelerator_config=NotAConfig)
    elif case == "galore_target_modules_not_str_or_list":
        args = impl.args(d, optim="galore_adamw", optim_target_modules=("0",), max_steps=1)
        impl.Trainer(model=torch.nn.Sequential(torch.nn.Linear(2, 2)), args=args, train_dataset=train).train()
    else:
        raise AssertionError(case)


#: the mistake -> the type transformers raises for it
MISTAKES = {
    "optimizers_and_optimizer_cls_and_kwargs": RuntimeError,
    "no_model": RuntimeError,
    "model_init_and_optimizers": RuntimeError,
    "collator_not_callable": TypeError,
    "model_init_of_two_arguments": RuntimeError,
    "model_init_returns_none": RuntimeError,
    "train_unknown_keyword": TypeError,
    "plateau_without_eval_strategy": ValueError,
    "accelerator_config_class": NotImplementedError,
    "galore_target_modules_not_str_or_list": TypeError,
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_a_mistake_raises_transformers_type__mirrors_test_trainer_optimizers_and_more(tmp_path, case):
    # HF's test_init_with_optimizer_cls_and_kwargs_and_optimizers (RuntimeError) and the other mistakes
    # where transformers raises something other than ValueError: trainbus raises a ConfigError that is
    # also that type, so `except RuntimeError` in a ported script catches it
    expected = MISTAKES[case]

    def scenario(impl, d):
        with pytest.raises(Exception) as caught:
            _mistake(impl, d, case)
        return caught.value

    hf, tb = run_both(scenario, tmp_path)
    assert isinstance(hf, expected), f"transformers raised {type(hf).__name__}: {hf}"
    assert isinstance(tb, expected), f"trainbus raised {type(tb).__name__}, not a {expected.__name__}: {tb}"
    assert isinstance(tb, ConfigError), f"trainbus raised {type(tb).__name__}: {tb}"


def test_plateau_with_an_eval_strategy_is_accepted__mirrors_test_reduce_lr_on_plateau_args(tmp_path):
    def scenario(impl, d):
        args = impl.args(d, lr_scheduler_type="reduce_lr_on_plateau", eval_strategy="epoch")
        return str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))

    assert run_both(scenario, tmp_path) == ("reduce_lr_on_plateau", "reduce_lr_on_plateau")


# -- eval_use_gather_object ---------------------------------------------------------------------------------
def test_eval_use_gather_object_gives_the_default_results__mirrors_test_eval_use_gather_object(tmp_path):
    # HF's test only checks that it runs; in one process the results are those of the default gather
    def scenario(impl, d):
        out = {}
        for gather_object in (True, False):
            trainer = regression_trainer(
                impl, d / str(gather_object), a=1.5, b=0.5, eval_len=13, per_device_eval_batch_size=4,
                eval_use_gather_object=gather_object, max_steps=2, save_strategy="no",
            )  # fmt: skip
            trainer.train()  # (4.x and 5 differ on the epoch key of an evaluation before any training)
            predicted = trainer.predict(RegressionData(length=13, seed=3))
            out[gather_object] = (trainer.evaluate(), predicted)
        return out

    hf, tb = run_both(scenario, tmp_path)
    for gather_object in (True, False):
        hf_metrics, hf_predicted = hf[gather_object]
        tb_metrics, tb_predicted = tb[gather_object]
        assert_same_metrics(hf_metrics, tb_metrics)
        assert_same_metrics(hf_predicted.metrics, tb_predicted.metrics)
        assert_same_arrays(hf_predicted.predictions, tb_predicted.predictions)
    assert_same_arrays(tb[True][1].predictions, tb[False][1].predictions)
    assert tb[True][0]["eval_loss"] == tb[False][0]["eval_loss"]


# -- NEFTune -------------------------------------------------------------------------------------------------
def test_neftune_hook_removed_when_train_ends__mirrors_test_neftune(tmp_path):
    # HF: after train() the embeddings carry no forward hook, and two train-mode lookups agree
    def scenario(impl, d):
        collator = RecordingPadCollator()
        args = impl.args(d, neftune_noise_alpha=5.0, max_steps=2, save_strategy="no", remove_unused_columns=False)
        trainer = impl.Trainer(model=PooledTokens(), args=args, train_dataset=token_rows(8, 1), data_collator=collator)
        trainer.train()
        embeddings = trainer.model.get_input_embeddings()
        trainer.model.train()
        ids = torch.tensor([[1, 2, 3]])
        return len(embeddings._forward_hooks), torch.equal(embeddings(ids), embeddings(ids))

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb == (0, True)
