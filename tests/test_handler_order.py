"""Declared handler order (issue 24 item 2): phases, before / after, "*", late targets, errors, describe()."""

from __future__ import annotations

import copy
import itertools
import pickle
from pathlib import Path
from typing import Any

import pytest
from facade_helpers import Regressor, quiet_args, regression_data
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbus.engine import ConfigError, Engine, Event, EventBus, Plugin, Priority
from trainbus.engine.bus import Order
from trainbus.engine.testing import LoopConfig, toy_engine

PHASES = (Priority.PRODUCER, Priority.DEFAULT)


def noop(payload: Any) -> None:
    pass


# -- the reference: the smallest registration-order sequence among the orders that keep every constraint --
Spec = tuple[str, int, tuple[str, ...], tuple[str, ...]]  # name, phase, before, after


def names(target: str, name: str) -> bool:
    return name == target or name.startswith(target + ".")


def keeps(order: tuple[Spec, ...]) -> bool:
    position = {spec[0]: i for i, spec in enumerate(order)}
    for name, _, before, after in order:
        for target in before:
            if any(names(target, other) and position[other] < position[name] for other in position if other != name):
                return False
        for target in after:
            if any(names(target, other) and position[other] > position[name] for other in position if other != name):
                return False
    phases = [spec[1] for spec in order]
    return phases == sorted(phases, reverse=True)


def reference(specs: list[Spec]) -> list[str] | None:
    """Brute force: the valid order whose registration indices are lexicographically smallest; None if none."""
    valid = (order for order in itertools.permutations(specs) if keeps(order))
    best = min(valid, key=lambda order: [specs.index(spec) for spec in order], default=None)
    return None if best is None else [spec[0] for spec in best]


@st.composite
def registrations(draw: st.DrawFn) -> list[Spec]:
    """Up to 6 handlers of three 'plugins' in two phases, each naming a few others or a plugin, in any order."""
    count = draw(st.integers(1, 6))
    labels = [f"P{draw(st.integers(0, 2))}.h{i}" for i in range(count)]
    targets = st.sampled_from([*labels, "P0", "P1", "P2", "Nobody"])
    specs = [
        (
            label,
            draw(st.sampled_from(PHASES)),
            tuple(draw(st.lists(targets, max_size=2))),
            tuple(draw(st.lists(targets, max_size=1))),
        )
        for label in labels
    ]
    return draw(st.permutations(specs))


@settings(max_examples=300, deadline=None)
@given(registrations(), st.data())
def test_the_order_keeps_every_constraint_and_is_otherwise_registration_order(
    specs: list[Spec], data: st.DataObject
) -> None:
    """In any registration order (targets registered late included) the bus orders as the brute force does;
    a registration that leaves no valid order raises, registers nothing, and names the handlers."""
    bus = EventBus()
    registered: list[Spec] = []
    handles = {}
    for spec in specs:
        name, phase, before, after = spec
        expected = reference([*registered, spec])
        if expected is None:
            with pytest.raises(ConfigError, match=r"cannot hold|cycle") as info:
                bus.on(Event.LOSS, noop, priority=phase, name=name, before=before, after=after)
            assert repr(name) in str(info.value)  # any new edge, so any cycle, involves the new handler
            assert bus.handler_names(Event.LOSS) == reference(registered)
            continue
        handles[name] = bus.on(Event.LOSS, noop, priority=phase, name=name, before=before, after=after)
        registered.append(spec)
        assert bus.handler_names(Event.LOSS) == expected
    if registered:  # removing one drops its constraints; the others still hold
        gone = data.draw(st.sampled_from(registered))
        handles[gone[0]].remove()
        registered.remove(gone)
        assert bus.handler_names(Event.LOSS) == reference(registered)


@given(st.lists(st.sampled_from(PHASES), max_size=8))
def test_without_constraints_phases_then_registration_order(phases: list[int]) -> None:
    bus = EventBus()
    for i, phase in enumerate(phases):
        bus.on(Event.LOSS, noop, priority=phase, name=f"h{i}")
    expected = sorted(range(len(phases)), key=lambda i: -phases[i])
    assert bus.handler_names(Event.LOSS) == [f"h{i}" for i in expected]


def test_a_cycle_raises_naming_both_handlers_and_registers_nothing() -> None:
    bus = EventBus()
    bus.on(Event.LOG, noop, name="A.fill", before="B.read")
    with pytest.raises(ConfigError) as info:
        bus.on(Event.LOG, noop, name="B.read", before="A")
    message = str(info.value)
    assert "cycle" in message and "'A.fill' before 'B.read'" in message and "'B.read' before 'A.fill'" in message
    assert "LOG" in message and bus.handler_names(Event.LOG) == ["A.fill"]


def test_a_longer_cycle_is_named_in_full() -> None:
    bus = EventBus()
    bus.on(Event.LOG, noop, name="a", before="b")
    bus.on(Event.LOG, noop, name="b", before="c")
    with pytest.raises(ConfigError) as info:
        bus.on(Event.LOG, noop, name="c", before="a")
    for step in ("'a' before 'b'", "'b' before 'c'", "'c' before 'a' ('c' says before='a')"):
        assert step in str(info.value)


def test_a_later_phase_cannot_run_before_an_earlier_one() -> None:
    bus = EventBus()
    bus.on(Event.LOG, noop, priority=Priority.PRODUCER, name="Logger.fill")
    with pytest.raises(ConfigError) as info:
        bus.on(Event.LOG, noop, priority=Priority.CONSUMER, name="Sink.write", before="Logger")
    message = str(info.value)
    assert "'Sink.write' says before='Logger'" in message and "Priority.CONSUMER" in message
    assert "'Logger.fill' in Priority.PRODUCER" in message
    # the same constraint across phases the right way holds already and changes nothing
    bus.on(Event.LOG, noop, priority=Priority.FIRST, name="Keeper.keep", before="Logger")
    bus.on(Event.LOG, noop, priority=Priority.CONSUMER, name="Sink.write", after="Logger")
    assert bus.handler_names(Event.LOG) == ["Keeper.keep", "Logger.fill", "Sink.write"]


def test_a_target_registered_later_is_ordered_when_it_appears() -> None:
    bus = EventBus()
    bus.on(Event.EVAL_END, noop, name="EMA.restore", after="HalfPrecisionEval")
    bus.on(Event.EVAL_END, noop, name="Other.read")
    assert bus.handler_names(Event.EVAL_END) == ["EMA.restore", "Other.read"]  # nothing to follow yet
    bus.on(Event.EVAL_END, noop, name="HalfPrecisionEval.restore")
    assert bus.handler_names(Event.EVAL_END) == ["Other.read", "HalfPrecisionEval.restore", "EMA.restore"]


def test_star_is_every_other_handler_of_the_phase() -> None:
    bus = EventBus()
    bus.on(Event.TRAIN_END, noop, priority=Priority.FIRST, name="early")
    bus.on(Event.TRAIN_END, noop, priority=Priority.LAST, name="x.one")
    bus.on(Event.TRAIN_END, noop, priority=Priority.LAST, name="Lock.release", after="*")
    bus.on(Event.TRAIN_END, noop, priority=Priority.LAST, name="Signals.finish", after=["*", "Lock"])
    bus.on(Event.TRAIN_END, noop, priority=Priority.LAST, name="x.two")
    bus.on(Event.TRAIN_END, noop, priority=Priority.LAST, name="x.three", after="Lock")  # explicit beats "*"
    assert bus.handler_names(Event.TRAIN_END) == [
        "early",
        "x.one",
        "x.two",
        "Lock.release",
        "x.three",
        "Signals.finish",
    ]
    # Lock.release follows x.four (by "*"), Signals.finish follows Lock: x.four cannot follow Signals
    with pytest.raises(ConfigError, match=r"cycle.*'x\.four' says after='Signals'"):
        bus.on(Event.TRAIN_END, noop, priority=Priority.LAST, name="x.four", after="Signals")
    # two handlers saying "*" the same way keep registration order between them
    bus.on(Event.STEP_START, noop, priority=Priority.FIRST, name="x")
    bus.on(Event.STEP_START, noop, priority=Priority.FIRST, name="Modes.step_start", before="*")
    bus.on(Event.STEP_START, noop, priority=Priority.FIRST, name="resume.restore_rng", before="*")
    bus.on(Event.STEP_START, noop, priority=Priority.PRODUCER, name="producer", after="*")
    assert bus.handler_names(Event.STEP_START) == ["Modes.step_start", "resume.restore_rng", "x", "producer"]


def test_phases_are_ints_with_names_and_orders_compose() -> None:
    assert Priority.FIRST == 1000 and Priority.CONSUMER < Priority.DEFAULT < Priority.PRODUCER
    assert repr(Priority.LAST) == "Priority.LAST"
    order = Priority.CONSUMER.after("Checkpointing").before("*")
    assert (order.phase, order.precedes, order.follows) == (-100, ("*",), ("Checkpointing",))
    assert repr(order) == "Priority.CONSUMER.before('*').after('Checkpointing')"
    assert order == Order(Priority.CONSUMER, "*", "Checkpointing")
    for value in (Priority.LAST, order):  # plugins holding them can be copied and pickled
        assert copy.deepcopy(value) == value and pickle.loads(pickle.dumps(value)) == value
    assert repr(copy.deepcopy(Priority.LAST)) == "Priority.LAST"
    bus = EventBus()
    for bad in ({"priority": 1.5}, {"priority": True}, {"before": [""]}, {"after": [3]}):
        with pytest.raises(ConfigError):
            bus.on(Event.LOG, noop, **bad)
    assert not bus.has_handlers(Event.LOG)


class Keeper(Plugin):
    """A plugin whose every handler runs first in its phase, as a class attribute declares."""

    priority = Priority.CONSUMER.before("*")

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.EVAL_END, self.keep)
        self.on(engine, Event.TRAIN_END, self.done, after="Reader")

    def keep(self, payload: Any) -> None:
        pass

    def done(self, payload: Any) -> None:
        pass


class Reader(Plugin):
    priority = Priority.CONSUMER

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.EVAL_END, self.read)
        self.on(engine, Event.TRAIN_END, self.read)

    def read(self, payload: Any) -> None:
        pass


def test_a_plugin_declares_its_order_once_and_others_name_it() -> None:
    engine = toy_engine(LoopConfig(4, 2, 1, 1, None, None))
    engine.add_plugin(Reader())
    engine.add_plugin(Keeper())
    order = engine.describe()
    assert order["EVAL_END"] == ["Keeper.keep", "Reader.read"]
    # Keeper.done says both "*" (before, from the class) and after="Reader": the explicit one wins
    assert order["TRAIN_END"] == ["Reader.read", "Keeper.done"]


def test_a_plugin_whose_order_cannot_hold_is_not_attached() -> None:
    class Early(Plugin):
        priority = Priority.PRODUCER

        def attach(self, engine: Engine) -> None:
            self.on(engine, Event.EVAL_START, self.go)
            self.on(engine, Event.EVAL_END, self.go, after="Reader")  # Reader is a CONSUMER: cannot hold

        def go(self, payload: Any) -> None:
            pass

    engine = toy_engine(LoopConfig(4, 2, 1, 1, None, None))
    engine.add_plugin(Reader())
    with pytest.raises(ConfigError, match=r"'Early\.go' says after='Reader'"):
        engine.add_plugin(Early())
    assert engine.describe() == {"EVAL_END": ["Reader.read"], "TRAIN_END": ["Reader.read"]}
    assert engine.get_plugin("Early", None) is None


def test_describe_lists_events_in_loop_order_and_leaves_out_the_silent_ones() -> None:
    engine = toy_engine(LoopConfig(4, 2, 1, 1, None, None))
    engine.on(Event.TRAIN_END, noop, name="z")
    engine.on(Event.TRAIN_START, noop, name="a")
    engine.on(Event.TRAIN_START, noop, name="b", before="a")
    assert engine.describe() == {"TRAIN_START": ["b", "a"], "TRAIN_END": ["z"]}
    assert engine.describe() == engine.bus.describe()


#: the default Trainer's handlers, in the order they run, for eval / save / logging every 2 steps,
#: clipping and accumulation 2 (changing a plugin's order, or adding a handler, shows up here)
TRAINER_ORDER = {
    "TRAIN_START": [
        "ScheduleFreeModes.train_start",
        "Checkpointing._claim_run",
        "Preemption.install",
        "TrainLogger.train_start",
        "GradientAccumulation.train_start",
        "LRScheduler.build",
        "FlowControl.train_start",
        "Trainer.loss_protocol",  # a STEP_START handler for this run only where the loss may come back normalised
        "CallbackAdapter.on_train_begin",
        "ResumableData._check_data",
        "GradientClipping.collect",
    ],
    "EPOCH_START": ["CallbackAdapter.on_epoch_begin"],
    "STEP_START": ["GradientAccumulation.step_start"],
    "LOSS": ["GradientAccumulation.scale_loss", "TrainLogger.loss"],
    "BEFORE_OPTIMIZER_STEP": ["GradientClipping.clip"],
    "OPTIMIZER_STEP": ["LRScheduler.optimizer_step"],
    "STEP_END": ["FlowControl.step_end"],  # Preemption.step_end only under several processes
    "LOG": ["TrainLogger.fill", "TrainLogger.record", "Printer.write", "CallbackAdapter.log"],
    "EVAL_START": [
        "ScheduleFreeModes.evaluation_start",
        "ResumableData._eval_start",
        "EvalCollector.eval_start",
        "CallbackAdapter.eval_start",
    ],
    "EVAL_BATCH_END": ["EvalCollector.eval_batch_end", "CallbackAdapter.on_prediction_step"],
    "EVAL_END": ["EvalCollector.eval_end", "TrainLogger.eval_end", "CallbackAdapter.evaluate"],
    "SAVE": ["TrainLogger.hold_window", "Checkpointing.save", "CallbackAdapter.on_save"],
    "EPOCH_END": ["FlowControl.epoch_end", "CallbackAdapter.on_epoch_end"],
    "TRAIN_END": [
        "ScheduleFreeModes.train_end",
        "TrainLogger.train_end",
        "CallbackAdapter.on_train_end",
        "Checkpointing._release_lock",
        "Preemption.finish",
    ],
    "PREDICT_START": ["ScheduleFreeModes.evaluation_start", "EvalCollector.predict_start"],
    "PREDICT_BATCH_END": ["EvalCollector.predict_batch_end", "CallbackAdapter.on_prediction_step"],
    "PREDICT_END": ["EvalCollector.predict_end", "CallbackAdapter.predict"],
}


def typical_trainer(tmp_path: Path) -> Any:
    from trainbus.plugins.facade.trainer import Trainer

    args = quiet_args(
        tmp_path,
        max_steps=4,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        logging_steps=2,
        max_grad_norm=1.0,
        gradient_accumulation_steps=2,
    )
    return Trainer(Regressor(), args, train_dataset=regression_data(16), eval_dataset=regression_data(8))


def test_the_default_trainer_order_is_pinned(tmp_path: Path) -> None:
    trainer = typical_trainer(tmp_path)
    assert trainer.describe() == TRAINER_ORDER


def test_the_pinned_order_is_the_order_training_runs(tmp_path: Path) -> None:
    """What describe() says before train() is what the handlers do during it (first call of each, traced)."""
    trainer = typical_trainer(tmp_path)
    trace = trainer.bus.enable_trace()
    trainer.train()
    trainer.predict(regression_data(4))
    for event, handlers in TRAINER_ORDER.items():
        calls = [name for fired, name in trace if fired == event]
        assert all(name in handlers for name in calls), (event, calls)
        first_occurrence = [h for h in handlers if h in calls]
        assert calls[: len(first_occurrence)] == first_occurrence, event
