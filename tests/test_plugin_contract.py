"""The plugin contract is checked when a plugin is attached: a state a checkpoint cannot hold, a
misspelt plugin name and a log record nobody writes are clear at once, not hours later."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from facade_helpers import Regressor, quiet_args, regression_data
from hypothesis import given
from hypothesis import strategies as hs

from trainbus.engine import ConfigError, Engine, Event, Plugin, UnknownPluginError
from trainbus.engine.plugin import check_state
from trainbus.engine.testing import LoopConfig, toy_engine
from trainbus.plugins import Trainer
from trainbus.plugins.checkpoints.codec import split_tensors

CONFIG = LoopConfig(dataset_size=8, batch_size=2, accumulation_steps=1, max_epochs=1, max_steps=None,
                    stop_at_step=None)  # fmt: skip

# values a state may hold, and values the codec refuses
good_leaves = hs.one_of(
    hs.none(), hs.booleans(), hs.integers(), hs.floats(), hs.text(max_size=3),
    hs.just(torch.zeros(2)), hs.sampled_from([torch.float16, torch.int64]),
    hs.just(np.arange(3, dtype=np.int32)), hs.just(np.float32(1.5)), hs.just(np.array([True, False])),
)  # fmt: skip
bad_leaves = hs.sampled_from([object(), {1, 2}, 1j, b"bytes", np.array(["a"]), np.array([1j]), len, Path("x")])
values = hs.recursive(
    hs.one_of(good_leaves, bad_leaves),
    lambda inner: hs.one_of(
        hs.lists(inner, max_size=3),
        hs.lists(inner, max_size=3).map(tuple),
        hs.dictionaries(hs.one_of(hs.text(max_size=3), hs.integers(0, 3)), inner, max_size=3),
    ),
    max_leaves=8,
)


def codec_accepts(value: Any) -> bool:
    try:
        split_tensors(value)
    except ConfigError:
        return False
    return True


@given(values)
def test_the_engine_check_accepts_exactly_what_the_checkpoint_codec_encodes(value: Any) -> None:
    try:
        check_state(value, "plugins/X")
    except ConfigError:
        assert not codec_accepts(value)
    else:
        assert codec_accepts(value)


class Forgetful(Plugin):
    def __init__(self) -> None:
        self.seen: set[int] = set()

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.STEP_END, self.step_end)

    def step_end(self, ev: Any) -> None:
        self.seen.add(ev.engine.state.global_step)

    def state_dict(self) -> dict[str, Any]:
        return {"counts": {"seen": self.seen}}  # a set: no checkpoint can hold it


def test_a_state_a_checkpoint_cannot_hold_fails_when_the_plugin_is_attached() -> None:
    engine = toy_engine(CONFIG)
    message = r"'Forgetful' breaks the plugin contract.*type set at 'plugins/Forgetful/counts/seen'"
    with pytest.raises(ConfigError, match=message):
        engine.add_plugin(Forgetful())
    assert engine.plugins == [] and not engine.bus.has_handlers(Event.STEP_END)  # detached again
    with pytest.raises(ConfigError, match="Forgetful"):
        toy_engine(CONFIG, plugins=[Forgetful()])


def test_a_state_dict_that_raises_at_attach_is_named() -> None:
    class Unready(Plugin):
        def state_dict(self) -> dict[str, Any]:
            raise AttributeError("'Unready' object has no attribute 'scheduler'")

    with pytest.raises(ConfigError, match=r"'Unready' breaks the plugin contract.*no attribute 'scheduler'"):
        toy_engine(CONFIG).add_plugin(Unready())


def test_get_plugin_with_an_unknown_name_raises_and_suggests_the_close_ones() -> None:
    class GradientClipping(Plugin):
        pass

    engine = toy_engine(CONFIG, plugins=[GradientClipping()])
    with pytest.raises(UnknownPluginError, match=r"no plugin named 'GradientClippng'.*did you mean 'GradientClipping'"):
        engine.get_plugin("GradientClippng")
    with pytest.raises(LookupError, match=r"attached plugins: \['GradientClipping'\]"):
        engine.get_plugin("MemoryMetrics")
    assert engine.get_plugin("MemoryMetrics", None) is None  # asking whether an optional plugin is there
    assert engine.get_plugin("GradientClipping", None) is engine.plugins[0]
    assert engine.get_plugin(Forgetful) is None  # a class: None when absent, as before
    assert engine.pop_plugin("MemoryMetrics") is None


def test_engine_log_without_a_logger_keeps_the_records_and_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    toy = toy_engine(CONFIG)  # the kit's toy engine is quiet on purpose: a user's Engine warns
    engine = Engine(toy.model, toy.optimizer, train_data=toy.train_data, max_epochs=1, loss_fn=torch.nn.MSELoss())
    engine.fit()
    with caplog.at_level(logging.WARNING, logger="trainbus.engine"):
        engine.log({"custom": 1.0})
        engine.log({"custom": 2.0})
    assert engine.state.log_history == [{"custom": 1.0, "step": 4}, {"custom": 2.0, "step": 4}]
    assert caplog.text.count("no LOG handler") == 1


def test_engine_log_with_a_handler_leaves_the_history_to_it() -> None:
    engine = toy_engine(CONFIG)
    seen: list[dict[str, float]] = []
    engine.on(Event.LOG, lambda ev: seen.append(ev.logs))
    engine.log({"custom": 1.0})
    assert seen == [{"custom": 1.0}] and engine.state.log_history == []


def test_trainer_takes_plugins(tmp_path: Path) -> None:
    class CountSteps(Plugin):
        def __init__(self) -> None:
            self.steps = 0

        def attach(self, engine: Engine) -> None:
            self.on(engine, Event.STEP_END, self.step_end)

        def step_end(self, ev: Any) -> None:
            self.steps += 1

        def state_dict(self) -> dict[str, Any]:
            return {"steps": self.steps}

    counter = CountSteps()
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=3), train_dataset=regression_data(16),
                      plugins=[counter])  # fmt: skip
    assert trainer.get_plugin("CountSteps") is counter
    trainer.train()
    assert counter.steps == 3
    with pytest.raises(ConfigError, match="expected a trainbus Plugin, got str"):
        Trainer(Regressor(), quiet_args(tmp_path, max_steps=3), train_dataset=regression_data(16),
                plugins=["GradientClipping"])  # type: ignore[list-item]  # fmt: skip
