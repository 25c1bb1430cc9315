"""Checkpointing says at fit() when nothing will ever ask it to save, and refuses a bad output_dir at once."""

from __future__ import annotations

import warnings

import pytest
import torch

from trainbus.engine import CompositionWarning, ConfigError, Engine
from trainbus.plugins import Checkpointing, FlowControl, Preemption


def _fit(tmp_path, *plugins) -> list[str]:  # type: ignore[no-untyped-def]
    model = torch.nn.Linear(2, 1)
    data = [(torch.zeros(1, 2), torch.zeros(1, 1))] * 2
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data,
                    max_steps=2, loss_fn=torch.nn.MSELoss(), plugins=list(plugins))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.fit()
    return [str(w.message) for w in caught if issubclass(w.category, CompositionWarning)]


def test_checkpointing_with_nothing_scheduling_a_save_warns(tmp_path) -> None:  # type: ignore[no-untyped-def]
    found = _fit(tmp_path, Checkpointing(tmp_path / "run"))
    assert any("Checkpointing" in m and "nothing schedules a save" in m for m in found), found


@pytest.mark.parametrize(
    "plugins",
    [
        lambda out: [Checkpointing(out, save_strategy="steps", save_steps=1)],
        lambda out: [Checkpointing(out), FlowControl(save_strategy="steps", save_steps=1)],
        lambda out: [Checkpointing(out), Preemption()],
    ],
    ids=["own schedule", "FlowControl", "Preemption"],
)
def test_a_save_scheduled_anywhere_silences_it(tmp_path, plugins) -> None:  # type: ignore[no-untyped-def]
    found = _fit(tmp_path, *plugins(tmp_path / "run"))
    assert not [m for m in found if "Checkpointing" in m], found


@pytest.mark.parametrize("output_dir", [None, "", 5])
def test_a_bad_output_dir_is_refused_at_construction(output_dir: object) -> None:
    with pytest.raises(ConfigError, match="output_dir"):
        Checkpointing(output_dir)  # type: ignore[arg-type]
