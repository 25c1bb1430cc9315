"""A checkpoint is checked whole before anything is applied (#37 item 6): refused means untouched. Refused for another
optimizer class, other parameter groups, a plugin that is not attached, or a plugin refusing its own state: the
weights, the optimizer's state, the engine's state and every plugin's state are as they were. Engine and Trainer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.logs37_helpers import engine, same_weights, trainer, weights
from trainbus.engine import ConfigError, Engine, Plugin
from trainbus.plugins import TrainLogger
from trainbus.plugins.checkpoints.resuming import resume


class Picky(Plugin):
    """A plugin whose saved state this run refuses (as EMA / SWA refuse a state of the wrong form)."""

    def __init__(self, accept: bool = True) -> None:
        self.accept, self.count = accept, 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": 3}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not self.accept:
            raise ConfigError("Picky state: refused")
        self.count = state["count"]


def snapshot(run: Engine) -> dict[str, Any]:
    assert run.optimizer is not None
    return {
        "weights": weights(run.model),
        "optimizer": copy.deepcopy(run.optimizer.state_dict()),
        "state": run.state.to_dict(),
        "plugins": copy.deepcopy({p.name: p.state_dict() for p in run.plugins}),
    }


def assert_untouched(run: Engine, before: dict[str, Any]) -> None:
    after = snapshot(run)
    assert same_weights(after["weights"], before["weights"]), "weights applied by a refused checkpoint"
    assert repr(after["optimizer"]) == repr(before["optimizer"]), "optimizer state applied by a refused checkpoint"
    assert after["state"] == before["state"] and after["plugins"] == before["plugins"]


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A checkpoint at step 4 of an SGD run with a TrainLogger (the engine's plugins' states in it)."""
    run = engine(tmp_path / "run", 4, save_steps=4)
    run.fit()
    return tmp_path / "run" / "checkpoint-4"


def _trained(out: Path, **kwargs: Any) -> Engine:
    """An engine that trained 2 steps of its own (momentum state, a log history) in ``out``."""
    run = engine(out, 2, seed=5, **kwargs)
    run.fit()
    return run


def test_another_optimizer_class_is_refused_before_the_weights(tmp_path: Path, saved: Path) -> None:
    run = _trained(tmp_path / "other", optimizer="adam")
    before = snapshot(run)
    with pytest.raises(ConfigError, match="another optimizer class"):
        resume(run, saved)
    assert_untouched(run, before)


def test_other_parameter_groups_are_refused_before_the_weights(tmp_path: Path, saved: Path) -> None:
    run = _trained(tmp_path / "other")
    assert run.optimizer is not None
    weight, bias = run.model.parameters()
    run.optimizer = torch.optim.SGD([{"params": [weight]}, {"params": [bias]}], lr=0.1)
    before = snapshot(run)
    with pytest.raises(ConfigError, match=r"does not fit engine\.optimizer"):
        resume(run, saved)
    assert_untouched(run, before)


def test_a_missing_plugin_is_refused_before_the_weights_and_optimizer(tmp_path: Path, saved: Path) -> None:
    run = _trained(tmp_path / "other", logger=False)
    before = snapshot(run)
    with pytest.raises(ConfigError, match=r"plugins \[.*'TrainLogger'.*\] that this engine lacks"):
        resume(run, saved)
    assert_untouched(run, before)


def test_a_plugin_refusing_its_state_leaves_everything_as_it_was(tmp_path: Path) -> None:
    source = engine(tmp_path / "run", 4, save_steps=4)
    source.add_plugin(Picky())
    source.fit()
    run = _trained(tmp_path / "other")
    run.add_plugin(Picky(accept=False))
    before = snapshot(run)
    with pytest.raises(ConfigError, match="Picky state: refused"):
        resume(run, tmp_path / "run" / "checkpoint-4")
    assert_untouched(run, before)
    assert run.get_plugin(TrainLogger) is not None


def test_a_trainer_refuses_another_optim_before_the_weights(tmp_path: Path) -> None:
    trainer(tmp_path, max_steps=4, save_strategy="steps", save_steps=4, optim="sgd").train()
    other = trainer(tmp_path, seed=3, save_strategy="steps", save_steps=4, optim="adamw_torch")
    initial = weights(other.model)
    with pytest.raises(ConfigError, match="another optimizer class"):
        other.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert same_weights(weights(other.model), initial)
