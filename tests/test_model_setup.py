"""Gradient checkpointing (HF models) and torch.compile as opt-in plugins."""

from __future__ import annotations

import doctest

import pytest
import torch

from trainbus.engine import ConfigError, Engine
from trainbus.plugins.optimization import model_setup
from trainbus.plugins.optimization.model_setup import GradientCheckpointing, TorchCompile


def tiny_bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=8, num_labels=2
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config).double().eval()  # eval: no dropout, so runs compare exactly


def checkpointing_on(model: torch.nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def grads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad()
    model(**batch).loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_gradient_checkpointing_keeps_gradients_and_detaches() -> None:
    model = tiny_bert()
    batch = {"input_ids": torch.randint(0, 30, (2, 6)), "labels": torch.tensor([0, 1])}
    plain = grads(model, batch)
    engine = Engine(model, plugins=[GradientCheckpointing({"use_reentrant": False})])
    assert checkpointing_on(model)
    model.train()  # HF checkpoints only in training mode
    for m in model.modules():  # but without dropout, so the gradients are comparable
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    checkpointed = grads(model, batch)
    for a, b in zip(plain, checkpointed):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    engine.pop_plugin(GradientCheckpointing)
    assert not checkpointing_on(model)


def test_gradient_checkpointing_needs_an_hf_model() -> None:
    with pytest.raises(ConfigError, match="gradient_checkpointing_enable"):
        Engine(torch.nn.Linear(2, 2), plugins=[GradientCheckpointing()])


def test_torch_compile_in_place_keeps_state_dict_keys_and_trains() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    keys = list(model.state_dict())
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=data,
        max_epochs=1,
        loss_fn=torch.nn.MSELoss(),
        plugins=[TorchCompile(backend="eager")],
    )
    assert engine.model is model and model._compiled_call_impl is not None
    assert engine.fit().global_step == 3
    assert list(model.state_dict()) == keys  # no "_orig_mod." prefix in checkpoints
    engine.pop_plugin(TorchCompile)
    assert model._compiled_call_impl is None


def test_doctests() -> None:
    assert doctest.testmod(model_setup).failed == 0
