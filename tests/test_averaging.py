"""Weight averaging: EMA against a float64 reference, with no host read and one foreach op per step;
evaluation on the averages with the training weights back bit for bit; bit-exact resumes; SWA against
torch's own AveragedModel / SWALR / update_bn loop."""

from __future__ import annotations

import copy
import doctest
import logging
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs
from op_recorder import OpRecorder
from torch.optim.lr_scheduler import LambdaLR
from torch.optim.swa_utils import SWALR, AveragedModel, update_bn

from trainbus.engine import ConfigError, Engine, Event, Plugin, Priority
from trainbus.engine.testing import count_syncs
from trainbus.plugins.averaging import ema as ema_module
from trainbus.plugins.averaging import swa as swa_module
from trainbus.plugins.averaging.ema import EMA
from trainbus.plugins.averaging.swa import SWA
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, resume
from trainbus.plugins.evaluation.collector import EvalCollector
from trainbus.plugins.evaluation.half_eval import HalfPrecisionEval
from trainbus.plugins.optimization.accumulation import GradientAccumulation
from trainbus.plugins.optimization.precision import MixedPrecision
from trainbus.plugins.optimization.schedulers import LRScheduler

F64 = torch.float64


def batches(n: int, seed: int = 1, dtype: torch.dtype = F64, rows: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, 3, generator=g, dtype=dtype), torch.randn(rows, 1, generator=g, dtype=dtype))
            for _ in range(n)]  # fmt: skip


def make_model(dtype: torch.dtype = F64, batch_norm: bool = False, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    norm: list[torch.nn.Module] = [torch.nn.BatchNorm1d(4)] if batch_norm else []
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), *norm, torch.nn.Tanh(), torch.nn.Linear(4, 1))
    return model.to(dtype)


def make_engine(
    plugins: list[Plugin], *, steps: int = 12, dtype: torch.dtype = F64, batch_norm: bool = False, lr: float = 0.1
) -> Engine:
    model = make_model(dtype, batch_norm)
    data = batches(8, dtype=dtype)
    return Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=lr, momentum=0.5),
        train_data=data,
        eval_data=batches(2, seed=7, dtype=dtype),
        max_steps=steps,
        loss_fn=torch.nn.MSELoss(),
        plugins=plugins,
    )


def tracked(model: torch.nn.Module, average_buffers: bool) -> dict[str, torch.Tensor]:
    """What the EMA averages, named as the test expects it: parameters, then float running statistics."""
    out = {n: p for n, p in model.named_parameters()}
    if average_buffers:
        out.update({n: b for n, b in model.named_buffers() if n.endswith(("running_mean", "running_var"))})
    return out


def snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in tensors.items()}


class Vetoes(Plugin):
    """Vetoes the optimizer step of the given (1-based) windows."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.BEFORE_OPTIMIZER_STEP, self.veto, priority=Priority.LAST)

    def veto(self, ev: Any) -> None:
        if ev.engine.state.global_step + 1 in self.steps:
            ev.skip = True


class Overflows(Plugin):
    """Makes the loss infinite in the given (1-based) windows: fp16 gradients overflow, the step is skipped."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.LOSS, self.poison, priority=Priority.CONSUMER)

    def poison(self, ev: Any) -> None:
        if ev.engine.state.global_step + 1 in self.steps:
            ev.loss = ev.loss * float("inf")


class ReferenceEMA(Plugin):
    """The averaging formula in float64, checked against the plugin's averages after every optimizer step."""

    def __init__(self, ema: EMA, decay: float, warmup: bool, every: int, average_buffers: bool) -> None:
        self.ema, self.decay, self.warmup, self.every, self.buffers = ema, decay, warmup, every, average_buffers
        self.average: dict[str, torch.Tensor] = {}
        self.updates = 0
        self.checked = 0

    def attach(self, engine: Engine) -> None:
        self.average = snapshot(tracked(engine.model, self.buffers))  # the weights before any step
        self.on(engine, Event.OPTIMIZER_STEP, self.step, priority=Priority.LAST - 1)  # after the EMA (LAST)

    def step(self, ev: Any) -> None:
        if ev.engine.state.optimizer_steps_taken % self.every == 0:
            self.updates += 1
            t = self.updates
            d = min(self.decay, (1 + t) / (10 + t)) if self.warmup else self.decay
            for name, weight in tracked(ev.engine.model, self.buffers).items():
                self.average[name] = d * self.average[name] + (1 - d) * weight.detach().to(F64)
        got = self.ema.averages
        assert sorted(got) == sorted(self.average)
        for name, expected in self.average.items():
            assert (got[name] - expected).abs().max().item() <= 1e-12, f"{name} after {self.updates} updates"
        self.checked += 1


# -- EMA: the formula -------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(
    decay=hs.floats(0.05, 0.999),
    warmup=hs.booleans(),
    every=hs.integers(1, 3),
    steps=hs.integers(1, 40),
    average_buffers=hs.booleans(),
)
def test_ema_equals_a_float64_reference(
    decay: float, warmup: bool, every: int, steps: int, average_buffers: bool
) -> None:
    ema = EMA(decay, warmup=warmup, every=every, average_buffers=average_buffers)
    engine = make_engine([ema], steps=steps, batch_norm=True)
    reference = ReferenceEMA(ema, decay, warmup, every, average_buffers)
    engine.add_plugin(reference)
    engine.fit()
    assert reference.checked == steps and ema.num_updates == steps // every == reference.updates
    assert [ema.decay_at(t) for t in (1, 2)] == ([min(decay, 2 / 11), min(decay, 3 / 12)] if warmup else [decay] * 2)


def test_warmup_ramp_is_torch_ema_s() -> None:
    ema = EMA(0.999)
    assert ema.decay_at(1) == 2 / 11 and ema.decay_at(100) == 101 / 110
    assert ema.decay_at(8990) == 0.999 and ema.decay_at(8989) < 0.999  # the decay takes over at t = 8990
    assert EMA(0.999, warmup=False).decay_at(1) == 0.999


def test_buffers_are_the_models_own_unless_averaged() -> None:
    copied, averaged = EMA(0.9), EMA(0.9, average_buffers=True)
    for ema in (copied, averaged):
        engine = make_engine([ema], steps=6, batch_norm=True)
        engine.fit()
        state = engine.model.state_dict()
        saved = ema.averaged_state_dict()
        assert list(saved) == list(state)  # every key of the model, buffers included
        assert torch.equal(saved["1.num_batches_tracked"], state["1.num_batches_tracked"])  # integers: the model's
        same_stats = torch.equal(saved["1.running_mean"], state["1.running_mean"])
        assert same_stats is (ema is copied)
        assert not torch.equal(saved["0.weight"], state["0.weight"])
    assert "1.running_mean" not in copied.averages and "1.running_mean" in averaged.averages


# -- EMA: skipped steps ------------------------------------------------------------------------------------
def test_vetoed_steps_do_not_update_the_ema() -> None:
    vetoed = {2, 5, 6}
    ema = EMA(0.8)
    engine = make_engine([Vetoes(vetoed), ema], steps=10)
    reference = ReferenceEMA(ema, 0.8, True, 1, False)
    engine.add_plugin(reference)
    before: dict[str, torch.Tensor] = {}
    engine.on(Event.STEP_START, lambda ev: before.update(snapshot(ema.averages)))
    unchanged: list[bool] = []
    engine.on(
        Event.STEP_END, lambda ev: unchanged.append(all(torch.equal(before[n], t) for n, t in ema.averages.items()))
    )
    engine.fit()
    assert ema.num_updates == reference.updates == 10 - len(vetoed) == engine.state.optimizer_steps_taken
    assert [s for s, same in enumerate(unchanged, start=1) if same] == sorted(vetoed)


def test_fp16_overflow_steps_do_not_update_the_ema() -> None:
    overflows = {1, 4}
    ema = EMA(0.8)
    amp = MixedPrecision("fp16", init_scale=2.0**4)
    engine = make_engine([amp, Overflows(overflows), ema], steps=8, dtype=torch.float32)
    start = snapshot(dict(engine.model.named_parameters()))
    after: list[dict[str, torch.Tensor]] = []
    engine.on(Event.STEP_END, lambda ev: after.append(snapshot(ema.averages)))
    engine.fit()
    assert amp.skipped_steps == len(overflows)
    assert ema.num_updates == 8 - len(overflows)
    assert all(torch.equal(after[0][n], start[n]) for n in start)  # step 1 overflowed: still the initial weights
    assert all(torch.equal(after[3][n], after[2][n]) for n in start)  # step 4 overflowed
    assert not all(torch.equal(after[4][n], after[3][n]) for n in start)


# -- EMA: no host sync, one foreach op ---------------------------------------------------------------------
def test_ema_reads_no_tensor_value() -> None:
    counts = []
    for plugins in ([], [EMA(0.9)], [EMA(0.99, warmup=False, every=2)]):
        engine = make_engine(plugins, steps=12)  # type: ignore[arg-type]
        with count_syncs(on_device=lambda t: True) as counter:  # every read of any tensor counts
            engine.fit()
        counts.append(counter.count)
    assert counts[1] == counts[0] and counts[2] == counts[0]


@pytest.mark.parametrize(("every", "average_buffers"), [(1, False), (3, False), (1, True)])
def test_ema_adds_exactly_one_foreach_op_per_update(every: int, average_buffers: bool) -> None:
    runs = []
    for plugins in ([], [EMA(0.9, every=every, average_buffers=average_buffers)]):
        engine = make_engine(plugins, steps=9, batch_norm=True)  # type: ignore[arg-type]
        recorder = OpRecorder()
        engine.on(Event.STEP_START, recorder.mark, priority=Priority.FIRST + 10)
        with recorder:
            engine.fit()
        runs.append(recorder.steps[1:])  # one list per step (the first list is TRAIN_START)
    without, with_ema = runs
    assert len(without) == len(with_ema) == 9
    for step, (a, b) in enumerate(zip(without, with_ema), start=1):
        assert Counter(a) - Counter(b) == Counter()
        expected = {"aten._foreach_lerp_.Scalar": 1} if step % every == 0 else {}
        assert Counter(b) - Counter(a) == Counter(expected), f"step {step}"


# -- EMA: evaluation with the averages ---------------------------------------------------------------------
def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a: list[torch.Tensor], model: torch.nn.Module) -> None:
    for x, p in zip(a, model.parameters(), strict=True):
        assert torch.equal(x, p) and x.dtype == p.dtype


def test_evaluate_uses_the_averages_and_restores_the_training_weights_bit_for_bit() -> None:
    ema = EMA(0.8, eval_with_ema=True)
    engine = make_engine([EvalCollector(), ema], steps=10)
    engine.fit()
    model = engine.model
    training, pointers = params(model), [p.data_ptr() for p in model.parameters()]
    during: list[list[torch.Tensor]] = []
    engine.on(Event.EVAL_BATCH_END, lambda ev: during.append(params(ev.engine.model)))
    metrics = engine.evaluate()
    assert_same(training, model)
    assert [p.data_ptr() for p in model.parameters()] == pointers  # the training tensors themselves came back
    assert all(p.requires_grad for p in model.parameters())

    averaged = list(ema.averages.values())
    assert during and all(all(torch.equal(a, b) for a, b in zip(seen, averaged, strict=True)) for seen in during)
    twin = copy.deepcopy(model)
    twin.load_state_dict(ema.averaged_state_dict())
    alone = Engine(twin, loss_fn=torch.nn.MSELoss(), plugins=[EvalCollector()]).evaluate(batches(2, seed=7))
    trained = Engine(copy.deepcopy(model), loss_fn=torch.nn.MSELoss(), plugins=[EvalCollector()]).evaluate(
        batches(2, seed=7)
    )
    assert metrics["eval_loss"] == alone["eval_loss"] != trained["eval_loss"]

    seen_in_predict: list[list[torch.Tensor]] = []
    engine.on(Event.PREDICT_BATCH_END, lambda ev: seen_in_predict.append(params(ev.engine.model)))
    engine.predict(batches(1))
    assert all(torch.equal(a, b) for a, b in zip(seen_in_predict[0], training))  # predict: the training weights


def test_evaluations_inside_fit_change_nothing_in_training() -> None:
    def run(eval_with_ema: bool) -> tuple[Engine, EMA, list[float]]:
        ema = EMA(0.7, eval_with_ema=eval_with_ema)
        engine = make_engine([EvalCollector(), ema], steps=9)
        engine.on(Event.STEP_END(every=3), lambda ev: setattr(ev.engine.control, "should_evaluate", True))
        losses: list[float] = []
        engine.on(Event.EVAL_END, lambda ev: losses.append(ev.metrics["eval_loss"]), priority=Priority.LAST)
        engine.fit()
        return engine, ema, losses

    (a, ema_a, losses_a), (b, ema_b, losses_b) = run(True), run(False)
    assert_same(params(b.model), a.model)
    assert all(torch.equal(ema_a.averages[n], t) for n, t in ema_b.averages.items())
    assert len(losses_a) == len(losses_b) == 3 and all(x != y for x, y in zip(losses_a, losses_b))


class Flaky(torch.nn.Module):
    """Raises in eval mode while ``fail`` is set."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail and not self.training:
            raise RuntimeError("eval forward exploded")
        return self.inner(x)  # type: ignore[no-any-return]


def test_an_evaluation_whose_forward_raises_restores_at_once() -> None:
    ema = EMA(0.8, eval_with_ema=True)
    engine = make_engine([ema], steps=6)
    engine.model = Flaky(engine.model)
    engine.fit()
    training = params(engine.model)
    engine.model.fail = True  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="eval forward exploded"):
        engine.evaluate()
    assert_same(training, engine.model)
    assert ema.restore()  # nothing left swapped


@pytest.mark.parametrize("event", [Event.EVAL_START, Event.EVAL_BATCH_END, Event.EVAL_END])
def test_an_evaluation_failing_in_a_handler_restores_before_the_error_reaches_the_caller(event: Any) -> None:
    def run(fail: bool) -> Engine:
        ema = EMA(0.8, eval_with_ema=True)
        engine = make_engine([EvalCollector(), ema], steps=5)
        engine.fit()
        if fail:
            training = params(engine.model)

            def explode(ev: Any) -> None:
                raise RuntimeError("metric exploded")

            handle = engine.on(event, explode)  # EVAL_END: before EMA's restore, which still runs
            with pytest.raises(RuntimeError, match="metric exploded"):
                engine.evaluate()
            assert_same(training, engine.model)  # EVAL_END's cleanup ran before the error got here
            assert ema._training_data is None
            handle.remove()
        engine.max_steps = 10
        engine.fit()
        return engine

    assert_same(params(run(False).model), run(True).model)


def test_restore_after_a_failed_evaluation_is_bit_exact() -> None:
    ema = EMA(0.8, eval_with_ema=True)
    engine = make_engine([EvalCollector(), ema], steps=5)
    engine.fit()
    training = params(engine.model)

    def explode(ev: Any) -> None:
        raise RuntimeError("metric exploded")

    engine.on(Event.EVAL_BATCH_END, explode)
    with pytest.raises(RuntimeError, match="metric exploded"):
        engine.evaluate()
    assert ema.restore()
    assert_same(training, engine.model)


def test_eval_with_ema_under_half_precision_eval() -> None:
    ema = EMA(0.8, eval_with_ema=True)
    engine = make_engine([EvalCollector(), ema, HalfPrecisionEval("bf16")], steps=6, dtype=torch.float32)
    engine.fit()
    training, averages = params(engine.model), snapshot(ema.averages)
    during: list[list[torch.Tensor]] = []
    engine.on(Event.EVAL_BATCH_END, lambda ev: during.append(params(ev.engine.model)))
    engine.evaluate()
    expected = [t.to(torch.bfloat16) for t in averages.values()]
    assert all(a.dtype == torch.bfloat16 and torch.equal(a, b) for a, b in zip(during[0], expected, strict=True))
    assert_same(training, engine.model)
    assert all(torch.equal(averages[n], t) for n, t in ema.averages.items())

    def explode(ev: Any) -> None:
        raise RuntimeError("boom")

    handle = engine.on(Event.EVAL_BATCH_END, explode)
    with pytest.raises(RuntimeError, match="boom"):
        engine.evaluate()
    handle.remove()
    engine.evaluate()  # both plugins put their tensors back, in order
    assert_same(training, engine.model)


def test_swapped_and_averaged_state_dict() -> None:
    ema = EMA(0.8)
    engine = make_engine([ema], steps=6)
    engine.fit()
    training = params(engine.model)
    with ema.swapped() as model:
        assert model is engine.model
        assert all(torch.equal(p, a) for p, a in zip(model.parameters(), ema.averages.values(), strict=True))
    assert_same(training, engine.model)
    with pytest.raises(KeyError), ema.swapped(engine):
        raise KeyError("inside")
    assert_same(training, engine.model)
    saved = ema.averaged_state_dict()
    assert all(torch.equal(saved[n], a) for n, a in ema.averages.items())
    assert_same(training, engine.model)
    with pytest.raises(ConfigError, match="not attached"):
        EMA(0.5).averaged_state_dict()


# -- EMA: checkpoints ---------------------------------------------------------------------------------------
class Crash(Exception):
    pass


def interrupt_at(engine: Engine, at: int, kind: str = "step") -> None:
    """Save at the end of window ``at`` (or of epoch ``at``), then crash (as tests/test_resume.py does)."""

    def request(ev: Any) -> None:
        if (kind == "step" and ev.engine.state.global_step == at) or (kind == "epoch" and ev.epoch == at):
            ev.engine.control.should_save = True

    def crash(ev: Any) -> None:
        raise Crash("simulated crash right after the checkpoint")

    engine.on(Event.STEP_END if kind == "step" else Event.EPOCH_END, request)
    engine.on(Event.SAVE, crash, priority=Priority.LAST)
    with pytest.raises(Crash, match="simulated crash"):
        engine.fit()


def ema_run(output_dir: Path, every: int) -> tuple[Engine, EMA]:
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ema = EMA(0.9, every=every, eval_with_ema=True)
    plugins = [GradientAccumulation(2), EvalCollector(), ema, LRScheduler("linear", num_warmup_steps=2),
               Checkpointing(output_dir)]  # fmt: skip
    engine = Engine(model, torch.optim.Adam(model.parameters(), lr=0.05), train_data=batches(9, dtype=torch.float32),
                    eval_data=batches(2, seed=5, dtype=torch.float32), max_epochs=3, loss_fn=torch.nn.MSELoss(),
                    plugins=plugins)  # fmt: skip
    engine.on(Event.STEP_END(every=4), lambda ev: setattr(ev.engine.control, "should_evaluate", True))
    return engine, ema


@settings(max_examples=12, deadline=None)
@given(at=hs.integers(1, 14), every=hs.integers(1, 3))
def test_ema_resume_is_bit_exact(tmp_path_factory: pytest.TempPathFactory, at: int, every: int) -> None:
    reference, ema_ref = ema_run(tmp_path_factory.mktemp("unused"), every)
    reference.fit()
    assert reference.state.global_step == 15
    output_dir = tmp_path_factory.mktemp("ckpt")
    interrupt_at(ema_run(output_dir, every)[0], at)
    resumed, ema = ema_run(output_dir, every)
    resume(resumed, True)
    assert ema.num_updates == at // every and ema.averages == {}  # loaded, bound at TRAIN_START
    resumed.fit()
    assert ema.num_updates == ema_ref.num_updates == 15 // every
    assert sorted(ema.averages) == sorted(ema_ref.averages)
    for name, tensor in ema_ref.averages.items():
        assert torch.equal(ema.averages[name], tensor), name
    assert_same(params(reference.model), resumed.model)


def test_ema_state_is_checked_when_loaded() -> None:
    ema = EMA(0.9)
    make_engine([ema], steps=2, batch_norm=True).fit()
    other = EMA(0.9, average_buffers=True)
    engine = make_engine([other], steps=2, batch_norm=True)
    other.load_state_dict(ema.state_dict())
    with pytest.raises(ConfigError, match=r"missing averages \['1.running_mean', '1.running_var'\], unexpected \[\]"):
        engine.fit()
    with pytest.raises(ConfigError, match="num_updates must be an integer >= 0, got -1"):
        EMA(0.9).load_state_dict({"num_updates": -1, "averaged": None})
    bound = EMA(0.9)
    make_engine([bound], steps=1).fit()
    bad = {**bound.state_dict()["averaged"], "0.weight": torch.zeros(2, 2, dtype=F64)}
    with pytest.raises(ConfigError, match=r"'0.weight' is \(2, 2\)"):
        bound.load_state_dict({"num_updates": 1, "averaged": bad})


# -- SWA ------------------------------------------------------------------------------------------------------
def bn_batches(n: int, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 3, generator=g), torch.randn(6, 1, generator=g)) for _ in range(n)]


def lr_factor(step: int) -> float:
    return 0.93**step


def swa_engine(swa: SWA, *, epochs: int = 6, n: int = 5, output_dir: Path | None = None) -> tuple[Engine, list[float]]:
    model = make_model(torch.float32, batch_norm=True, seed=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    plugins: list[Plugin] = [LRScheduler(LambdaLR(optimizer, lr_factor)), swa]
    if output_dir is not None:
        plugins.append(Checkpointing(output_dir))
    engine = Engine(model, optimizer, train_data=bn_batches(n), max_epochs=epochs, loss_fn=torch.nn.MSELoss(),
                    plugins=plugins)  # fmt: skip
    lrs: list[float] = []
    engine.on(Event.OPTIMIZER_STEP, lambda ev: lrs.append(ev.engine.optimizer.param_groups[0]["lr"]),
              priority=Priority.LAST - 1)  # fmt: skip
    return engine, lrs


def torch_swa_loop(
    unit: str, start: int, every: int, swa_lr: float, anneal: int, strategy: str, epochs: int = 6, n: int = 5
) -> tuple[torch.nn.Module, AveragedModel, list[float]]:
    """torch's documented SWA loop: the main schedule until the phase, SWALR from it, update_bn at the end."""
    model = make_model(torch.float32, batch_norm=True, seed=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    schedule = LambdaLR(optimizer, lr_factor)
    averaged = AveragedModel(model)
    swa_scheduler: SWALR | None = None
    data, lrs, taken = bn_batches(n), [], 0
    for epoch in range(epochs):
        if unit == "epoch" and epoch == start:
            swa_scheduler = SWALR(optimizer, swa_lr=swa_lr, anneal_epochs=anneal, anneal_strategy=strategy)  # type: ignore[arg-type]
        for x, y in data:
            if unit == "step" and taken + 1 == start:
                swa_scheduler = SWALR(optimizer, swa_lr=swa_lr, anneal_epochs=anneal, anneal_strategy=strategy)  # type: ignore[arg-type]
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            taken += 1
            if swa_scheduler is None:
                schedule.step()
            elif unit == "step":
                if (taken - start) % every == 0:
                    averaged.update_parameters(model)
                swa_scheduler.step()
            lrs.append(optimizer.param_groups[0]["lr"])
        if unit == "epoch" and swa_scheduler is not None:
            if (epoch - start) % every == 0:
                averaged.update_parameters(model)
            swa_scheduler.step()
    update_bn(data, averaged)
    return model, averaged, lrs


def epoch_lrs_of(lrs: list[float], n: int) -> list[float]:
    return lrs[n - 1 :: n]


@pytest.mark.parametrize(
    ("unit", "start", "every", "anneal", "strategy"),
    [("epoch", 2, 1, 2, "cos"), ("epoch", 1, 2, 0, "linear"), ("step", 7, 1, 4, "cos"), ("step", 4, 3, 3, "linear")],
)
def test_swa_equals_torch_swa_loop(unit: str, start: int, every: int, anneal: int, strategy: str) -> None:
    where = {"start_epoch": start} if unit == "epoch" else {"start_step": start}
    swa = SWA(0.03, every=every, anneal_epochs=anneal, anneal_strategy=strategy, load_at_end=False, **where)  # type: ignore[arg-type]
    engine, lrs = swa_engine(swa)
    engine.fit()
    model, averaged, reference_lrs = torch_swa_loop(unit, start, every, 0.03, anneal, strategy)
    assert swa.averaged is not None
    assert torch.equal(swa.averaged.n_averaged, averaged.n_averaged) and int(averaged.n_averaged) >= 2
    for (name, a), b in zip(swa.averaged.state_dict().items(), averaged.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert_same(params(model), engine.model)  # load_at_end=False: the model keeps its trained weights
    assert lrs == reference_lrs  # SWALR drove the lr, not the LambdaLR the LRScheduler plugin still steps
    assert lrs[-1] == pytest.approx(0.03) and lrs[0] == pytest.approx(0.2 * lr_factor(1))


def test_swalr_anneals_from_the_lr_reached() -> None:
    swa = SWA(0.01, start_epoch=2, anneal_epochs=3, anneal_strategy="linear")
    engine, lrs = swa_engine(swa, epochs=7)
    engine.fit()
    start_lr = 0.2 * lr_factor(10)  # the schedule's lr after the 10 steps of epochs 0 and 1
    per_epoch = [start_lr] + [start_lr + (0.01 - start_lr) * min(1, k / 3) for k in range(1, 5)]
    assert lrs[10:] == pytest.approx([lr for lr in per_epoch for _ in range(5)][: len(lrs) - 10], rel=1e-12)
    assert lrs[:10] == pytest.approx([0.2 * lr_factor(s) for s in range(1, 11)], rel=1e-12)


def test_update_bn_recomputes_the_statistics_and_load_at_end_installs_the_average(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    original = swa_module.update_bn

    def spy(loader: Any, model: torch.nn.Module, device: Any = None) -> None:
        calls.append(1)
        original(loader, model, device)

    monkeypatch.setattr(swa_module, "update_bn", spy)
    swa = SWA(0.03, start_epoch=3)
    engine, _ = swa_engine(swa)
    engine.fit()
    assert calls == [1]
    assert swa.averaged is not None
    _, averaged, _ = torch_swa_loop("epoch", 3, 1, 0.03, 10, "cos")
    assert torch.equal(swa.averaged.module[1].running_mean, averaged.module[1].running_mean)
    state = engine.model.state_dict()
    for name, value in swa.averaged.module.state_dict().items():
        assert torch.equal(state[name], value), name  # load_at_end: the model is the SWA model


def test_update_bn_statistics_differ_from_the_copied_buffers() -> None:
    """Without update_bn the averaged model keeps the last copied running statistics: they differ."""
    results = {}
    for flag in (True, False):
        swa = SWA(0.03, start_epoch=3, update_bn=flag, load_at_end=False)
        engine, _ = swa_engine(swa)
        engine.fit()
        assert swa.averaged is not None
        results[flag] = swa.averaged.module[1].running_var.clone()
        if not flag:
            assert torch.equal(results[flag], engine.model[1].running_var)  # type: ignore[index]
    assert not torch.equal(results[True], results[False])


def test_update_bn_goes_through_the_hooks_and_keeps_the_rng() -> None:
    dict_model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Dropout(0.5))

    class Keyed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = dict_model

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
            out = self.net(x).sum(-1)
            return {"loss": ((out - labels) ** 2).mean()} if labels is not None else {"logits": out}

    torch.manual_seed(0)
    data = [{"x": x, "labels": y.squeeze(-1)} for x, y in bn_batches(4)]
    model = Keyed()
    swa = SWA(start_step=2)  # swa_lr=None: the lr is left alone
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_steps=6, plugins=[swa])
    engine.fit()
    rng = torch.get_rng_state()
    swa.recompute_bn()
    assert torch.equal(torch.get_rng_state(), rng)
    assert engine.optimizer is not None and engine.optimizer.param_groups[0]["lr"] == 0.1
    assert swa.scheduler is None


@pytest.mark.parametrize(
    ("unit", "kind", "at"),
    [("epoch", "step", 2), ("epoch", "step", 5), ("epoch", "step", 7), ("epoch", "step", 10), ("epoch", "step", 13),
     ("epoch", "epoch", 0), ("epoch", "epoch", 1), ("step", "step", 3), ("step", "step", 8), ("step", "step", 11)],
)  # fmt: skip
def test_swa_resume_is_bit_exact(tmp_path: Path, unit: str, kind: str, at: int) -> None:
    """Interrupted before, at the start of, inside and at the ends of the phase's epochs / steps."""

    def make(output_dir: Path) -> tuple[Engine, SWA, list[float]]:
        where = {"start_epoch": 1} if unit == "epoch" else {"start_step": 6}
        swa = SWA(0.03, every=1 if unit == "epoch" else 2, anneal_epochs=3, **where)  # type: ignore[arg-type]
        engine, lrs = swa_engine(swa, epochs=4, output_dir=output_dir)
        return engine, swa, lrs

    reference, swa_ref, lrs_ref = make(tmp_path / "unused")
    reference.fit()
    interrupt_at(make(tmp_path / "ckpt")[0], at, kind)
    resumed, swa, lrs = make(tmp_path / "ckpt")
    resume(resumed, True)
    resumed.fit()
    done = at if kind == "step" else 5 * (at + 1)
    assert lrs == lrs_ref[done:]
    assert swa.averaged is not None and swa_ref.averaged is not None
    for (name, a), b in zip(swa.averaged.state_dict().items(), swa_ref.averaged.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert swa.state_dict()["scheduler"] == swa_ref.state_dict()["scheduler"]
    assert swa.state_dict()["last_unit"] == swa_ref.state_dict()["last_unit"]
    for (name, a), b in zip(reference.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_swa_state_round_trips_through_json_and_tensors() -> None:
    from trainbus.plugins.checkpoints.codec import join_tensors, split_tensors

    swa = SWA(0.03, start_epoch=1)
    engine, _ = swa_engine(swa, epochs=3)
    engine.fit()
    structure, tensors = split_tensors(swa.state_dict(), "plugins")
    assert any(key.endswith("n_averaged") for key in tensors)
    other = SWA(0.03, start_epoch=1)
    swa_engine(other, epochs=3)  # attaches it
    other.load_state_dict(join_tensors(structure, tensors, "test"))
    assert other.averaged is not None and swa.averaged is not None  # materialised at once: it is attached
    assert all(
        torch.equal(a, b) for a, b in zip(other.averaged_state_dict().values(), swa.averaged_state_dict().values())
    )
    assert other.state_dict()["scheduler"] == swa.state_dict()["scheduler"]


def test_swa_that_never_started_leaves_the_model(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="trainbus")  # whatever level another test left it at
    swa = SWA(0.03, start_epoch=9)
    engine, lrs = swa_engine(swa, epochs=2)
    engine.fit()
    assert lrs == [0.2 * lr_factor(s) for s in range(1, 11)]  # no SWALR either
    assert swa.averaged is None and "ended before epoch 9" in caplog.text
    with pytest.raises(ConfigError, match="averaged nothing yet"):
        swa.averaged_state_dict()


# -- bad inputs ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"decay": 1.0}, r"decay must be a number in the open interval \(0, 1\).*got 1.0"),
        ({"decay": 0}, r"open interval \(0, 1\).*got 0$"),
        ({"decay": -0.5}, "got -0.5"),
        ({"decay": math.nan}, "got nan"),
        ({"decay": True}, "got True"),
        ({"decay": "0.9"}, "got '0.9'"),
        ({"warmup": 100}, r"warmup must be True \(the decay ramps as min\(decay, \(1 \+ t\) / \(10 \+ t\)\).*got 100"),
        ({"warmup": None}, "warmup must be True.*or False.*got None"),
        ({"every": 0}, r"every \(optimizer steps between updates\) must be an integer >= 1, got 0"),
        ({"every": 1.5}, "got 1.5"),
        ({"eval_with_ema": "yes"}, "eval_with_ema must be True or False, got 'yes'"),
        ({"average_buffers": 1}, "average_buffers must be True or False, got 1"),
    ],
)
def test_bad_ema_settings_fail_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EMA(**{"decay": 0.9, **kwargs})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of start_epoch.*and start_step.*got start_epoch=None, start_step=None"),
        ({"start_epoch": 1, "start_step": 5}, "exactly one.*got start_epoch=1, start_step=5"),
        ({"start_epoch": -1}, r"start_epoch \(0-based\) must be an integer >= 0, got -1"),
        ({"start_epoch": 1.5}, "got 1.5"),
        ({"start_step": 0}, r"start_step \(optimizer steps, 1-based\) must be an integer >= 1, got 0"),
        ({"start_epoch": 1, "every": 0}, "SWA every must be an integer >= 1, got 0"),
        ({"start_epoch": 1, "anneal_epochs": -1}, "anneal_epochs must be an integer >= 0, got -1"),
        (
            {"start_epoch": 1, "anneal_strategy": "cosine"},
            r"anneal_strategy must be one of \('cos', 'linear'\), got 'cosine'",
        ),
        ({"start_epoch": 1, "swa_lr": -0.1}, "swa_lr must be a learning rate >= 0.*got -0.1"),
        ({"start_epoch": 1, "swa_lr": []}, r"got \[\]"),
        ({"start_epoch": 1, "swa_lr": "fast"}, "got 'fast'"),
        ({"start_epoch": 1, "update_bn": "yes"}, "SWA update_bn must be True or False, got 'yes'"),
        ({"start_epoch": 1, "bn_data": 3}, "bn_data must be an iterable of batches or None, got int"),
        ({"start_epoch": 1, "device": "nowhere"}, "device must be a torch device or None, got 'nowhere'"),
    ],
)
def test_bad_swa_settings_fail_at_construction(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        SWA(**kwargs)


def test_swa_lr_per_group_must_match_the_groups() -> None:
    swa = SWA([0.1, 0.2], start_epoch=0)
    engine, _ = swa_engine(swa, epochs=1)
    with pytest.raises(ConfigError, match="swa_lr has 2 learning rates but the optimizer has 1 groups"):
        engine.fit()


def test_doctests() -> None:
    for module in (ema_module, swa_module):
        assert doctest.testmod(module, optionflags=doctest.ELLIPSIS).failed == 0
