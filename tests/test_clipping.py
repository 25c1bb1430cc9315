"""Gradient clipping: the clipped norm never exceeds max_norm, and clipping sees unscaled gradients."""

from __future__ import annotations

import doctest
import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import ConfigError, Engine, Event, Priority
from trainbus.plugins.optimization import clipping
from trainbus.plugins.optimization.clipping import GradientClipping
from trainbus.plugins.optimization.precision import MixedPrecision


def total_norm(model: torch.nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return torch.linalg.vector_norm(grads, ord=norm_type)


def make_engine(scale: float, steps: int, plugins: list[Any], seed: int = 0) -> Engine:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    generator = torch.Generator().manual_seed(seed)
    data = [
        (scale * torch.randn(4, 3, generator=generator), torch.randn(4, 2, generator=generator)) for _ in range(steps)
    ]
    return Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=1e-3),
        train_data=data,
        max_epochs=1,
        loss_fn=torch.nn.MSELoss(),
        plugins=plugins,
    )


class Norms:
    """Gradient norms before clipping (PRODUCER: after unscaling at FIRST) and after (at OPTIMIZER_STEP)."""

    def __init__(self, engine: Engine, norm_type: float = 2.0) -> None:
        self.norm_type = norm_type
        self.before: list[torch.Tensor] = []
        self.after: list[torch.Tensor] = []
        self.published: list[torch.Tensor] = []
        engine.on(
            Event.BEFORE_OPTIMIZER_STEP,
            lambda ev: self.before.append(total_norm(ev.engine.model, norm_type)),
            priority=Priority.PRODUCER,
        )
        engine.on(Event.OPTIMIZER_STEP, self.stepped)

    def stepped(self, ev: Any) -> None:
        self.after.append(total_norm(ev.engine.model, self.norm_type))
        self.published.append(ev.engine.step_outputs["grad_norm"])


@given(
    st.floats(1e-3, 1e3),
    st.floats(1e-3, 10.0),
    st.sampled_from([2.0, 1.0, math.inf]),
    st.integers(0, 100),
)
def test_clipped_norm_never_exceeds_max_norm(scale: float, max_norm: float, norm_type: float, seed: int) -> None:
    engine = make_engine(scale, 3, [GradientClipping(max_norm, norm_type=norm_type)], seed)
    norms = Norms(engine, norm_type)
    engine.fit()
    assert len(norms.after) == 3
    for before, after, published in zip(norms.before, norms.after, norms.published):
        assert isinstance(published, torch.Tensor) and published.dim() == 0  # stays a device tensor
        torch.testing.assert_close(published, before, rtol=1e-5, atol=1e-6)  # the norm before clipping, like HF
        assert after <= max_norm + 1e-6
        if before <= max_norm:
            torch.testing.assert_close(after, before)  # below the threshold nothing changes


def test_clipping_happens_after_unscaling() -> None:
    # a large loss scale: clipping the scaled gradients would leave max_norm / scale after unscaling
    amp = MixedPrecision("fp16", init_scale=2.0**12)
    engine = make_engine(20.0, 3, [amp, GradientClipping(max_norm=1.0)])
    norms = Norms(engine)
    engine.fit()
    assert amp.skipped_steps == 0 and len(norms.after) == 3
    for before, after, published in zip(norms.before, norms.after, norms.published):
        assert before > 1.0  # the true gradients are larger than max_norm...
        assert after == pytest.approx(1.0, rel=1e-3)  # ...and are clipped to max_norm, not max_norm / 4096
        torch.testing.assert_close(published, before)  # grad_norm is the unscaled norm


def test_value_clipping_bounds_every_element() -> None:
    engine = make_engine(50.0, 2, [GradientClipping(max_norm=None, clip_value=0.01)])
    biggest: list[float] = []
    engine.on(
        Event.OPTIMIZER_STEP,
        lambda ev: biggest.append(max(p.grad.abs().max().item() for p in ev.engine.model.parameters())),
    )
    engine.fit()
    assert biggest and max(biggest) <= 0.01
    assert "grad_norm" not in engine.step_outputs  # no norm clipping, no norm


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "1"])
def test_bad_thresholds_fail_at_construction(bad: Any) -> None:
    with pytest.raises(ConfigError, match="max_norm must be a number >= 0"):
        GradientClipping(max_norm=bad)
    with pytest.raises(ConfigError, match="clip_value"):
        GradientClipping(clip_value=bad)


def test_zero_max_norm_switches_clipping_off() -> None:
    engine = make_engine(100.0, 1, [GradientClipping(max_norm=0)])
    after: list[torch.Tensor] = []
    engine.on(Event.OPTIMIZER_STEP, lambda ev: after.append(total_norm(ev.engine.model)))
    engine.fit()
    assert after[0] > 1.0


def test_doctests() -> None:
    assert doctest.testmod(clipping).failed == 0
