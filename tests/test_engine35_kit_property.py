"""The kit names the remedy and stays quiet (#35 item 5); docs/testing.md's property over loop shapes runs here
and catches both planted bugs (a state reset at the wrong event, an off-by-one at an epoch boundary)."""

from __future__ import annotations

import logging
import pydoc
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbus.engine import Event, Plugin
from trainbus.engine.testing import LoopConfig, ResumeMismatch, check_resume_equivalence, loop_configs, toy_engine

ROOT = Path(__file__).resolve().parent.parent


def page_module() -> types.ModuleType:
    """Every ```python block of docs/testing.md, run as one module."""
    page = (ROOT / "docs/testing.md").read_text(encoding="utf-8")
    blocks = [part.split("```", 1)[0] for part in page.split("```python\n")[1:]]
    module = types.ModuleType("docs_testing_example")
    sys.modules[module.__name__] = module
    try:
        exec(compile("\n".join(blocks), "<docs/testing.md>", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module


def test_the_documented_property_holds_for_the_correct_plugins() -> None:
    page_module().test_every_micro_batch_and_every_step_is_counted_once()


@pytest.mark.parametrize(
    "bug, message", [("LossWindowResetAtEpochEnd", "micro-batches"), ("EpochStepsFloor", "steps")]
)
def test_the_documented_property_catches_each_planted_bug(bug: str, message: str) -> None:
    page = page_module()
    planted = {"window": getattr(page, bug)} if "Window" in bug else {"epochs": getattr(page, bug)}

    @settings(max_examples=60, deadline=None)
    @given(config=loop_configs(), every=st.integers(1, 4))
    def prop(config: LoopConfig, every: int) -> None:
        page.check_counts(config, every, **planted)

    with pytest.raises(AssertionError) as caught:
        prop()
    assert str(caught.value).endswith(message)


def test_the_obvious_example_misses_both_bugs() -> None:  # what the page claims: one example run is not enough
    page = page_module()
    config = LoopConfig(10, 2, 1, 2, None, None)
    for window, epochs in ((page.LossWindowResetAtEpochEnd, page.EpochSteps), (page.LossWindow, page.EpochStepsFloor)):
        loss_window, epoch_steps = window(1), epochs()
        state = toy_engine(config, plugins=[loss_window, epoch_steps]).fit()
        assert sum(loss_window.covered) + loss_window.count == state.micro_steps
        assert sum(epoch_steps.windows) == state.global_step


class Counter(Plugin):
    def __init__(self) -> None:
        self.seen = 0

    def attach(self, engine: Any) -> None:
        self.on(engine, Event.STEP_END, self.step_end)

    def step_end(self, ev: Any) -> None:
        self.seen += 1


class CounterSavedNotLoaded(Counter):
    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen}


CONFIG = LoopConfig(12, 2, 1, 2, None, None)


@pytest.mark.parametrize(
    "plugin, remedy",
    [
        (Counter, r"Add 'seen' to Counter.state_dict\(\) and restore it in load_state_dict\(\); if it differs after a "
                  r"resume on purpose .* list it in Counter.not_resumed = \('seen',\) or pass "
                  r"ignore_attributes=\['Counter.seen'\]"),
        (CounterSavedNotLoaded, r"/plugins/CounterSavedNotLoaded/seen: resumed 0, uninterrupted 3. "
                                r"CounterSavedNotLoaded.state_dict\(\) gives another 'seen' after the resume: "
                                r"load_state_dict\(\) must restore"),
    ],
)  # fmt: skip
def test_a_resume_mismatch_names_the_attribute_and_the_remedy(plugin: type[Plugin], remedy: str) -> None:
    with pytest.raises(ResumeMismatch, match=remedy):
        check_resume_equivalence(lambda: toy_engine(CONFIG, plugins=[plugin()]), at=3)


def test_the_named_remedies_work() -> None:
    class Declared(Counter):
        not_resumed = ("seen",)

    check_resume_equivalence(lambda: toy_engine(CONFIG, plugins=[Declared()]), at=3)
    check_resume_equivalence(lambda: toy_engine(CONFIG, plugins=[Counter()]), at=3, ignore_attributes=["Counter.seen"])


def test_help_plugin_explains_not_resumed() -> None:
    text = pydoc.render_doc(Plugin, renderer=pydoc.plaintext)
    assert "not_resumed" in text and "differ after a resume on purpose" in text and "ignore_attributes" in text


class LogsEachStep(Plugin):
    def attach(self, engine: Any) -> None:
        self.on(engine, Event.STEP_END, lambda ev: ev.engine.log({"step": float(ev.engine.state.global_step)}))


def test_toy_engine_is_quiet_under_hypothesis(caplog: pytest.LogCaptureFixture) -> None:
    runs: list[int] = []

    @settings(max_examples=5, deadline=None)
    @given(loop_configs(max_steps=4, max_epochs=1, max_dataset_size=8))
    def prop(config: LoopConfig) -> None:
        state = toy_engine(config, plugins=[LogsEachStep()]).fit()
        assert len(state.log_history) == state.global_step  # the records are kept where tests read them
        runs.append(1)

    with caplog.at_level(logging.WARNING, logger="trainbus.engine"):
        prop()
    assert len(runs) >= 5 and not [r for r in caplog.records if "no LOG handler" in r.getMessage()]


def test_a_trace_error_says_what_breaks_the_grammar_and_what_to_do() -> None:
    from trainbus.engine.testing import EventRecorder, TraceError, check_trace

    recorder = EventRecorder()
    config = LoopConfig(8, 2, 1, 1, None, None)
    engine = toy_engine(config, plugins=[recorder], eval_data=[(torch.randn(2, 3), torch.randn(2, 1))])
    engine.on(Event.LOSS(once=2), lambda ev: ev.engine.evaluate())  # evaluate() in the middle of a window
    engine.fit()
    with pytest.raises(TraceError, match=r"event #\d+ is EVAL_START.*ask through engine.control instead "
                                         r"\(should_evaluate"):  # fmt: skip
        check_trace(recorder.names)
