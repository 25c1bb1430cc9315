"""The event bus: filters, ordering, handles, errors (invariant 5 and issue 2's done-list)."""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import ConfigError, Engine, Event, EventBus, EventFilter, Priority
from trainbus.engine.testing import LoopConfig, toy_engine

filter_args = st.fixed_dictionaries(
    {},
    optional={
        "every": st.integers(1, 7),
        "once": st.integers(1, 20),
        "before": st.integers(0, 20),
        "after": st.integers(0, 20),
    },
).filter(bool)


def reference(
    n: int, every: int | None = None, once: int | None = None, before: int | None = None, after: int | None = None
) -> bool:
    return (
        (every is None or n % every == 0)
        and (once is None or n == once)
        and (before is None or n < before)
        and (after is None or n > after)
    )


@given(filter_args, filter_args, st.integers(1, 30))
def test_filters_fire_exactly_where_the_reference_predicate_says(
    a: dict[str, int], b: dict[str, int], fires: int
) -> None:
    bus = EventBus()
    seen_a: list[int] = []
    seen_or: list[int] = []
    seen_and: list[int] = []
    bus.on(Event.STEP_END(**a), lambda ev: seen_a.append(bus.counts["STEP_END"]))
    bus.on(Event.STEP_END(**a) | Event.STEP_END(**b), lambda ev: seen_or.append(bus.counts["STEP_END"]))
    bus.on(Event.STEP_END(**a) & Event.STEP_END(**b), lambda ev: seen_and.append(bus.counts["STEP_END"]))
    for _ in range(fires):
        bus.fire(Event.STEP_END, None)
    ns = range(1, fires + 1)
    assert seen_a == [n for n in ns if reference(n, **a)]
    assert seen_or == [n for n in ns if reference(n, **a) or reference(n, **b)]
    assert seen_and == [n for n in ns if reference(n, **a) and reference(n, **b)]


def test_predicate_filter_sees_the_payload() -> None:
    config = LoopConfig(12, 2, 1, 2, None, None)
    engine = toy_engine(config)
    seen: list[int] = []
    engine.on(
        Event.STEP_END(when=lambda ev: ev.engine.state.global_step % 4 == 1),
        lambda ev: seen.append(ev.engine.state.global_step),
    )
    engine.fit()
    assert seen == [1, 5, 9]


@given(st.lists(st.tuples(st.integers(-3, 3), st.booleans()), min_size=1, max_size=12), st.data())
def test_priority_then_registration_order_and_removal(specs: list[tuple[int, bool]], data: st.DataObject) -> None:
    bus = EventBus()
    calls: list[int] = []
    handles = []
    for i, (priority, _) in enumerate(specs):
        handles.append(bus.on(Event.LOSS, lambda ev, i=i: calls.append(i), priority=priority))
    removed = {i for i, (_, remove) in enumerate(specs) if remove}
    for i in removed:
        handles[i].remove()
        handles[i].remove()  # removing twice is harmless
    for _ in range(data.draw(st.integers(1, 3))):
        calls.clear()
        bus.fire(Event.LOSS, None)
        expected = sorted((i for i in range(len(specs)) if i not in removed), key=lambda i: (-specs[i][0], i))
        assert calls == expected
    assert all(not handles[i].active for i in removed)


def test_handle_as_context_manager_removes_on_exit() -> None:
    bus = EventBus()
    calls: list[str] = []
    with bus.on(Event.SAVE, lambda ev: calls.append("x")):
        bus.fire(Event.SAVE, None)
    bus.fire(Event.SAVE, None)
    assert calls == ["x"]


def test_a_handler_removed_during_dispatch_still_lets_the_current_round_finish() -> None:
    bus = EventBus()
    calls: list[str] = []
    second = None

    def first(ev: object) -> None:
        calls.append("first")
        assert second is not None
        second.remove()

    bus.on(Event.LOG, first, priority=1)
    second = bus.on(Event.LOG, lambda ev: calls.append("second"))
    bus.fire(Event.LOG, None)
    bus.fire(Event.LOG, None)
    assert calls == ["first", "second", "first"]


def test_handler_error_names_the_handler_and_the_event_and_keeps_state_consistent() -> None:
    config = LoopConfig(20, 2, 2, 2, None, None)
    engine = toy_engine(config)

    def explode_at_step_three(ev) -> None:  # type: ignore[no-untyped-def]
        if ev.engine.state.global_step == 2:
            raise RuntimeError("boom")

    engine.on(Event.LOSS, explode_at_step_three, name="exploder")
    with pytest.raises(RuntimeError, match="boom") as info:  # the handler's own exception (#28 item 3)
        engine.fit()
    assert info.value.trainbus_handler == "exploder" and info.value.trainbus_event == "LOSS"  # type: ignore[attr-defined]
    if sys.version_info >= (3, 11):
        assert info.value.__notes__ == ["raised by handler 'exploder' at event LOSS"]
    state = engine.state
    assert state.global_step == 2 and state.batches_in_epoch == 4
    assert all(p.grad is None for p in engine.model.parameters())  # no half window left behind


def test_trace_records_who_ran_at_which_event() -> None:
    engine = toy_engine(LoopConfig(4, 2, 1, 1, None, None), trace=True)
    engine.on(Event.STEP_END, lambda ev: None, name="mine", priority=Priority.CONSUMER)
    engine.fit()
    assert engine.bus.trace == [("STEP_END", "mine"), ("STEP_END", "mine")]


def test_trace_switched_on_and_off_after_registration() -> None:
    bus = EventBus()
    bus.on(Event.STEP_END, lambda ev: None, name="only")  # a lone handler: the bus calls it directly
    bus.fire(Event.STEP_END, None)
    trace = bus.enable_trace()
    bus.fire(Event.STEP_END, None)
    bus.trace = None
    bus.fire(Event.STEP_END, None)
    assert trace == [("STEP_END", "only")]
    assert bus.counts["STEP_END"] == 3


@pytest.mark.parametrize("handlers", [1, 2])  # one handler has its own caller; several share the loop
def test_handler_failures_reach_the_caller_as_themselves_with_one_or_several_handlers(handlers: int) -> None:
    def fail_with(exc: Exception):  # type: ignore[no-untyped-def]
        def handler(ev: object) -> None:
            raise exc

        return handler

    for exc in [RuntimeError("boom"), ConfigError("bad value")]:
        bus = EventBus()
        for _ in range(handlers - 1):
            bus.on(Event.LOG, lambda ev: None, priority=1)
        bus.on(Event.LOG, fail_with(exc), name="failing")
        with pytest.raises(type(exc)) as info:
            bus.fire(Event.LOG, None)
        assert info.value is exc and exc.trainbus_handler == "failing"  # type: ignore[attr-defined]
        if sys.version_info >= (3, 11):
            assert exc.__notes__ == ["raised by handler 'failing' at event LOG"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: Event.STEP_END(every=0), "every must be an integer >= 1, got 0"),
        (lambda: Event.STEP_END(once=-2), "once must be an integer >= 1, got -2"),
        (lambda: EventFilter.make(), "needs at least one of every, once"),
        (lambda: EventBus().on("STEP_ENDD", lambda ev: None), "unknown event 'STEP_ENDD'; did you mean 'STEP_END'"),
        (lambda: EventBus().on(42, lambda ev: None), "cannot register a handler for 42"),  # type: ignore[call-overload]
        (lambda: EventBus().on(Event.LOG, "not callable"), "must be callable"),  # type: ignore[arg-type]
        (lambda: Event.LOG(every=2) | Event.SAVE(every=2), "different events"),  # type: ignore[operator]
    ],
)
def test_bad_registrations_fail_with_a_message_naming_the_value(make, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_epochs": 0}, "max_epochs must be an integer >= 1, got 0"),
        ({"max_steps": -1}, "max_steps must be an integer >= 1, got -1"),
        ({"max_epochs": None}, "set max_epochs or max_steps"),
        ({"train_data": []}, "train_data is empty"),
        ({"max_epochs": 2.5}, "max_epochs must be an integer >= 1, got 2.5"),
    ],
)
def test_bad_engine_configuration_fails_at_construction(kwargs: dict[str, object], message: str) -> None:
    model = torch.nn.Linear(3, 1)
    args: dict[str, object] = {"train_data": [(torch.randn(2, 3), torch.randn(2, 1))], "max_epochs": 1}
    args.update(kwargs)
    with pytest.raises(ConfigError, match=message):
        Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), **args)  # type: ignore[arg-type]


def test_accumulation_steps_must_be_positive() -> None:
    engine = toy_engine(LoopConfig(4, 2, 1, 1, None, None))
    with pytest.raises(ConfigError, match="accumulation_steps must be an integer >= 1, got 0"):
        engine.accumulation_steps = 0


def test_config_errors_from_handlers_keep_their_type_and_name_the_handler() -> None:
    bus = EventBus()

    def strict(ev: object) -> None:
        raise ConfigError("metric 'acc' is not among the keys ['eval_loss']")

    bus.on(Event.EVAL_END, strict, name="checker")
    with pytest.raises(ConfigError, match="metric 'acc'") as info:
        bus.fire(Event.EVAL_END, None)
    if sys.version_info >= (3, 11):  # exception notes are 3.11+
        assert any("checker" in note and "EVAL_END" in note for note in info.value.__notes__)
