"""Optimizers by HF name, weight-decay groups, parameter counts, the OptimizerSetup plugin."""

from __future__ import annotations

import doctest
import importlib
from typing import Any

import pytest
import torch

from trainbus.engine import ConfigError, Engine
from trainbus.plugins.optimization import optimizer_modes, optimizer_state, optimizers
from trainbus.plugins.optimization.optimizers import (
    OPTIMIZER_NAMES,
    OptimizerSetup,
    count_parameters,
    count_trainable_parameters,
    create_optimizer,
    default_optimizer_name,
    get_decay_parameter_names,
    parse_optim_args,
)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.final_norm = torch.nn.Parameter(torch.ones(4))  # an RMSNorm-style bare weight, caught by name
        self.scale = torch.nn.Parameter(torch.ones(4))


def tiny_bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    return BertForSequenceClassification(config)


def test_decay_names_skip_biases_and_norm_layers() -> None:
    assert get_decay_parameter_names(Block()) == ["dense.weight", "scale"]


def test_decay_names_equal_hf_on_an_hf_model() -> None:
    from transformers.trainer_pt_utils import get_parameter_names  # importing Trainer itself takes seconds

    model = tiny_bert()
    # HF Trainer.get_decay_parameter_names, transformers 5
    patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
    assert get_decay_parameter_names(model) == get_parameter_names(model, [torch.nn.LayerNorm], patterns)


@pytest.mark.parametrize(
    ("name", "cls", "extra"),
    [
        ("adamw_torch", torch.optim.AdamW, {"betas": (0.8, 0.95), "eps": 1e-6}),
        ("adamw_torch_fused", torch.optim.AdamW, {"fused": True, "betas": (0.8, 0.95)}),
        ("sgd", torch.optim.SGD, {}),
        ("adagrad", torch.optim.Adagrad, {}),
        ("adafactor", "transformers.optimization.Adafactor", {"scale_parameter": False, "relative_step": False}),
        ("rmsprop", torch.optim.RMSprop, {}),
    ],
)
def test_each_name_builds_its_optimizer_with_decay_groups(name: str, cls: type | str, extra: dict[str, Any]) -> None:
    if isinstance(cls, str):  # HF's own Adafactor, as HF's optim="adafactor" builds it
        module, _, class_name = cls.rpartition(".")
        cls = getattr(importlib.import_module(module), class_name)
    model = Block()
    opt = create_optimizer(model, name, lr=0.01, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6)
    assert type(opt) is cls
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in decay["params"]} == {id(model.dense.weight), id(model.scale)}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert all(g["lr"] == 0.01 for g in opt.param_groups)
    for key, value in extra.items():
        assert opt.defaults[key] == value
    (model.dense(torch.randn(3, 4)).sum() + model.scale.sum()).backward()
    opt.step()  # every optimizer really runs on CPU


def test_frozen_parameters_are_left_out_and_not_counted() -> None:
    model = Block()
    model.dense.requires_grad_(False)
    opt = create_optimizer(model, "sgd", lr=0.1)
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    assert id(model.dense.weight) not in params
    assert count_trainable_parameters(model) == count_parameters(model) - 20
    tied = torch.nn.Sequential(torch.nn.Linear(3, 3, bias=False), torch.nn.Linear(3, 3, bias=False))
    tied[1].weight = tied[0].weight
    assert count_trainable_parameters(tied) == 9  # shared weights count once, as in HF


def test_optim_args_and_user_optimizers() -> None:
    assert parse_optim_args("momentum=0.9, nesterov=true,dampening=0") == {
        "momentum": 0.9,
        "nesterov": True,
        "dampening": 0,
    }
    assert parse_optim_args({"a": 1}) == {"a": 1} and parse_optim_args(None) == {}
    opt = create_optimizer(Block(), "sgd", lr=0.1, optim_args="momentum=0.9,nesterov=true")
    assert opt.defaults["momentum"] == 0.9 and opt.defaults["nesterov"] is True
    assert type(create_optimizer(Block(), torch.optim.NAdam, lr=0.1, weight_decay=0.01)) is torch.optim.NAdam
    made: list[Any] = []

    def factory(groups: list[dict[str, Any]], lr: float, **kwargs: Any) -> torch.optim.Optimizer:
        made.append(groups)
        return torch.optim.SGD(groups, lr=lr, **kwargs)

    create_optimizer(Block(), factory, lr=0.2, weight_decay=0.5, optim_args={"momentum": 0.5})
    assert [g["weight_decay"] for g in made[0]] == [0.5, 0.0]


def test_default_is_fused_where_supported() -> None:
    assert default_optimizer_name(Block()) == "adamw_torch_fused"  # CPU fused kernels exist in torch >= 2.4
    assert create_optimizer(Block()).defaults["fused"] is True
    assert default_optimizer_name(Block().to("meta")) == "adamw_torch"


def test_bad_input_names_the_allowed_values() -> None:
    known = ", ".join(OPTIMIZER_NAMES)
    with pytest.raises(ConfigError, match=rf"unknown optimizer 'adamw'; did you mean .*'adamw_8bit'.*: {known}$"):
        create_optimizer(Block(), "adamw")
    with pytest.raises(ConfigError, match="known optimizers"):
        OptimizerSetup("adam_w")
    with pytest.raises(ConfigError, match="lr must be >= 0"):
        create_optimizer(Block(), "sgd", lr=-1.0)
    with pytest.raises(ConfigError, match="adam_beta2"):
        create_optimizer(Block(), "adamw_torch", adam_beta2=1.0)
    with pytest.raises(ConfigError, match="optim_args must look like"):
        parse_optim_args("momentum")
    with pytest.raises(ConfigError, match="rejected its arguments"):
        create_optimizer(Block(), "sgd", optim_args="betas=3")
    with pytest.raises(ConfigError, match="no trainable parameters"):
        create_optimizer(Block().requires_grad_(False), "sgd")


def test_optimizer_setup_plugin() -> None:
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1))]
    engine = Engine(
        model, train_data=data, max_epochs=1, loss_fn=torch.nn.MSELoss(), plugins=[OptimizerSetup("sgd", lr=0.1)]
    )
    assert isinstance(engine.optimizer, torch.optim.SGD)
    before = model.weight.detach().clone()
    engine.fit()
    assert not torch.equal(before, model.weight)
    given = torch.optim.Adam(model.parameters())
    assert Engine(model, given, plugins=[OptimizerSetup("sgd")]).optimizer is given
    assert isinstance(Engine(model, given, plugins=[OptimizerSetup("sgd", replace=True)]).optimizer, torch.optim.SGD)


@pytest.mark.parametrize("module", [optimizers, optimizer_state, optimizer_modes], ids=lambda m: m.__name__)
def test_doctests(module: Any) -> None:
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0
