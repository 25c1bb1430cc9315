"""fp16 overflow skipped on the device (MixedPrecision's default with a fused optimizer): no host read per step.

Differential throughout: the same run with ``sync=True`` (one host read per step, the path before) is the
reference; ``keep_schedule=True`` is checked against the hand-written AMP loop instead.
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from facade_helpers import Regressor, quiet_args, regression_data
from hypothesis import given
from hypothesis import strategies as st
from op_recorder import OpRecorder
from test_precision import InjectOverflow as Overflow  # an infinite loss in the given (1-based) steps

from trainbus.engine import ConfigError, Engine, Event, Plugin, Priority
from trainbus.engine.testing import count_syncs, everything_but
from trainbus.plugins.averaging.ema import EMA
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, resume
from trainbus.plugins.facade.trainer import Trainer
from trainbus.plugins.optimization.accumulation import GradientAccumulation
from trainbus.plugins.optimization.nonfinite import SkipNonFinite
from trainbus.plugins.optimization.precision import MixedPrecision
from trainbus.plugins.optimization.schedulers import LRScheduler, create_scheduler

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, fused=True),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05, fused=True),
    "adamw_for_loop": lambda params: torch.optim.AdamW(params, lr=0.05, foreach=False),
}


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def make_engine(
    steps: int,
    amp: MixedPrecision,
    overflows: set[int],
    *,
    schedule: str | None = "constant",
    accumulation: int = 1,
    log_every: int | None = 3,
    optimizer: str = "adamw",
    plugins: tuple[Plugin, ...] = (),
    data: list[Any] | None = None,
) -> Engine:
    net = model()
    extra: list[Plugin] = [GradientAccumulation(accumulation)] if accumulation > 1 else []
    if schedule is not None:
        extra.append(LRScheduler(schedule, num_warmup_steps=2))
    engine = Engine(
        net,
        OPTIMIZERS[optimizer](net.parameters()),
        train_data=data if data is not None else batches(steps * accumulation),
        max_steps=steps,
        loss_fn=torch.nn.MSELoss(),
        plugins=[*extra, amp, Overflow(overflows), *plugins],
    )
    if log_every is not None:
        engine.on(Event.STEP_END(every=log_every), lambda ev: setattr(ev.engine.control, "should_log", True))
    return engine


def fit(engine: Engine) -> dict[str, Any]:
    """Run; what must match: weights, optimizer state, scale, counts, schedule (at logging points and the end)."""
    amp = engine.get_plugin(MixedPrecision)
    assert amp is not None
    rows: list[tuple[Any, ...]] = []

    def row(ev: Any) -> None:
        state = ev.engine.state
        lr = ev.engine.optimizer.param_groups[0]["lr"]
        rows.append((state.global_step, state.optimizer_steps_taken, amp.skipped_steps, lr, amp.scaler.get_scale()))

    engine.on(Event.LOG, row, priority=Priority.CONSUMER)
    engine.fit()
    plugin = engine.get_plugin(LRScheduler)
    assert engine.optimizer is not None
    return {
        "params": [p.detach().clone() for p in engine.model.parameters()],
        "optimizer": copy.deepcopy(engine.optimizer.state_dict()),
        "scaler": amp.scaler.state_dict(),
        "counts": (engine.state.optimizer_steps_taken, amp.skipped_steps),
        "schedule": None if plugin is None or plugin.scheduler is None else plugin.scheduler.state_dict(),
        "rows": rows,
    }


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), (a.keys(), b.keys())
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b, (a, b)


# -- the same numbers as a host read per step -------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum", "adagrad"])
@pytest.mark.parametrize(("schedule", "accumulation"), [("constant", 1), (None, 2)])
def test_by_default_a_fused_optimizer_skips_on_the_device_bit_for_bit_as_a_host_read(
    optimizer: str, schedule: str | None, accumulation: int
) -> None:
    # steps 1-2: the optimizer's first steps overflow (fused SGD would build garbage momentum there); 5: mid-window
    runs = []
    for sync in (True, None):
        amp = MixedPrecision("fp16", init_scale=2.0**4, sync=sync)
        engine = make_engine(9, amp, {1, 2, 5}, schedule=schedule, accumulation=accumulation, optimizer=optimizer)
        runs.append(fit(engine))
        assert amp.device_skip is (sync is None)
    assert_same(runs[0], runs[1])
    assert runs[1]["counts"] == (6, 3) and runs[1]["scaler"]["scale"] < 2.0**4


@given(
    st.integers(1, 8),
    st.sets(st.integers(1, 8)),
    st.integers(1, 3),
    st.sampled_from([None, 1, 2, 3]),
    st.sampled_from(["adamw", "sgd_momentum", "adagrad"]),
)
def test_any_overflows_and_windows_give_the_host_read_runs_numbers(
    steps: int, overflows: set[int], accumulation: int, log_every: int | None, optimizer: str
) -> None:
    runs = []
    for sync in (True, None):
        amp = MixedPrecision("fp16", init_scale=2.0**4, sync=sync)
        engine = make_engine(steps, amp, overflows, accumulation=accumulation, log_every=log_every, optimizer=optimizer)
        runs.append(fit(engine))
    assert_same(runs[0], runs[1])
    assert runs[1]["counts"][1] == len({s for s in overflows if s <= steps})


@given(st.integers(1, 8), st.sets(st.integers(1, 8)), st.integers(1, 3))
def test_with_a_moving_schedule_sync_false_agrees_at_every_logging_point(
    steps: int, overflows: set[int], log_every: int
) -> None:
    runs = []
    for sync in (True, False):
        amp = MixedPrecision("fp16", init_scale=2.0**4, sync=sync)
        runs.append(fit(make_engine(steps, amp, overflows, schedule="cosine", log_every=log_every)))
    assert runs[0]["rows"] == runs[1]["rows"] and runs[0]["counts"] == runs[1]["counts"]
    assert_same(runs[0]["schedule"], runs[1]["schedule"])


def test_sync_false_takes_skips_back_from_a_moving_schedule_at_logging_points() -> None:
    def runs(overflows: set[int]) -> list[dict[str, Any]]:
        out = []
        for sync in (True, False):
            amp = MixedPrecision("fp16", init_scale=2.0**4, sync=sync)
            out.append(fit(make_engine(9, amp, overflows, schedule="linear")))
        return out

    # skips that end their logging window (steps 2-3, 6): no step uses a rate that lags, all bit for bit
    exact = runs({2, 3, 6})
    assert_same(exact[0], exact[1])
    # a skip at step 4, read at step 6: steps 5 and 6 use the rate of one schedule step later (documented), then
    # the schedule is taken back: every logging point and the end agree, the weights do not
    lagged = runs({4})
    assert lagged[0]["rows"] == lagged[1]["rows"] and lagged[0]["counts"] == lagged[1]["counts"] == (8, 1)
    assert_same(lagged[0]["schedule"], lagged[1]["schedule"])
    assert not all(torch.equal(a, b) for a, b in zip(lagged[0]["params"], lagged[1]["params"]))


def raw_amp_loop(steps: int, overflows: set[int], data: list[Any]) -> dict[str, Any]:
    """torch's AMP recipe written by hand: the scheduler steps every step (as transformers does with a fused
    optimizer: accelerate sees its step called, so it reports no skip)."""
    net = model()
    optimizer = OPTIMIZERS["adamw"](net.parameters())
    schedule = create_scheduler("linear", optimizer, steps, 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    loss_fn = torch.nn.MSELoss()
    for step, (x, y) in enumerate(data, start=1):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(net(x), y)
        if step in overflows:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        schedule.step()
        optimizer.zero_grad()
    return {"params": [p.detach().clone() for p in net.parameters()], "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict(), "schedule": schedule.state_dict()}  # fmt: skip


@given(st.sets(st.integers(1, 9)), st.sampled_from([None, 2, 3]))
def test_keep_schedule_is_the_hand_written_amp_loop_bit_for_bit(overflows: set[int], log_every: int | None) -> None:
    data = batches(9)
    amp = MixedPrecision("fp16", init_scale=2.0**4, keep_schedule=True)
    engine = make_engine(9, amp, overflows, schedule="linear", data=data, log_every=log_every)
    run = fit(engine)
    assert amp.device_skip and run["counts"] == (9 - len(overflows), len(overflows))
    raw = raw_amp_loop(9, overflows, data)
    assert_same({k: run[k] for k in raw}, raw)


@pytest.mark.filterwarnings("error::UserWarning")
def test_keep_schedule_steps_the_schedule_on_a_skip_the_host_decided_too() -> None:
    # fused SGD's first step is decided on the host (a skipped one would leave its momentum uninitialised)
    amp = MixedPrecision("fp16", init_scale=2.0**4, keep_schedule=True)
    run = fit(make_engine(6, amp, {1, 4}, schedule="linear", optimizer="sgd_momentum"))
    assert amp.device_skip and run["counts"] == (4, 2) and run["schedule"]["last_epoch"] == 6
    assert all(state["momentum_buffer"].isfinite().all() for state in run["optimizer"]["state"].values())


# -- no host read per step --------------------------------------------------------------------------------
def syncs(steps: int, sync: bool | None, log_every: int | None, within: list[int] | None = None) -> int:
    """Host reads in the run; ``within`` gets those inside each step (STEP_START to STEP_END)."""
    data = batches(steps)
    amp = MixedPrecision("fp16", init_scale=2.0**4, sync=sync)
    engine = make_engine(steps, amp, {2, 3}, log_every=log_every, data=data)
    with count_syncs(on_device=everything_but(data)) as counter:  # the CPU proxy: all but the batches are "GPU"
        if within is not None:
            engine.on(Event.STEP_START, lambda ev: within.append(-counter.count), priority=Priority.FIRST + 10)
            engine.on(Event.STEP_END, lambda ev: within.__setitem__(-1, within[-1] + counter.count))
        engine.fit()
    return counter.count


def test_no_host_read_per_step_only_one_per_logging_window_and_at_the_end() -> None:
    # step 1 is decided on the host: the optimizer's state does not exist before its first step (see fp16_skip)
    for steps in (6, 12):
        assert syncs(steps, None, None) == 1 + 1  # TRAIN_END's read, however many steps
        assert syncs(steps, None, 3) == 1 + steps // 3 + 1
        assert syncs(steps, True, None) == syncs(steps, True, 3) == steps  # the host-read path: one per step
    device: list[int] = []
    host: list[int] = []
    syncs(9, None, 3, device)
    syncs(9, True, 3, host)
    assert device == [1] + [0] * 8 and host == [1] * 9  # skips at 2 and 3 read at the logging point after step 3


def per_step_ops(run: Any) -> list[Counter[str]]:
    recorder = OpRecorder()
    with recorder:
        run(recorder)
    return [Counter(ops) for ops in recorder.steps[2:-1]]  # past the first steps (state built), before the end


def engine_ops(sync: bool | None, accumulation: int) -> list[Counter[str]]:
    amp = MixedPrecision("fp16", init_scale=2.0**4, sync=sync)
    engine = make_engine(5, amp, set(), schedule=None, accumulation=accumulation, log_every=None)
    engine.on(Event.STEP_START, lambda ev: recorder_mark(ev), priority=Priority.FIRST + 10)
    marks: list[Any] = []

    def recorder_mark(ev: Any) -> None:
        marks[0].mark(ev)

    def run(recorder: OpRecorder) -> None:
        marks.append(recorder)
        engine.fit()

    return per_step_ops(run)


def raw_ops(accumulation: int) -> list[Counter[str]]:
    def run(recorder: OpRecorder) -> None:
        net = model()
        optimizer = OPTIMIZERS["adamw"](net.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        data = batches(5 * accumulation)
        for start in range(0, len(data), accumulation):
            recorder.mark(None)
            for x, y in data[start : start + accumulation]:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = torch.nn.functional.mse_loss(net(x), y)
                if accumulation > 1:
                    loss = loss / accumulation
                scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # as the engine (for clipping) and transformers with max_grad_norm > 0
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

    return per_step_ops(run)


@pytest.mark.parametrize("accumulation", [1, 2])
def test_aten_ops_per_step_at_most_one_per_micro_batch_more_than_the_hand_written_loop(accumulation: int) -> None:
    # ops per window (CPU, this MLP), raw / host read / device skip: k=1 58 / 57 / 58; k=2 (loss / k) 104 / 103 / 104
    raw, old, new = raw_ops(accumulation), engine_ops(True, accumulation), engine_ops(None, accumulation)
    assert len(raw) == len(old) == len(new) == 3
    for raw_step, old_step, new_step in zip(raw, old, new):
        assert new_step.total() <= raw_step.total() + accumulation
        # the device skip against the host read: the fused optimizer's step-count restore and the counter's add,
        # instead of the read
        assert new_step - old_step == Counter({"aten._foreach_sub_.List": 1, "aten.add_.Tensor": 1})
        assert old_step - new_step == Counter({"aten._local_scalar_dense.default": 1})
        if accumulation == 1:  # against GradScaler.step: its sum of the found-inf flags is the counter's add here
            assert new_step - raw_step == Counter({"aten.add_.Tensor": 1})
            assert raw_step - new_step == Counter({"aten.add.Tensor": 1})


# -- where the device cannot decide alone: one host read, as before ----------------------------------------
@pytest.mark.parametrize(
    ("optimizer", "schedule", "plugins"),
    [
        ("adamw_for_loop", "constant", ()),  # a for-loop optimizer reads no found_inf
        ("adamw", "linear", ()),  # a moving schedule: the rate after a skip would lag (sync=False allows it)
        ("adamw", "constant", (EMA(0.9),)),  # EMA would average a skipped step
        ("adamw", "constant", (SkipNonFinite(),)),  # it would count the overflow as its own skip
    ],
)
def test_the_default_falls_back_to_the_host_read_with_the_same_numbers(
    optimizer: str, schedule: str, plugins: tuple[Plugin, ...]
) -> None:
    amp = MixedPrecision("fp16", init_scale=2.0**4)
    engine = make_engine(6, amp, {2}, schedule=schedule, optimizer=optimizer, plugins=plugins)
    engine.fit()
    assert not amp.device_skip and amp.skipped_steps == 1 and engine.state.optimizer_steps_taken == 5


def test_sync_false_says_why_it_cannot_skip_on_the_device() -> None:
    with pytest.raises(ConfigError, match=r"sync=False.*AdamW without fused=True.*adamw_torch_fused"):
        make_engine(3, MixedPrecision("fp16", sync=False), set(), optimizer="adamw_for_loop").fit()
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), fused=True)
    step_lr = LRScheduler(torch.optim.lr_scheduler.StepLR(optimizer, 2))
    engine = Engine(net, optimizer, train_data=batches(2), max_steps=2, loss_fn=torch.nn.MSELoss(),
                    plugins=[step_lr, MixedPrecision("fp16", sync=False)])  # fmt: skip
    with pytest.raises(ConfigError, match="StepLR has no closed form"):
        engine.fit()
    with pytest.raises(ConfigError, match="sync must be True, False or None"):
        MixedPrecision("fp16", sync="no")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="keep_schedule must be True or False"):
        MixedPrecision("fp16", keep_schedule=1)  # type: ignore[arg-type]


def test_the_trainer_gets_it_with_a_fused_optimizer_whatever_the_schedule_and_keeps_the_host_read_without(
    tmp_path: Path,
) -> None:
    """The Trainer keeps skipped steps in the schedule of a fused optimizer, as transformers does
    (tests/differential/test_diff_fp16_overflow.py), so the device skip is exact with any schedule there."""
    cases = (("constant", "adamw_torch_fused", True), ("linear", "adamw_torch_fused", True),
             ("linear", "adamw_torch", False))  # fmt: skip
    for schedule, optim, on_device in cases:
        args = quiet_args(tmp_path, max_steps=4, logging_steps=2, fp16=True, lr_scheduler_type=schedule, optim=optim)
        trainer = Trainer(Regressor(), args, train_dataset=regression_data(16))
        trainer.train()
        amp = trainer.get_plugin(MixedPrecision)
        assert amp is not None and amp.device_skip is on_device and amp.keep_schedule, (schedule, optim)


# -- state and resume -------------------------------------------------------------------------------------
def test_state_holds_the_skips_not_yet_taken_back_and_round_trips_as_json() -> None:
    amp = MixedPrecision("fp16", init_scale=2.0**4, sync=False)
    engine = make_engine(6, amp, {4}, schedule="linear", log_every=None)
    states: list[dict[str, Any]] = []
    engine.on(Event.STEP_END(once=5), lambda ev: states.append(json.loads(json.dumps(amp.state_dict()))))
    engine.fit()
    assert states[0]["skipped_steps"] == 0 and states[0]["pending_skips"] == 1  # skipped at 4, not read until the end
    assert amp.state_dict()["pending_skips"] == 0 and amp.skipped_steps == 1
    loaded = MixedPrecision("fp16")
    loaded.load_state_dict(states[0])
    make_engine(1, loaded, set(), log_every=None)  # attached, not run
    assert loaded.state_dict() == states[0]
    with pytest.raises(ConfigError, match="pending_skips must be an integer >= 0, got -1"):
        MixedPrecision("fp16").load_state_dict({**states[0], "pending_skips": -1})


@pytest.mark.parametrize("schedule", ["linear", "constant"])
def test_a_resume_between_the_skip_and_the_logging_point_continues_bit_for_bit(tmp_path: Path, schedule: str) -> None:
    def run(out: Path, resume_from: Path | None = None) -> dict[str, Any]:
        amp = MixedPrecision("fp16", init_scale=2.0**4, sync=False)
        saves = Checkpointing(out, save_strategy="steps", save_steps=1)
        engine = make_engine(9, amp, {4}, schedule=schedule, log_every=6, plugins=(saves,))
        if resume_from is not None:
            resume(engine, resume_from)
        return fit(engine)

    whole = run(tmp_path / "whole")
    resumed = run(tmp_path / "resumed", tmp_path / "whole" / "checkpoint-5")  # skipped at 4, not yet read
    assert_same({k: v for k, v in whole.items() if k != "rows"}, {k: v for k, v in resumed.items() if k != "rows"})
    assert whole["rows"][-1:] == resumed["rows"] and whole["counts"] == (8, 1)


def test_skips_a_checkpoint_had_not_taken_back_are_taken_back_when_it_resumes_with_a_host_read(
    tmp_path: Path,
) -> None:
    def run(sync: bool | None, out: Path, resume_from: Path | None = None) -> dict[str, Any]:
        amp = MixedPrecision("fp16", init_scale=2.0**4, sync=sync)
        saves = Checkpointing(out, save_strategy="steps", save_steps=1)
        engine = make_engine(8, amp, {4}, schedule="constant", log_every=None, plugins=(saves,))
        if resume_from is not None:
            resume(engine, resume_from)
        return fit(engine)

    whole = run(None, tmp_path / "whole")  # skipped on the device at 4, read only at the end
    resumed = run(True, tmp_path / "resumed", tmp_path / "whole" / "checkpoint-5")
    assert_same({k: v for k, v in whole.items() if k != "rows"}, {k: v for k, v in resumed.items() if k != "rows"})
    assert resumed["counts"] == (7, 1)
