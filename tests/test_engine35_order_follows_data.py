"""Order follows the data (#35 item 1): a handler declares what it reads and writes on a payload, and every
writer of a field runs before every other reader of it, whatever order the plugins were listed in. A cycle
or an unsatisfiable declaration is a ConfigError naming both handlers. The issue's composition logs its
evaluation in every plugin order (tests/test_engine35_permutations.py runs whole compositions permuted)."""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from ignite.metrics import Accuracy

from trainbus.engine import ConfigError, Engine, EvalEndEvent, Event, EventBus, Plugin, Priority
from trainbus.plugins import EvalCollector, IgniteMetrics, TrainLogger


def noop(ev: Any) -> None:
    pass




@settings(max_examples=60, deadline=None)
@given(st.permutations(range(5)))
def test_writers_run_before_readers_in_any_registration_order(order: list[int]) -> None:
    specs: list[tuple[str, dict[str, Any]]] = [
        ("collector", {"writes": "metrics"}),
        ("ignite", {"writes": "metrics.eval_accuracy"}),
        ("derived", {"reads": "metrics.eval_loss", "writes": "metrics.eval_derived"}),
        ("logger", {"reads": "metrics"}),
        ("unrelated", {}),
    ]
    bus = EventBus()
    for i in order:
        name, declared = specs[i]
        bus.on(Event.EVAL_END, noop, name=name, **declared)
    position = {name: i for i, name in enumerate(bus.handler_names(Event.EVAL_END))}
    assert position["collector"] < position["derived"] < position["logger"]  # collector writes all of metrics
    assert position["ignite"] < position["logger"]
    # ignite writes eval_accuracy, which derived does not read: no order between them is required


def test_a_cycle_names_both_handlers_and_registers_nothing() -> None:
    bus = EventBus()
    bus.on(Event.EVAL_END, noop, name="A.swap", reads="metrics.eval_b", writes="metrics.eval_a")
    with pytest.raises(ConfigError, match="cycle") as caught:
        bus.on(Event.EVAL_END, noop, name="B.swap", reads="metrics.eval_a", writes="metrics.eval_b")
    assert "'A.swap' writes 'metrics.eval_a', which 'B.swap' reads" in str(caught.value)
    assert "'B.swap' writes 'metrics.eval_b', which 'A.swap' reads" in str(caught.value)
    assert bus.handler_names(Event.EVAL_END) == ["A.swap"]


def test_a_reader_in_an_earlier_phase_than_its_writer_names_both() -> None:
    bus = EventBus()
    bus.on(Event.EVAL_END, noop, name="Sink.read", reads="metrics", priority=Priority.PRODUCER)
    with pytest.raises(ConfigError, match=r"'Late.add' writes 'metrics', which 'Sink.read' reads, but 'Late.add' runs "
                                          r"in Priority.CONSUMER, after 'Sink.read' in Priority.PRODUCER"):  # fmt: skip
        bus.on(Event.EVAL_END, noop, name="Late.add", writes="metrics", priority=Priority.CONSUMER)


def test_a_field_the_payload_lacks_is_refused_naming_the_fields() -> None:
    with pytest.raises(ConfigError, match=r"'metric' is no field of its payload EvalEndEvent; did you mean 'metrics'"):
        EventBus().on(Event.EVAL_END, noop, reads="metric")


def test_a_plugin_declares_per_method_and_the_declaration_orders_it() -> None:
    class Derived(Plugin):
        reads: ClassVar[dict[str, str]] = {"eval_end": "metrics.eval_loss"}
        writes: ClassVar[dict[str, str]] = {"eval_end": "metrics.eval_perplexity"}
        priority = Priority.PRODUCER

        def attach(self, engine: Engine) -> None:
            self.on(engine, Event.EVAL_END, self.eval_end)

        def eval_end(self, ev: EvalEndEvent) -> None:
            ev.metrics["eval_perplexity"] = float(torch.tensor(ev.metrics["eval_loss"]).exp())

    for plugins in itertools.permutations([Derived(), EvalCollector()]):
        engine = issue_engine(list(plugins))
        assert "eval_perplexity" in engine.evaluate()


def issue_engine(plugins: list[Plugin]) -> Engine:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 3)
    data = [(torch.randn(4, 2), torch.tensor([0, 1, 2, 0])) for _ in range(3)]
    return Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, eval_data=data, max_epochs=1,
                  loss_fn=torch.nn.CrossEntropyLoss(), plugins=plugins)  # fmt: skip


TIMING = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))), ids=str)
def test_the_issues_composition_logs_its_evaluation_in_every_order(order: tuple[int, ...]) -> None:
    made = [TrainLogger(), EvalCollector(), IgniteMetrics({"accuracy": Accuracy()})]
    engine = issue_engine([made[i] for i in order])
    engine.on(Event.EVAL_END, lambda ev: ev.metrics.update(eval_user=1.0), name="user_metric")  # undeclared, DEFAULT
    engine.on(Event.EVAL_END, lambda ev: ev.metrics.update(eval_early=2.0), name="early", priority=Priority.PRODUCER)
    metrics = engine.evaluate()
    (record,) = engine.state.log_history
    assert {k: v for k, v in record.items() if k not in TIMING} == {
        "eval_loss": pytest.approx(metrics["eval_loss"]), "eval_accuracy": metrics["eval_accuracy"],
        "eval_user": 1.0, "eval_early": 2.0, "epoch": 0.0, "step": 0,
    }  # fmt: skip


def test_a_writer_after_the_logger_is_refused_naming_both() -> None:
    engine = issue_engine([TrainLogger(), EvalCollector()])
    with pytest.raises(ConfigError, match=r"'late' writes 'metrics', which 'TrainLogger.eval_end' reads"):
        engine.on(Event.EVAL_END, noop, name="late", writes="metrics", priority=Priority.CONSUMER)


FIELDS = ("metrics", "metrics.eval_a", "metrics.eval_b", "dataloader")


@st.composite
def declared_handlers(draw: st.DrawFn) -> list[tuple[str, int, tuple[str, ...], tuple[str, ...]]]:
    """Up to 5 handlers in two phases, each reading and writing a few of FIELDS."""
    count = draw(st.integers(1, 5))
    fields = st.lists(st.sampled_from(FIELDS), max_size=2, unique=True).map(tuple)
    phases = st.sampled_from((Priority.PRODUCER, Priority.DEFAULT))
    return [(f"H{i}", draw(phases), draw(fields), draw(fields)) for i in range(count)]


def register(specs: list[tuple[str, int, tuple[str, ...], tuple[str, ...]]], order: list[int]) -> list[str] | None:
    """The call order after registering ``specs`` in ``order``; None when a registration raised."""
    bus = EventBus()
    try:
        for i in order:
            name, phase, reads, writes = specs[i]
            bus.on(Event.EVAL_END, noop, name=name, priority=phase, reads=reads, writes=writes)
    except ConfigError:
        return None
    return bus.handler_names(Event.EVAL_END)


def overlapping(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


@settings(max_examples=200, deadline=None)
@given(declared_handlers(), st.data())
def test_any_registration_order_keeps_every_writer_before_its_readers(specs: Any, data: st.DataObject) -> None:
    """Registered in two orders: both raise or neither; when neither, each writer precedes each other reader of
    what it writes in both (phases permitting), so a composition's data flow does not depend on its list order."""
    first = register(specs, data.draw(st.permutations(range(len(specs)))))
    second = register(specs, data.draw(st.permutations(range(len(specs)))))
    assert (first is None) == (second is None)
    for order in (first, second):
        if order is None:
            continue
        position = {name: i for i, name in enumerate(order)}
        for writer, _, _, writes in specs:
            for reader, _, reads, _ in specs:
                if writer != reader and any(overlapping(w, r) for w in writes for r in reads):
                    assert position[writer] < position[reader], (writer, reader, order)
