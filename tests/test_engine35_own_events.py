"""Events of your own (#35 item 3): define an EventType with its payload, fire it from a handler, attach
handlers with filters and ordering, on a bare Engine; the mistakes a user makes fail naming the remedy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from trainbus.engine import ConfigError, Engine, Event, EventType, LossEvent, Payload, Plugin, Priority
from trainbus.engine.testing import LoopConfig, check_resume_equivalence, toy_engine


@dataclass
class SpikeEvent(Payload):
    """Fires when a micro-batch's loss exceeds the running threshold."""

    loss: float
    micro_step: int


SPIKE = EventType("LOSS_SPIKE", SpikeEvent)


class SpikeDetector(Plugin):
    """Fires SPIKE from its LOSS handler (a user plugin; reads the loss on the host, fine for a test)."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.LOSS, self.loss)

    def loss(self, ev: LossEvent) -> None:
        value = float(ev.loss.detach())
        if value > self.threshold:
            ev.engine.fire(SPIKE, SpikeEvent(ev.engine, value, ev.engine.state.micro_steps))


class SpikeCounter(Plugin):
    """Counts every second spike, and says so after SpikeLog (declared, attached first)."""

    def __init__(self) -> None:
        self.counted: list[int] = []

    def attach(self, engine: Engine) -> None:
        self.on(engine, SPIKE(every=2), self.count, after="SpikeLog")

    def count(self, ev: SpikeEvent) -> None:
        self.counted.append(ev.micro_step)

    def state_dict(self) -> dict[str, Any]:
        return {"counted": list(self.counted)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counted = list(state["counted"])


class SpikeLog(Plugin):
    def __init__(self, order: list[str]) -> None:
        self.order = order

    def attach(self, engine: Engine) -> None:
        self.on(engine, SPIKE, self.record)

    def record(self, ev: SpikeEvent) -> None:
        self.order.append(f"log {ev.micro_step}")


def test_an_event_of_your_own_is_fired_filtered_and_ordered() -> None:
    order: list[str] = []
    counter = SpikeCounter()
    engine = toy_engine(LoopConfig(24, 4, 2, 2, None, None), plugins=[counter, SpikeDetector(0.0), SpikeLog(order)])
    early = engine.on(SPIKE, lambda ev: order.append(f"first {ev.micro_step}"), priority=Priority.FIRST, name="early")
    engine.fit()
    spikes = engine.state.event_counts["LOSS_SPIKE"]
    assert spikes == 12  # every micro-batch's loss is > 0: 6 batches x 2 epochs
    assert counter.counted == list(range(2, 13, 2))  # every=2 counts the event's own occurrences
    assert order[:4] == ["first 1", "log 1", "first 2", "log 2"]  # FIRST, then the DEFAULT phase
    assert engine.describe()["LOSS_SPIKE"] == ["early", "SpikeLog.record", "SpikeCounter.count"]
    early.remove()
    assert engine.describe()["LOSS_SPIKE"] == ["SpikeLog.record", "SpikeCounter.count"]


def test_the_issues_spelling_works_and_a_string_names_it() -> None:
    @dataclass
    class GapEvent(Payload):
        gap: float

    gap = EventType("GAP_35", GapEvent, 20)  # the issue passed an index: the slot is assigned anyway
    engine = Engine(torch.nn.Linear(1, 1))
    seen: list[float] = []
    engine.on("GAP_35", lambda ev: seen.append(ev.gap))
    assert engine.fire(gap, GapEvent(engine, 0.5)).gap == 0.5
    assert seen == [0.5] and engine.state.event_counts["GAP_35"] == 1
    assert repr(gap) == "EventType('GAP_35', GapEvent)"


def test_a_fired_event_without_handlers_is_counted() -> None:
    engine = Engine(torch.nn.Linear(1, 1))
    engine.fire(SPIKE, SpikeEvent(engine, 1.0, 0))
    assert engine.state.event_counts["LOSS_SPIKE"] == 1


def test_a_handlers_error_names_the_event_of_your_own() -> None:
    engine = Engine(torch.nn.Linear(1, 1))
    engine.on(SPIKE, lambda ev: 1 / 0, name="divide")
    with pytest.raises(ZeroDivisionError) as caught:
        engine.fire(SPIKE, SpikeEvent(engine, 1.0, 0))
    assert caught.value.trainbus_event == "LOSS_SPIKE" and caught.value.trainbus_handler == "divide"  # type: ignore[attr-defined]


def test_filter_counts_survive_a_resume() -> None:
    config = LoopConfig(24, 4, 1, 2, None, None)
    check_resume_equivalence(lambda: toy_engine(config, plugins=[SpikeDetector(0.0), SpikeCounter()]), at=5)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: EventType("LOSS", SpikeEvent), "is the loop's own Event.LOSS; give your event another name"),
        (lambda: EventType("X_35", 5), "needs the payload's class"),
        (lambda: EventType("not a name", SpikeEvent), "must be an identifier"),
        (lambda: EventType("X_35", SpikeEvent, "20"), "leave the index out"),
    ],
)
def test_defining_an_event_wrongly_says_how_to_do_it(make: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make()


def test_an_index_is_a_slot_and_a_name_may_be_defined_again() -> None:
    """Modules that each define their events (tests, libraries) do not collide: a passed index is ignored, and a
    second event of a name (another payload class) takes the name for string lookups, the first still works."""

    @dataclass
    class OtherSpike(Payload):
        level: int

    first = EventType("SHARED_35", SpikeEvent, 3)  # 3 is BATCH_START's: ignored
    second = EventType("SHARED_35", OtherSpike, 3)
    assert first is not second and first.index not in (3, second.index) and second.index != 3
    engine = Engine(torch.nn.Linear(1, 1))
    seen: list[str] = []
    engine.on(first, lambda ev: seen.append("first"))
    engine.on("SHARED_35", lambda ev: seen.append("second"))
    engine.fire(first, SpikeEvent(engine, 1.0, 0))
    engine.fire(second, OtherSpike(engine, 1))
    assert seen == ["first", "second"]


def test_firing_wrongly_says_how_to_do_it() -> None:
    engine = Engine(torch.nn.Linear(1, 1))
    with pytest.raises(ConfigError, match="fired by the loop only; define an event of your own"):
        engine.fire(Event.LOSS, SpikeEvent(engine, 1.0, 0))
    with pytest.raises(ConfigError, match=r"carries a SpikeEvent, got LossEvent"):
        engine.fire(SPIKE, LossEvent(engine, None, None, torch.zeros(()), 0, 1))
    with pytest.raises(ConfigError, match=r"did you mean .LOSS_SPIKE.*events of your own: .*LOSS_SPIKE"):
        engine.on("LOSS_SPIKY", print)


def test_the_documented_example_runs() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs/events.md").read_text(encoding="utf-8")
    section = page[page.index("## Events of your own") : page.index("## Hooks")]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert "engine.fire(SPIKE" in code and "SPIKE(every=2)" in code and "before=" in code
    import sys
    import types

    module = types.ModuleType("docs_events_example")  # dataclasses look their module up in sys.modules
    sys.modules[module.__name__] = module
    try:
        exec(compile(code, "docs/events.md", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]


def test_the_fire_doctest() -> None:
    import doctest

    from trainbus.engine import assembly

    assert doctest.testmod(assembly).failed == 0


def test_the_issues_inline_spelling_gives_one_event() -> None:
    """``engine.on(EventType("SPIKE", SpikeEvent, 20), fn)`` and a fire with another ``EventType(...)`` of the same
    name and payload class reach the same handlers: making an event again gives the same object."""
    engine = Engine(torch.nn.Linear(1, 1))
    seen: list[float] = []
    engine.on(EventType("LOSS_SPIKE", SpikeEvent, 20), lambda ev: seen.append(ev.loss))
    engine.fire(EventType("LOSS_SPIKE", SpikeEvent), SpikeEvent(engine, 3.0, 1))
    assert seen == [3.0] and EventType("LOSS_SPIKE", SpikeEvent) is SPIKE
