"""The Engine refuses a device or an optimizer it cannot use at construction, naming the value."""

from __future__ import annotations

import pytest
import torch

from trainbus.engine import ConfigError, Engine


def _engine(**kwargs: object) -> Engine:
    model = torch.nn.Linear(2, 1)
    kwargs.setdefault("optimizer", torch.optim.SGD(model.parameters(), lr=0.1))
    return Engine(model, train_data=[torch.zeros(1, 2)], max_steps=1, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("device", "words"),
    [
        ("gpu", "'gpu' is not a device torch knows"),
        ("cuda:7", "'cuda:7'"),
        (3.5, "3.5"),
    ],
)
def test_a_device_torch_cannot_use_is_refused_at_construction(device: object, words: str) -> None:
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        _engine(device=device)


def test_a_cuda_index_past_the_machine_names_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"'cuda:7': this machine has 2 CUDA device\(s\), cuda:0 to cuda:1"):
        _engine(device="cuda:7")


def test_the_device_setter_checks_too() -> None:
    engine = _engine()
    with pytest.raises(ConfigError, match="'tpu'"):
        engine.device = "tpu"


@pytest.mark.parametrize("optimizer", ["adam", torch.nn.Linear(2, 1)])
def test_an_optimizer_that_is_not_one_is_refused_at_construction(optimizer: object) -> None:
    with pytest.raises(ConfigError, match=r"optimizer must be a torch\.optim\.Optimizer"):
        _engine(optimizer=optimizer)


def test_an_optimizer_set_after_construction_is_checked_by_fit() -> None:
    engine = _engine()
    engine.optimizer = "adam"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="'adam' of type str, which has no step, zero_grad, param_groups"):
        engine.fit()
