"""fit, evaluate and predict always close: a failure anywhere fires EXCEPTION, then every END still
open (innermost first, ``payload.error`` set, to cleanup handlers), and the error reaches the caller."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbus.engine import ConfigError, Engine, Event, Plugin, Priority
from trainbus.engine.testing import EventRecorder, LoopConfig, check_trace, loop_configs, toy_data, toy_engine

STARTS = {"TRAIN_START": "TRAIN_END", "EPOCH_START": "EPOCH_END", "EVAL_START": "EVAL_END",
          "PREDICT_START": "PREDICT_END"}  # fmt: skip


class Injected(Exception):
    pass


class FailAt(Plugin):
    """Raises at the ``at``-th event fired (0-based), after the recorder saw it; never on the failure path."""

    priority = Priority.FIRST

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen = 0

    def attach(self, engine: Engine) -> None:
        for event in Event.ALL:
            if event is not Event.EXCEPTION:
                self.on(engine, event, self.maybe_fail)

    def maybe_fail(self, payload: Any) -> None:
        self.seen += 1
        if self.seen - 1 == self.at:
            raise Injected(f"injected at event #{self.at}")


class SideEffects(Plugin):
    """Asks for a log, an evaluation and a save every few steps, so fit's trace holds SIDE blocks."""

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.STEP_END, self.ask)

    def ask(self, ev: Any) -> None:
        step = ev.engine.state.global_step
        control = ev.engine.control
        control.should_log = step % 2 == 0
        control.should_evaluate = step % 3 == 0
        control.should_save = step % 4 == 0


def session(config: LoopConfig, plugins: list[Plugin]) -> None:
    """fit, then evaluate, then predict: every block kind, at the top and inside the run."""
    engine = toy_engine(config, plugins=[*plugins, SideEffects()], eval_data=toy_data(config, seed=1))
    engine.fit()
    engine.evaluate()
    engine.predict(toy_data(config, seed=2))


def open_ends(prefix: list[str]) -> list[str]:
    """The ENDs still open after ``prefix``, innermost first (a stack, independent of the grammar)."""
    stack: list[str] = []
    for name in prefix:
        if name in STARTS:
            stack.append(STARTS[name])
        elif stack and name == stack[-1]:
            stack.pop()
    return stack[::-1]


def check_failure_at(config: LoopConfig, clean: list[str], at: int) -> None:
    recorder = EventRecorder(keep_payloads=True)
    with pytest.raises(Injected) as caught:  # the injected error reaches the caller as itself
        session(config, [recorder, FailAt(at)])
    trace = recorder.names
    check_trace(trace)
    closing = open_ends(clean[: at + 1])
    assert trace == [*clean[: at + 1], "EXCEPTION", *closing]
    failure = recorder.payloads[at + 1]
    assert failure.error is caught.value
    assert all(end.error is caught.value for end in recorder.payloads[at + 2 :])


@settings(max_examples=25)
@given(config=loop_configs(max_dataset_size=12, max_steps=6, max_epochs=2), data=st.data())
def test_a_failure_at_any_event_closes_every_open_block(config: LoopConfig, data: st.DataObject) -> None:
    clean_recorder = EventRecorder()
    session(config, [clean_recorder])
    clean = clean_recorder.names
    check_trace(clean)
    check_failure_at(config, clean, data.draw(st.integers(0, len(clean) - 1), label="fail at event #"))


def test_a_failure_at_every_event_of_one_session_closes_every_open_block() -> None:
    config = LoopConfig(dataset_size=6, batch_size=2, accumulation_steps=2, max_epochs=2, max_steps=None,
                        stop_at_step=None)  # fmt: skip
    recorder = EventRecorder()
    session(config, [recorder])
    clean = recorder.names
    assert {"EVAL_START", "SAVE", "LOG", "PREDICT_END", "EPOCH_END"} <= set(clean)
    for at in range(len(clean)):
        check_failure_at(config, clean, at)


def small_engine(**kwargs: Any) -> Engine:
    config = LoopConfig(dataset_size=8, batch_size=2, accumulation_steps=1, max_epochs=1, max_steps=None,
                        stop_at_step=None)  # fmt: skip
    return toy_engine(config, eval_data=toy_data(config, seed=1), **kwargs)


def test_an_error_from_a_step_function_reaches_the_caller_unchanged_after_the_closing() -> None:
    error = RuntimeError("the forward ran out of memory")
    recorder = EventRecorder(keep_payloads=True)
    engine = small_engine(plugins=[recorder])

    def forward(model: torch.nn.Module, batch: Any) -> Any:
        if engine.state.global_step == 2:
            raise error
        return model(batch[0])

    engine.set_hook("forward", forward)
    with pytest.raises(RuntimeError) as caught:
        engine.fit()
    assert caught.value is error and not getattr(error, "__notes__", None)
    assert recorder.names[-4:] == ["BATCH_START", "EXCEPTION", "EPOCH_END", "TRAIN_END"]
    exception, epoch_end, train_end = recorder.payloads[-3:]
    assert (exception.error, exception.during) == (error, "fit")
    assert epoch_end.error is error and train_end.error is error
    assert engine.state.global_step == 2  # left at the last completed step


def test_only_cleanup_handlers_see_the_ends_of_a_failed_block() -> None:
    engine = small_engine()
    seen: list[tuple[str, bool]] = []
    for event in (Event.EPOCH_END, Event.TRAIN_END):
        engine.on(event, lambda ev, e=event.name: seen.append((e, False)))
        engine.on(event, lambda ev, e=event.name: seen.append((e, ev.error is not None)), cleanup=True)

    def explode(ev: Any) -> None:
        raise Injected("boom")

    engine.on(Event.STEP_END(once=2), explode)
    with pytest.raises(Injected, match="boom"):
        engine.fit()
    assert seen == [("EPOCH_END", True), ("TRAIN_END", True)]


def test_cleanup_is_only_for_the_events_that_close_a_block() -> None:
    with pytest.raises(ConfigError, match="cleanup=True is for the events that close a block"):
        small_engine().on(Event.STEP_END, lambda ev: None, cleanup=True)


def test_handlers_failing_while_closing_do_not_hide_the_original_error(caplog: pytest.LogCaptureFixture) -> None:
    engine = small_engine()
    ran: list[str] = []

    def fail(name: str) -> Any:
        def handler(ev: Any) -> None:
            ran.append(name)
            raise ValueError(f"{name} failed too")

        return handler

    engine.on(Event.EXCEPTION, fail("exception-handler"))
    engine.on(Event.EXCEPTION, lambda ev: ran.append("exception-second"))
    engine.on(Event.TRAIN_END, fail("train-end-cleanup"), cleanup=True)
    engine.on(Event.TRAIN_END, lambda ev: ran.append("train-end-second"), cleanup=True, priority=-5)
    original = Injected("the first failure")

    def explode(ev: Any) -> None:
        raise original

    engine.on(Event.STEP_START(once=3), explode)
    with pytest.raises(Injected) as caught:
        engine.fit()
    assert caught.value is original
    assert ran == ["exception-handler", "exception-second", "train-end-cleanup", "train-end-second"]
    notes = "\n".join(caught.value.__notes__)
    assert "exception-handler failed too" in notes and "train-end-cleanup failed too" in notes
    assert "a handler failed while EXCEPTION ran" in caplog.text


def test_an_end_handler_that_fails_still_lets_the_cleanup_handlers_after_it_run() -> None:
    engine = small_engine()
    ran: list[Any] = []

    def explode(ev: Any) -> None:
        raise Injected("metric exploded")

    engine.on(Event.EVAL_END, explode, priority=10)
    engine.on(Event.EVAL_END, lambda ev: ran.append("not cleanup"))
    engine.on(Event.EVAL_END, lambda ev: ran.append(ev.error), cleanup=True)
    engine.on(Event.EXCEPTION, lambda ev: ran.append(ev.during))
    with pytest.raises(Injected, match="metric exploded") as caught:
        engine.evaluate()
    assert ran == [caught.value, "evaluate"]  # the END's cleanup first, then EXCEPTION (the END had begun)


def test_a_failed_evaluation_inside_fit_is_announced_once_and_closes_outwards() -> None:
    recorder = EventRecorder(keep_payloads=True)
    engine = small_engine(plugins=[recorder])
    engine.on(Event.STEP_END(once=2), lambda ev: setattr(ev.engine.control, "should_evaluate", True))

    def explode(ev: Any) -> None:
        raise Injected("eval batch")

    engine.on(Event.EVAL_BATCH_END, explode)
    with pytest.raises(Injected, match="eval batch"):
        engine.fit()
    assert recorder.names[-5:] == ["EVAL_BATCH_END", "EXCEPTION", "EVAL_END", "EPOCH_END", "TRAIN_END"]
    assert recorder.payloads[-4].during == "evaluate" and engine.model.training  # train mode is back
    engine.fit()  # the engine is usable again: the next run starts clean
    check_trace(recorder.names[recorder.names.index("TRAIN_END") + 1 :])


def test_a_keyboard_interrupt_closes_too_and_is_not_wrapped() -> None:
    engine = small_engine()
    ends: list[Any] = []
    engine.on(Event.TRAIN_END, lambda ev: ends.append(ev.error), cleanup=True)

    def interrupt(ev: Any) -> None:
        raise KeyboardInterrupt

    engine.on(Event.STEP_END(once=1), interrupt)
    with pytest.raises(KeyboardInterrupt) as caught:
        engine.fit()
    assert ends == [caught.value]


def test_the_grammar_accepts_the_failure_paths_and_rejects_others() -> None:
    check_trace(["TRAIN_START", "EXCEPTION", "TRAIN_END"])
    check_trace(["TRAIN_START", "EPOCH_START", "STEP_START", "EXCEPTION", "EPOCH_END", "TRAIN_END"])
    check_trace(["EVAL_START", "EVAL_END", "EXCEPTION"])  # a handler of EVAL_END raised
    check_trace(["TRAIN_START", "EPOCH_START", "EPOCH_END", "EXCEPTION", "TRAIN_END", "PREDICT_START",
                 "PREDICT_END"])  # fmt: skip
    for bad, position in (
        (["EXCEPTION"], 0),
        (["TRAIN_START", "EPOCH_START", "EXCEPTION", "TRAIN_END"], 3),  # EPOCH_END skipped
        (["TRAIN_START", "EPOCH_START", "EXCEPTION", "EPOCH_END"], 4),  # TRAIN_END missing
        (["EVAL_START", "EXCEPTION", "EVAL_END", "EVAL_END"], 3),
    ):
        with pytest.raises(AssertionError) as caught:
            check_trace(bad)
        assert caught.value.position == position  # type: ignore[attr-defined]
