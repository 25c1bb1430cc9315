"""Handlers steering the loop: replacing batch and loss, vetoing a step; plugins and hooks."""

from __future__ import annotations

import doctest
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import trainbus.engine.bus
import trainbus.engine.loop
import trainbus.engine.plugin
import trainbus.engine.state
import trainbus.engine.testing
import trainbus.engine.testing.sync_counter
from trainbus.engine import ConfigError, Engine, Event, Plugin, State
from trainbus.engine.testing import EventRecorder, LoopConfig, check_trace, toy_engine
from trainbus.hooks import Hooks


def one_step_engine(**kwargs: object) -> Engine:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1, bias=False)
    batch = (torch.ones(2, 3), torch.zeros(2, 1))
    return Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        train_data=[batch],
        max_steps=1,
        loss_fn=torch.nn.MSELoss(),
        **kwargs,
    )  # type: ignore[arg-type]


def weight_change(engine: Engine) -> torch.Tensor:
    before = engine.model.weight.detach().clone()  # type: ignore[union-attr]
    engine.fit()
    return engine.model.weight.detach() - before  # type: ignore[operator]


def test_a_handler_can_replace_the_loss_and_the_gradient_follows() -> None:
    plain = weight_change(one_step_engine())
    doubled_engine = one_step_engine()
    doubled_engine.on(Event.LOSS, lambda ev: setattr(ev, "loss", ev.loss * 2))
    doubled = weight_change(doubled_engine)
    torch.testing.assert_close(doubled, 2 * plain)


def test_a_handler_can_replace_the_batch() -> None:
    engine = one_step_engine()
    engine.on(Event.BATCH_START, lambda ev: setattr(ev, "batch", (ev.batch[0] * 0, ev.batch[1])))
    # zero inputs: the gradient of the weight is zero, so SGD leaves it unchanged
    assert torch.count_nonzero(weight_change(engine)) == 0
    assert torch.count_nonzero(weight_change(one_step_engine())) == 3


def test_a_handler_can_veto_the_optimizer_step() -> None:
    engine = one_step_engine()
    recorder = engine.add_plugin(EventRecorder())
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: setattr(ev, "skip", True))
    stepped: list[bool] = []
    engine.on(Event.STEP_END, lambda ev: stepped.append(ev.stepped))
    assert torch.count_nonzero(weight_change(engine)) == 0
    assert stepped == [False] and engine.state.global_step == 1 and engine.state.optimizer_steps_taken == 0
    assert isinstance(recorder, EventRecorder) and "OPTIMIZER_STEP" not in recorder.names
    check_trace(recorder.names)


def test_side_effects_run_in_order_log_eval_save_and_reset() -> None:
    config = LoopConfig(8, 2, 1, 1, None, None)
    engine = toy_engine(config)
    engine.eval_data = [(torch.randn(2, 3), torch.randn(2, 1))]
    recorder = engine.add_plugin(EventRecorder())

    def ask_all(ev) -> None:  # type: ignore[no-untyped-def]
        if ev.engine.state.global_step == 2:
            control = ev.engine.control
            control.should_save = control.should_evaluate = control.should_log = True

    engine.on(Event.STEP_END, ask_all)
    engine.fit()
    assert isinstance(recorder, EventRecorder)
    names = recorder.names
    at = names.index("STEP_END", names.index("STEP_END") + 1)
    assert names[at + 1 : at + 6] == ["LOG", "EVAL_START", "EVAL_BATCH_END", "EVAL_END", "SAVE"]
    assert names.count("LOG") == names.count("SAVE") == names.count("EVAL_START") == 1
    check_trace(names)


def test_evaluate_restores_train_mode_and_dict_sets_get_prefixes() -> None:
    engine = toy_engine(LoopConfig(4, 2, 1, 1, None, None))
    prefixes: list[str] = []
    engine.on(Event.EVAL_END, lambda ev: ev.metrics.update({f"{ev.prefix}_n": 1}))
    engine.on(Event.EVAL_START, lambda ev: prefixes.append(ev.prefix))
    data = [(torch.randn(2, 3), torch.randn(2, 1))]
    engine.model.train()
    assert engine.evaluate({"a": data, "b": data}) == {"eval_a_n": 1, "eval_b_n": 1}
    assert engine.model.training and prefixes == ["eval_a", "eval_b"]
    with pytest.raises(ConfigError, match="evaluate\\(\\) needs data"):
        engine.evaluate()


def test_predict_returns_what_the_collector_sets() -> None:
    engine = toy_engine(LoopConfig(4, 2, 1, 1, None, None))
    logits: list[torch.Tensor] = []
    engine.on(Event.PREDICT_BATCH_END, lambda ev: logits.append(ev.logits))
    engine.on(Event.PREDICT_END, lambda ev: setattr(ev, "output", torch.cat(logits)))
    out = engine.predict([(torch.randn(2, 3), torch.randn(2, 1)), (torch.randn(1, 3), torch.randn(1, 1))])
    assert out.shape == (3, 1) and not out.requires_grad


class Counter(Plugin):
    def __init__(self, name: str | None = None) -> None:
        self.steps = 0
        if name:
            self.name = name

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.STEP_END, self.step_end)
        self.wrap_hook(engine, "compute_loss", lambda inner: lambda out, batch: inner(out, batch) * 1.0)

    def step_end(self, ev: object) -> None:
        self.steps += 1

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = state["steps"]


def test_plugins_add_remove_pop_by_instance_class_and_name() -> None:
    engine = toy_engine(LoopConfig(6, 2, 1, 1, None, None))
    a, b = Counter(), Counter(name="second")
    engine.add_plugin(a)
    engine.add_plugin(b)
    with pytest.raises(ConfigError, match="a plugin named 'Counter' is already attached"):
        engine.add_plugin(Counter())
    assert engine.get_plugin(Counter) is a and engine.get_plugin("second") is b
    assert engine.pop_plugin(Counter) is a
    engine.fit()
    assert (a.steps, b.steps) == (0, 3)
    assert engine.bus.handler_names(Event.STEP_END) == ["second.step_end"]
    engine.remove_plugin(b)
    assert engine.plugins == [] and engine.bus.handler_names(Event.STEP_END) == []
    assert engine.pop_plugin(Counter) is None


def test_engine_state_dict_round_trips_state_and_plugin_state() -> None:
    engine = toy_engine(LoopConfig(6, 2, 1, 1, None, None), plugins=[Counter()])
    engine.fit()
    saved = engine.state_dict()
    fresh = toy_engine(LoopConfig(6, 2, 1, 1, None, None), plugins=[Counter()])
    fresh.load_state_dict(saved)
    assert fresh.state == engine.state and fresh.get_plugin(Counter).steps == 3  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="state has plugins \\['Counter'\\] that this engine lacks"):
        toy_engine(LoopConfig(6, 2, 1, 1, None, None)).load_state_dict(saved)


def test_hook_wrappers_compose_and_unwrap_independently() -> None:
    engine = toy_engine(LoopConfig(4, 2, 1, 1, None, None))
    order: list[str] = []

    def tag(label: str):  # type: ignore[no-untyped-def]
        def wrapper(inner):  # type: ignore[no-untyped-def]
            def outer(model, batch):  # type: ignore[no-untyped-def]
                order.append(label)
                return inner(model, batch)

            return outer

        return wrapper

    first = engine.wrap_hook("forward", tag("first"))
    engine.wrap_hook("forward", tag("second"))
    engine.hooks.forward(engine.model, torch.randn(1, 3))
    assert order == ["second", "first"]  # later wrappers sit outside
    engine.unwrap_hook(first)
    order.clear()
    engine.hooks.forward(engine.model, torch.randn(1, 3))
    assert order == ["second"]
    engine.set_hook("forward", lambda model, batch: model(batch) * 0)
    assert float(engine.hooks.forward(engine.model, torch.ones(1, 3)).detach().sum()) == 0.0 and order == [
        "second",
        "second",
    ]
    with pytest.raises(ConfigError, match="unknown hook 'forwrd'; did you mean 'forward'"):
        engine.wrap_hook("forwrd", tag("x"))


def test_custom_loss_hook_is_used() -> None:
    def l1(outputs, batch):  # type: ignore[no-untyped-def]
        return (outputs - batch[1]).abs().mean()

    model = torch.nn.Linear(3, 1)
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=[(torch.ones(2, 3), torch.zeros(2, 1))],
        max_steps=1,
        hooks=Hooks(compute_loss=l1),
    )
    losses: list[float] = []
    engine.on(Event.LOSS, lambda ev: losses.append(float(ev.loss.detach())))
    expected = float(model(torch.ones(2, 3)).detach().abs().mean())
    engine.fit()
    assert losses == [pytest.approx(expected)]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3),
    max_leaves=8,
)


@given(
    st.integers(0, 10**6),
    st.floats(0, 100),
    st.lists(st.dictionaries(st.sampled_from(["loss", "step", "lr"]), st.floats(allow_nan=True)), max_size=4),
    st.none() | st.floats(allow_nan=False),
    json_values,
)
def test_state_json_round_trip(
    step: int, epoch: float, history: list[dict[str, float]], best: float | None, extra: object
) -> None:
    state = State(global_step=step, epoch=epoch, log_history=history, best_metric=best, stateful_callbacks={"x": extra})
    back = State.from_json(state.to_json())
    assert back.to_json() == state.to_json()
    for got, want in zip(back.log_history, history):
        for key, value in want.items():
            assert (math.isnan(got[key]) and math.isnan(value)) or got[key] == value


def test_corrupt_state_json_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="state JSON is corrupt"):
        State.from_json('{"global_step": ')
    with pytest.raises(ConfigError, match="unknown State fields \\['globl_step'\\]"):
        State.from_json('{"globl_step": 3}')


@pytest.mark.parametrize(
    "module",
    [
        trainbus.engine.loop,
        trainbus.engine.bus,
        trainbus.engine.state,
        trainbus.engine.plugin,
        trainbus.engine.testing,
        trainbus.engine.testing.sync_counter,
    ],
)
def test_docstring_examples_run(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)  # type: ignore[arg-type]
    assert result.failed == 0
