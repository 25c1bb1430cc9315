"""What the hot path's shortcuts promise: hooks read once per window, one Control flag, torch defaults."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import Control, Engine, Event
from trainbus.hooks import Hooks
from trainbus.hooks import forward as default_forward
from trainbus.plugins.optimization.accumulation import GradientAccumulation


def linear_engine(steps: int, **kwargs: Any) -> Engine:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    data = [(torch.ones(1, 2), torch.zeros(1, 1)) for _ in range(steps)]
    return Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=data,
        max_epochs=1,
        loss_fn=torch.nn.MSELoss(),
        **kwargs,
    )


def test_hooks_are_frozen_so_a_change_goes_through_set_hook() -> None:
    engine = linear_engine(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        engine.hooks.forward = lambda model, batch: model(batch[0])  # type: ignore[misc]


def test_a_hook_set_by_a_handler_takes_effect_from_the_next_window() -> None:
    engine = linear_engine(4)
    seen: list[float] = []
    engine.on(Event.LOSS, lambda ev: seen.append(float(ev.loss.detach())))

    def switch(ev: Any) -> None:
        if ev.engine.state.global_step == 2:
            ev.engine.set_hook("compute_loss", lambda outputs, batch: outputs.sum() * 0 + 7.0)

    engine.on(Event.STEP_END, switch)
    engine.fit()
    assert seen[2:] == [7.0, 7.0] and all(v != 7.0 for v in seen[:2])


def test_a_wrapper_added_mid_run_wraps_the_next_windows_only() -> None:
    engine = linear_engine(3)
    calls: list[int] = []

    def counting(inner: Any) -> Any:
        def step(optimizer: torch.optim.Optimizer) -> Any:
            calls.append(engine.state.global_step)
            return inner(optimizer)

        return step

    engine.on(Event.STEP_END(once=1), lambda ev: ev.engine.wrap_hook("optimizer_step", counting))
    engine.fit()
    assert calls == [1, 2]  # windows 2 and 3 (global_step is advanced after the step)


def test_default_hooks_are_the_torch_calls_and_none_counts_as_a_step() -> None:
    assert Hooks().backward is torch.Tensor.backward
    engine = linear_engine(2)
    assert engine.fit().optimizer_steps_taken == 2  # optimizer.step() returns None: a step taken


def test_an_optimizer_step_hook_returning_false_is_a_skipped_step() -> None:
    engine = linear_engine(3, hooks=Hooks(optimizer_step=lambda optimizer: False))
    stepped: list[bool] = []
    engine.on(Event.STEP_END, lambda ev: stepped.append(ev.stepped))
    state = engine.fit()
    assert stepped == [False] * 3 and state.optimizer_steps_taken == 0 and state.global_step == 3


FLAGS = ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log")


@given(st.lists(st.tuples(st.sampled_from(FLAGS), st.booleans()), max_size=12))
def test_control_requested_is_true_exactly_while_a_flag_is_set(sets: list[tuple[str, bool]]) -> None:
    control = Control()
    assert not control.requested
    for flag, value in sets:
        setattr(control, flag, value)
        assert control.requested == any(getattr(control, f) for f in FLAGS)
    control.reset_side_effects()
    assert control.requested == (control.should_training_stop or control.should_epoch_stop)


def test_requested_is_not_a_field() -> None:
    control = Control(should_log=True)
    assert "requested" not in control.to_dict() and control == Control(should_log=True)


def test_an_optimizer_replaced_at_epoch_start_is_used_for_that_epoch() -> None:
    engine = linear_engine(2)
    engine.max_epochs = 2
    frozen = torch.optim.SGD(engine.model.parameters(), lr=0.0)

    def swap(ev: Any) -> None:
        if ev.epoch == 1:
            ev.engine.optimizer = frozen

    engine.on(Event.EPOCH_START, swap)
    weights: list[torch.Tensor] = []
    engine.on(Event.EPOCH_END, lambda ev: weights.append(ev.engine.model.weight.detach().clone()))
    engine.fit()
    assert engine.optimizer is frozen and torch.equal(weights[0], weights[1])  # epoch 2 stepped with lr 0


@pytest.mark.parametrize("accumulate", [False, True])  # without LOSS handlers, and with one that scales
def test_at_the_next_forward_the_outputs_are_freed_and_the_loss_is_alive(accumulate: bool) -> None:
    # As in a loop written by hand: the outputs (an LLM's logits can be gigabytes) go right after
    # backward; the backpropagated loss stays, keeping the parameters' AccumulateGrad nodes alive,
    # so the next forward reuses them instead of building new ones.
    outputs_seen: list[weakref.ref[torch.Tensor]] = []
    losses: list[weakref.ref[torch.Tensor]] = []
    outputs_alive: list[bool] = []
    loss_alive: list[bool] = []

    def forward(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        outputs_alive.append(any(ref() is not None for ref in outputs_seen))
        if losses:
            loss_alive.append(losses[-1]() is not None)
        outputs = default_forward(model, batch)
        outputs_seen.append(weakref.ref(outputs))
        return outputs

    plugins = [GradientAccumulation(3)] if accumulate else []
    engine = linear_engine(6, hooks=Hooks(forward=forward), plugins=plugins)
    engine.on(Event.BACKWARD_END, lambda ev: losses.append(weakref.ref(ev.loss)))
    engine.fit()
    assert len(outputs_alive) == 6 and not any(outputs_alive)
    assert all(ref() is None for ref in outputs_seen)  # the last one too, before the optimizer step ends the run
    assert len(losses) == 6 and loss_alive == [True] * 5
