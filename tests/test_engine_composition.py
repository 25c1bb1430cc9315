"""Compositions that would do nothing say so when fit() starts (#28 item 5).

The engine asks every plugin ``check_composition(composition)`` before TRAIN_START, with the attached
plugins, the handlers and what the plugins schedule (``Plugin.schedules()``); each problem becomes a
``CompositionWarning`` naming the plugin and what is missing. EarlyStopping with no evaluation
scheduled is the first user: it would never stop anything.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from trainbus.engine import Composition, CompositionWarning, ConfigError, Engine, Plugin
from trainbus.plugins.control.early_stopping import EarlyStopping
from trainbus.plugins.control.flow import FlowControl
from trainbus.plugins.evaluation.collector import EvalCollector


def bare_engine(*plugins: Plugin, eval_data: Any = None) -> Engine:
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(2)]
    return Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_epochs=1,
                  loss_fn=torch.nn.MSELoss(), plugins=plugins, eval_data=eval_data)  # fmt: skip


def composition_warnings(engine: Engine) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.fit()
    return [str(w.message) for w in caught if issubclass(w.category, CompositionWarning)]


def test_early_stopping_with_no_evaluation_scheduled_warns_naming_what_is_missing() -> None:
    found = composition_warnings(bare_engine(EarlyStopping("loss", patience=1)))
    assert len(found) == 1
    assert found[0].startswith("EarlyStopping: ") and "nothing schedules an evaluation" in found[0]
    assert "FlowControl(eval_strategy=" in found[0]  # says how to schedule one


def test_early_stopping_with_an_evaluation_scheduled_is_quiet() -> None:
    flow = FlowControl(eval_strategy="steps", eval_steps=1, save_strategy="no")
    eval_data = [(torch.randn(2, 3), torch.randn(2, 1))]
    assert composition_warnings(bare_engine(flow, EvalCollector(), EarlyStopping("loss"), eval_data=eval_data)) == []
    flow_without_eval = FlowControl(eval_strategy="no", save_strategy="no")
    assert len(composition_warnings(bare_engine(flow_without_eval, EarlyStopping("loss")))) == 1


def test_the_mechanism_passes_plugins_handlers_and_schedules() -> None:
    seen: list[Composition] = []

    class Scheduler(Plugin):
        def schedules(self) -> Iterable[str]:
            return ("save",)

    class NeedsSaves(Plugin):
        def check_composition(self, composition: Composition) -> Iterable[str] | None:
            seen.append(composition)
            return None if "evaluate" in composition.scheduled else ["nothing schedules an evaluation"]

    engine = bare_engine(Scheduler(), NeedsSaves())
    with pytest.warns(CompositionWarning, match="^NeedsSaves: nothing schedules an evaluation$"):
        engine.check_composition()
    composition = seen[-1]
    assert composition.scheduled == frozenset({"save"}) and not composition.has_eval_data
    assert composition.get(Scheduler) is engine.plugins[0] and composition.get("Nope") is None
    assert not composition.handles("STEP_END")


def test_a_schedule_name_that_is_not_a_control_request_is_an_error() -> None:
    class Typo(Plugin):
        def schedules(self) -> Iterable[str]:
            return ("evalute",)

    with pytest.raises(ConfigError, match=r"schedules 'evalute'; did you mean 'evaluate'"):
        bare_engine(Typo()).fit()
