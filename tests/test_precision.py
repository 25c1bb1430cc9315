"""Mixed precision: bf16 autocast trains on CPU; fp16 overflows skip the optimizer AND the scheduler step."""

from __future__ import annotations

import doctest
import json
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import ConfigError, Engine, Event, Plugin, Priority
from trainbus.plugins.optimization import precision
from trainbus.plugins.optimization.accumulation import GradientAccumulation
from trainbus.plugins.optimization.precision import MixedPrecision
from trainbus.plugins.optimization.schedulers import LRScheduler


def make_engine(steps: int, plugins: list[Plugin], n: int = 8, lr: float = 0.05) -> Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(n * 4, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    data = [(x[i : i + 4], y[i : i + 4]) for i in range(0, n * 4, 4)]
    return Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        train_data=data,
        max_steps=steps,
        loss_fn=torch.nn.MSELoss(),
        plugins=plugins,
    )


class InjectOverflow(Plugin):
    """Makes the loss infinite in the given (1-based) optimizer steps: their gradients overflow."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.LOSS, self.poison, priority=Priority.CONSUMER)

    def poison(self, ev: Any) -> None:
        if ev.engine.state.global_step + 1 in self.steps and ev.micro_index == 0:
            ev.loss = ev.loss * float("inf")


class Observe(Plugin):
    """Records the lr each optimizer step used, whether it stepped, and whether parameters moved."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.stepped: list[bool] = []
        self.moved: list[bool] = []
        self._before: list[torch.Tensor] = []

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.STEP_START, self.start)
        self.on(engine, Event.BEFORE_OPTIMIZER_STEP, self.lr, priority=Priority.LAST)
        self.on(engine, Event.STEP_END, self.end)

    def start(self, ev: Any) -> None:
        self._before = [p.detach().clone() for p in ev.engine.model.parameters()]

    def lr(self, ev: Any) -> None:
        self.lrs.append(ev.engine.optimizer.param_groups[0]["lr"])

    def end(self, ev: Any) -> None:
        self.stepped.append(ev.stepped)
        self.moved.append(any(not torch.equal(a, p) for a, p in zip(self._before, ev.engine.model.parameters())))


@given(
    st.integers(1, 12),
    st.sets(st.integers(1, 12)),
    st.integers(1, 3),
    st.sampled_from(["linear", "cosine", "constant_with_warmup"]),
    st.integers(0, 4),
)
def test_overflow_skips_optimizer_and_scheduler_steps(
    steps: int, poisoned: set[int], k: int, schedule: str, warmup: int
) -> None:
    overflows = {s for s in poisoned if s <= steps}
    amp = MixedPrecision("fp16", init_scale=2.0**4)
    sched = LRScheduler(schedule, num_warmup_steps=warmup)
    engine = make_engine(steps, [GradientAccumulation(k), amp, sched, InjectOverflow(overflows)])
    seen = Observe()
    engine.add_plugin(seen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = engine.fit()
    assert not [w for w in caught if "lr_scheduler.step()" in str(w.message)]
    taken = steps - len(overflows)
    assert amp.skipped_steps == len(overflows)
    assert state.optimizer_steps_taken == taken
    assert sched.scheduler is not None and sched.scheduler.last_epoch == taken
    assert seen.stepped == [s not in overflows for s in range(1, steps + 1)]
    assert not any(m for m, ok in zip(seen.moved, seen.stepped) if not ok)  # overflow: parameters stay
    # the lr sequence of the taken steps is a clean run's, with the overflowed steps removed
    clean = make_engine(steps, [LRScheduler(schedule, num_warmup_steps=warmup)])
    reference = Observe()
    clean.add_plugin(reference)
    clean.fit()
    assert [lr for lr, ok in zip(seen.lrs, seen.stepped) if ok] == reference.lrs[:taken]


def test_bf16_autocast_trains_on_cpu_and_the_loss_goes_down() -> None:
    engine = make_engine(40, [MixedPrecision("bf16")], lr=0.02)
    dtypes: list[torch.dtype] = []
    engine.model[0].register_forward_hook(lambda m, i, out: dtypes.append(out.dtype))
    losses: list[float] = []
    engine.on(Event.LOSS, lambda ev: losses.append(float(ev.loss.detach())))
    engine.fit()
    assert set(dtypes) == {torch.bfloat16}
    assert sum(losses[-5:]) < 0.5 * sum(losses[:5])
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())  # master weights stay fp32


def test_fp16_trains_on_cpu() -> None:
    amp = MixedPrecision("fp16", init_scale=2.0**8)
    engine = make_engine(30, [amp], lr=0.02)
    losses: list[float] = []
    engine.on(Event.LOSS, lambda ev: losses.append(float(ev.loss.detach())))
    engine.fit()
    assert amp.skipped_steps == 0 and sum(losses[-5:]) < 0.5 * sum(losses[:5])


def test_state_round_trips_with_scaler_and_skipped_steps() -> None:
    amp = MixedPrecision("fp16", init_scale=2.0**6, growth_interval=3)
    engine = make_engine(7, [amp, InjectOverflow({2, 5})])
    engine.fit()
    state = json.loads(json.dumps(amp.state_dict()))
    assert state["skipped_steps"] == 2
    assert state["scaler"]["scale"] == amp.scaler.get_scale() != 2.0**6
    # loaded before attach (kept until the scaler exists) and after attach
    early = MixedPrecision("fp16")
    early.load_state_dict(state)
    make_engine(1, [early])
    assert early.state_dict() == state
    late = MixedPrecision("fp16")
    make_engine(1, [late])
    late.load_state_dict(state)
    assert late.state_dict() == state
    with pytest.raises(ConfigError, match="bf16"):
        MixedPrecision("bf16").load_state_dict(state)


def test_injected_scaler_is_used() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    amp = MixedPrecision("fp16", scaler=scaler)
    make_engine(3, [amp]).fit()
    assert amp.scaler is scaler and scaler.get_scale() == 64.0  # grew after each of 3 clean steps


def test_a_vetoed_step_leaves_the_scaler_ready() -> None:
    amp = MixedPrecision("fp16", init_scale=2.0**4)
    engine = make_engine(4, [amp])
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: setattr(ev, "skip", ev.engine.state.global_step == 1))
    state = engine.fit()
    assert state.global_step == 4 and state.optimizer_steps_taken == 3 and amp.skipped_steps == 0


def test_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"'fp61'.*allowed: bf16, bfloat16, fp16, float16"):
        MixedPrecision("fp61")
    with pytest.raises(ConfigError, match="fp16 only"):
        MixedPrecision("bf16", scaler=torch.amp.GradScaler("cpu"))
    monkeypatch.setattr(precision, "autocast_supported", lambda device, dtype: False)
    with pytest.raises(ConfigError, match=r"fp16 autocast is not supported on device 'cpu'.*try bf16"):
        make_engine(1, [MixedPrecision("fp16")])


def test_doctests() -> None:
    assert doctest.testmod(precision).failed == 0
