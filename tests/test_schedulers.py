"""Schedulers: each matches its closed form (and HF's get_scheduler) at every step; the plugin steps them."""

from __future__ import annotations

import doctest
import json
import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import ConfigError, Engine, Event, Plugin, Priority
from trainbus.engine.testing import StopAtStep
from trainbus.plugins.optimization import schedulers
from trainbus.plugins.optimization.schedulers import (
    SCHEDULER_NAMES,
    LRScheduler,
    create_scheduler,
    resolve_warmup_steps,
)

BASE_LR = 0.5


def closed_form(name: str, s: int, total: int, w: int, kw: dict[str, Any]) -> float:
    """The HF schedule multipliers, written out independently of the module under test."""
    warm = s / max(1, w)
    after = (s - w) / max(1, total - w)  # progress through the decay phase
    if name == "constant":
        return 1.0
    if name == "constant_with_warmup":
        return warm if s < w else 1.0
    if name == "linear":
        return warm if s < w else max(0.0, (total - s) / max(1, total - w))
    if name == "cosine":
        return warm if s < w else max(0.0, 0.5 * (1 + math.cos(2 * math.pi * kw.get("num_cycles", 0.5) * after)))
    if name == "cosine_with_min_lr":
        rate = kw["min_lr"] / BASE_LR
        if s < w:
            return warm
        return max(0.0, rate + (1 - rate) * 0.5 * (1 + math.cos(2 * math.pi * kw.get("num_cycles", 0.5) * after)))
    if name == "cosine_warmup_with_min_lr":  # warmup ends at 1 on its last step; the decay starts moving at once
        rate, warm_from = kw["min_lr"] / BASE_LR, kw.get("warmup_lr_rate")
        if s < w:
            return (s + 1) / max(1, w) if warm_from is None else warm_from + (1 - warm_from) * s / max(1, w - 1)
        moved = (s - w + 1) / max(1, total - w)
        return max(0.0, rate + (1 - rate) * 0.5 * (1 + math.cos(2 * math.pi * kw.get("num_cycles", 0.5) * moved)))
    if name == "cosine_with_restarts":
        if s < w:
            return warm
        if after >= 1:
            return 0.0
        return 0.5 * (1 + math.cos(math.pi * ((kw.get("num_cycles", 1) * after) % 1)))
    if name == "polynomial":
        end, power = kw.get("lr_end", 1e-7), kw.get("power", 1.0)
        if s < w:
            return warm
        if s > total:
            return end / BASE_LR
        return ((BASE_LR - end) * (1 - after) ** power + end) / BASE_LR
    if name == "inverse_sqrt":
        timescale = kw.get("timescale") or w or 10_000
        return warm if s < w else 1 / math.sqrt((s + timescale - w) / timescale)
    if name == "warmup_stable_decay":
        decay, ratio = kw["num_decay_steps"], kw.get("min_lr_ratio", 0.0)
        stable = total - w - decay
        if s < w:
            return ratio + (1 - ratio) * warm  # linear warmup
        if s < w + stable:
            return 1.0
        if s < w + stable + decay:
            p = (s - w - stable) / max(1, decay)
            return max(0.0, ratio + (1 - ratio) * 0.5 * (1 + math.cos(math.pi * 2 * kw.get("num_cycles", 0.5) * p)))
        return ratio
    raise AssertionError(name)


@st.composite
def schedule_cases(draw: st.DrawFn) -> tuple[str, int, int, float, dict[str, Any]]:
    name = draw(st.sampled_from([n for n in SCHEDULER_NAMES if n != "reduce_lr_on_plateau"]))
    total = draw(st.integers(1, 60))
    if draw(st.booleans()):
        warmup_steps, ratio = draw(st.integers(0, total)), 0.0
    else:
        warmup_steps, ratio = 0, draw(st.floats(0.0, 0.99))
    kw: dict[str, Any] = {}
    if name in ("cosine", "cosine_with_min_lr") and draw(st.booleans()):
        kw["num_cycles"] = draw(st.sampled_from([0.5, 1.0, 1.5, 2.0]))
    if name == "cosine_with_restarts":
        kw["num_cycles"] = draw(st.integers(1, 4))
    if name in ("cosine_with_min_lr", "cosine_warmup_with_min_lr"):
        kw["min_lr"] = draw(st.floats(0.0, BASE_LR / 2))
    if name == "cosine_warmup_with_min_lr" and draw(st.booleans()):
        kw["warmup_lr_rate"] = draw(st.floats(0.0, 0.5))
    if name == "polynomial":
        kw = {"lr_end": draw(st.floats(0.0, BASE_LR / 2)), "power": draw(st.floats(0.5, 3.0))}
    if name == "inverse_sqrt" and draw(st.booleans()):
        kw["timescale"] = draw(st.integers(1, 50))
    if name == "warmup_stable_decay":
        kw = {"num_decay_steps": draw(st.integers(0, total)), "min_lr_ratio": draw(st.floats(0.0, 0.5))}
    return name, total, warmup_steps, ratio, kw


def run_schedule(sched: Any, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=BASE_LR)


@given(schedule_cases())
def test_each_scheduler_matches_its_closed_form_and_hf(case: tuple[str, int, int, float, dict[str, Any]]) -> None:
    from transformers import get_scheduler

    name, total, warmup_steps, ratio, kw = case
    w = resolve_warmup_steps(total, warmup_steps, ratio)
    assert w == (warmup_steps if warmup_steps else math.ceil(total * ratio))
    opt = _optimizer()
    got = run_schedule(create_scheduler(name, opt, total, warmup_steps, ratio, kw), opt, total + 3)
    want = [BASE_LR * closed_form(name, s, total, w, kw) for s in range(total + 3)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    if not (name == "polynomial" and total == w):  # HF divides by zero there (a decay phase of 0 steps)
        hf_opt = _optimizer()
        hf = get_scheduler(name, hf_opt, num_warmup_steps=w, num_training_steps=total, scheduler_specific_kwargs=kw)
        assert got == pytest.approx(run_schedule(hf, hf_opt, total + 3), rel=1e-12, abs=1e-15)


def toy(max_steps: int, plugins: list[Plugin], lr: float = BASE_LR, n: int = 12) -> Engine:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randn(3, 2, generator=generator), torch.randn(3, 1, generator=generator)) for _ in range(n)]
    return Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        train_data=data,
        eval_data=data[:2],
        max_steps=max_steps,
        loss_fn=torch.nn.MSELoss(),
        plugins=plugins,
    )


def step_lrs(engine: Engine) -> list[float]:
    """The learning rate each taken optimizer step used."""
    lrs: list[float] = []
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: lrs.append(ev.engine.optimizer.param_groups[0]["lr"]))
    return lrs


@given(
    st.sampled_from(["linear", "cosine", "constant_with_warmup", "inverse_sqrt"]), st.integers(1, 20), st.floats(0, 0.9)
)
def test_plugin_builds_from_max_steps_and_steps_once_per_optimizer_step(name: str, steps: int, ratio: float) -> None:
    plugin = LRScheduler(name, warmup_ratio=ratio)
    engine = toy(steps, [plugin])
    lrs = step_lrs(engine)
    engine.fit()
    w = math.ceil(steps * ratio)
    assert lrs == pytest.approx([BASE_LR * closed_form(name, s, steps, w, {}) for s in range(steps)])
    assert plugin.scheduler is not None and plugin.scheduler.last_epoch == engine.state.optimizer_steps_taken == steps


def test_given_instance_is_used_as_is() -> None:
    engine = toy(4, [])
    sched = torch.optim.lr_scheduler.StepLR(engine.optimizer, step_size=1, gamma=0.5)
    engine.add_plugin(LRScheduler(sched))
    lrs = step_lrs(engine)
    engine.fit()
    assert lrs == [0.5, 0.25, 0.125, 0.0625]


class EvalLosses(Plugin):
    """Evaluate after every step; the eval loss comes from a script."""

    def __init__(self, losses: list[float]) -> None:
        self.losses = list(losses)

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.STEP_END, lambda ev: setattr(ev.engine.control, "should_evaluate", True))
        self.on(
            engine,
            Event.EVAL_END,
            lambda ev: ev.metrics.update(eval_loss=self.losses.pop(0)),
            priority=Priority.PRODUCER,
        )


def test_reduce_lr_on_plateau_steps_on_the_eval_metric() -> None:
    losses = [1.0, 0.9, 0.95, 0.97, 0.99, 0.98, 0.99, 0.96]
    plugin = LRScheduler("reduce_lr_on_plateau", scheduler_kwargs={"patience": 1, "factor": 0.5}, metric="eval_loss")
    engine = toy(len(losses), [plugin, EvalLosses(losses)])
    lrs = step_lrs(engine)
    engine.fit()
    opt = _optimizer()
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1, factor=0.5)
    want = []
    for loss in losses:
        want.append(opt.param_groups[0]["lr"])
        reference.step(loss)
    assert lrs == want
    assert lrs[-1] < BASE_LR  # it did reduce
    assert plugin.get_last_lr() == [opt.param_groups[0]["lr"]]


def test_reduce_lr_on_plateau_names_a_missing_metric() -> None:
    engine = toy(2, [LRScheduler("reduce_lr_on_plateau", metric="accuracy"), EvalLosses([1.0, 1.0])])
    with pytest.raises(Exception, match=r"eval_accuracy.*eval_loss"):
        engine.fit()


def test_state_round_trips_through_a_resume() -> None:
    reference = toy(10, [LRScheduler("cosine", num_warmup_steps=3)])
    want = step_lrs(reference)
    reference.fit()

    first = toy(10, [LRScheduler("cosine", num_warmup_steps=3), StopAtStep(4)])
    got = step_lrs(first)
    first.fit()
    saved = json.loads(json.dumps(first.state_dict()))
    optimizer_state = first.optimizer.state_dict()

    second = toy(10, [LRScheduler("cosine", num_warmup_steps=3), StopAtStep(4)])
    second.model.load_state_dict(first.model.state_dict())
    second.optimizer.load_state_dict(optimizer_state)
    second.load_state_dict(saved)  # before fit: the schedule is built at TRAIN_START, then restored
    rest = step_lrs(second)
    second.fit()
    assert got + rest == pytest.approx(want, rel=1e-12)
    assert second.state.global_step == 10


def test_bad_input_fails_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"'cosine'.*known schedulers: linear, cosine"):
        LRScheduler("cosin")
    with pytest.raises(ConfigError, match="known schedulers"):
        create_scheduler("nope", _optimizer(), 10)
    for ratio in (-0.1, 1.5, 2.0):  # 1.0 is in transformers' range [0, 1]: a warmup over the whole run
        with pytest.raises(ConfigError, match="warmup_ratio"):
            LRScheduler("linear", warmup_ratio=ratio)
    with pytest.raises(ConfigError, match="num_warmup_steps"):
        LRScheduler("linear", num_warmup_steps=-1)
    with pytest.raises(ConfigError, match=r"takes no argument 'num_cycle'.*num_cycles"):
        LRScheduler("cosine", scheduler_kwargs={"num_cycle": 2})
    with pytest.raises(ConfigError, match="min_lr"):
        create_scheduler("cosine_with_min_lr", _optimizer(), 10)
    with pytest.raises(ConfigError, match="num_decay_steps"):
        create_scheduler("warmup_stable_decay", _optimizer(), 10)
    with pytest.raises(ConfigError, match="decay_type"):
        LRScheduler("warmup_stable_decay", scheduler_kwargs={"num_decay_steps": 2, "decay_type": "exp"})
    with pytest.raises(ConfigError, match="num_training_steps"):
        create_scheduler("linear", _optimizer(), 0)
    with pytest.raises(ConfigError, match="scheduler must be"):
        LRScheduler(3)  # type: ignore[arg-type]


def test_doctests() -> None:
    assert doctest.testmod(schedulers).failed == 0
