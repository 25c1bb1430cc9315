"""SkipNonFinite (a NaN / Inf loss or gradient skips the step, decided on the device) and debug="underflow_overflow"."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_helpers import free_port, run_processes
from facade_helpers import Regressor, quiet_args, regression_data
from op_recorder import OpRecorder

from trainbus.engine import ConfigError, Engine, Event, Priority
from trainbus.engine.testing import count_syncs, everything_but
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, resume
from trainbus.plugins.distributed.processes import close_group
from trainbus.plugins.facade.arguments import TrainingArguments
from trainbus.plugins.facade.trainer import Trainer
from trainbus.plugins.observability.debug import UnderflowOverflowDebug
from trainbus.plugins.optimization.accumulation import GradientAccumulation
from trainbus.plugins.optimization.nonfinite import SkipNonFinite
from trainbus.plugins.optimization.precision import MixedPrecision
from trainbus.plugins.optimization.schedulers import LRScheduler

OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.05, fused=True),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05, fused=True),
}


def batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 3, generator=g), torch.randn(4, 1, generator=g)) for _ in range(n)]


def make_engine(
    steps: int,
    plugins: list[Any],
    *,
    bad_step: int | None = None,
    where: str = "grad",
    accumulation: int = 1,
    log_every: int | None = None,
    optimizer: str = "adamw",
    fp16_style_skip: bool = False,
    data: list[Any] | None = None,
) -> Engine:
    """A small MLP on fused AdamW with a warmup schedule; at window ``bad_step`` a gradient (or the loss) turns
    non-finite. ``fp16_style_skip``: the reference, an optimizer-step hook that returns False at that window,
    which is how the engine sees an fp16 overflow."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    extra: list[Any] = [GradientAccumulation(accumulation)] if accumulation > 1 else []
    engine = Engine(
        model,
        OPTIMIZERS[optimizer](model.parameters()),
        train_data=data if data is not None else batches(steps * accumulation),
        max_steps=steps,
        loss_fn=torch.nn.MSELoss(),
        plugins=[*extra, LRScheduler("linear", num_warmup_steps=3), *plugins],
    )

    def in_bad_window(ev: Any) -> bool:
        return ev.engine.state.global_step + 1 == bad_step and ev.micro_index == accumulation - 1

    def poison_grad(ev: Any) -> None:
        if in_bad_window(ev):
            model[0].weight.grad[1, 2] = float("inf")

    def poison_loss(ev: Any) -> None:
        if in_bad_window(ev):  # a NaN that does not reach the gradients (d(loss + c)/dp = dloss/dp)
            ev.loss = ev.loss + torch.tensor(float("nan"))

    if bad_step is not None:
        if where == "grad":
            engine.on(Event.BACKWARD_END, poison_grad)
        else:
            engine.on(Event.LOSS, poison_loss, priority=Priority.PRODUCER + 1)
    if log_every is not None:
        engine.on(Event.STEP_END(every=log_every), lambda ev: setattr(ev.engine.control, "should_log", True))
    if fp16_style_skip:
        engine.wrap_hook(
            "optimizer_step",
            lambda inner: lambda opt: False if engine.state.global_step + 1 == bad_step else inner(opt),
        )
    return engine


def snapshot(engine: Engine) -> dict[str, Any]:
    assert engine.optimizer is not None
    return {
        "params": [p.detach().clone() for p in engine.model.parameters()],
        "optimizer": copy.deepcopy(engine.optimizer.state_dict()),
    }


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), (a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b, (a, b)


def record_logs(engine: Engine) -> list[tuple[Any, ...]]:
    """(step, optimizer steps taken, schedule position, lr, nonfinite_steps) at every logging point."""
    rows: list[tuple[Any, ...]] = []

    def row(ev: Any) -> None:
        scheduler = ev.engine.get_plugin(LRScheduler).scheduler
        state = ev.engine.state
        lr = ev.engine.optimizer.param_groups[0]["lr"]
        rows.append((state.global_step, state.optimizer_steps_taken, scheduler.last_epoch, lr))

    engine.on(Event.LOG, row, priority=Priority.CONSUMER)
    return rows


# -- the skip itself ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize(("where", "accumulation"), [("grad", 1), ("loss", 1), ("grad", 2)])
def test_a_nonfinite_window_leaves_parameters_and_optimizer_state_as_they_were(
    optimizer: str, where: str, accumulation: int
) -> None:
    skip = SkipNonFinite()
    engine = make_engine(7, [skip], bad_step=4, where=where, accumulation=accumulation, optimizer=optimizer)
    snaps: dict[int, dict[str, Any]] = {}
    engine.on(
        Event.STEP_START,
        lambda ev: snaps.setdefault(ev.engine.state.global_step, snapshot(ev.engine)),
        priority=Priority.FIRST,
    )
    engine.on(Event.STEP_END, lambda ev: snaps.setdefault(100 + ev.engine.state.global_step, snapshot(ev.engine)))
    engine.fit()
    before, after = snaps[3], snaps[104]
    assert_same(before["params"], after["params"])  # window 4 changed nothing
    assert_same(before["optimizer"]["state"], after["optimizer"]["state"])  # the schedule is taken back at the log
    for step in (5, 6, 7):  # later windows train normally
        before, after = snaps[step - 1 + 100], snaps[step + 100]
        assert all(not torch.equal(a, b) for a, b in zip(before["params"], after["params"]))
        assert all(p.isfinite().all() for p in after["params"])
    assert skip.skipped_steps == 1 and engine.state.optimizer_steps_taken == 6 and engine.state.global_step == 7


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bad_step", [1, 4])
def test_the_run_equals_one_whose_step_was_skipped_like_an_fp16_overflow(optimizer: str, bad_step: int) -> None:
    # bad_step=1: the skipped step is the optimizer's first (fused SGD would build garbage momentum buffers there);
    # logging every 4 steps puts step 4 at the end of a logging window, where the schedule is taken back
    runs = []
    for plugins, reference in (([SkipNonFinite()], False), ([], True)):
        engine = make_engine(9, plugins, bad_step=bad_step, log_every=1 if bad_step == 1 else 4, optimizer=optimizer,
                             fp16_style_skip=reference)  # fmt: skip
        rows = record_logs(engine)
        engine.fit()
        scheduler = engine.get_plugin(LRScheduler).scheduler  # type: ignore[union-attr]
        runs.append((snapshot(engine), scheduler.state_dict(), engine.state.optimizer_steps_taken, rows))
    assert_same(runs[0], runs[1])


def test_within_a_logging_window_only_the_rate_lags_and_it_is_exact_again_at_the_logging_point() -> None:
    runs = []
    for plugins, reference in (([SkipNonFinite()], False), ([], True)):
        engine = make_engine(9, plugins, bad_step=4, log_every=3, fp16_style_skip=reference)
        rows = record_logs(engine)
        engine.fit()
        runs.append((rows, engine.state.optimizer_steps_taken, engine.get_plugin(LRScheduler).scheduler.last_epoch))  # type: ignore[union-attr]
    assert runs[0] == runs[1]  # steps taken, schedule position and rate agree at steps 3, 6, 9 and at the end


def test_sync_true_skips_exactly_like_an_fp16_overflow_mid_window_and_with_any_optimizer() -> None:
    runs = []
    for plugins, reference in (([SkipNonFinite(sync=True)], False), ([], True)):
        torch.manual_seed(0)
        engine = make_engine(9, plugins, bad_step=5, log_every=3, fp16_style_skip=reference)
        steps: list[bool] = []
        engine.on(Event.STEP_END, lambda ev, steps=steps: steps.append(ev.stepped))
        engine.fit()
        runs.append((snapshot(engine), engine.get_plugin(LRScheduler).scheduler.state_dict(), steps))  # type: ignore[union-attr]
    assert_same(runs[0], runs[1])
    assert runs[0][2] == [True] * 4 + [False] + [True] * 4

    model = torch.nn.Linear(3, 1)  # a plain (for-loop) optimizer: only sync=True can skip its step
    skip = SkipNonFinite(sync=True)
    data = batches(3)
    data[1][0][0, 0] = float("nan")
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_epochs=1,
                    loss_fn=torch.nn.MSELoss(), plugins=[skip])  # fmt: skip
    assert engine.fit().optimizer_steps_taken == 2 and skip.skipped_steps == 1
    assert model.weight.isfinite().all()


def test_the_count_reaches_the_log_records_of_the_windows_it_happened_in(tmp_path: Path) -> None:
    data = regression_data(24)
    data[9]["x"] = torch.tensor([float("nan"), 1.0])  # batch 3 (of 4 samples) -> step 3
    data[21]["x"] = torch.tensor([1.0, float("inf")])  # step 6
    args = quiet_args(tmp_path, max_steps=6, logging_steps=2, learning_rate=0.1)
    assert args.optim == "adamw_torch_fused"  # HF's default: the fused kernels read found_inf
    skip = SkipNonFinite()
    trainer = Trainer(Regressor(), args, train_dataset=data, callbacks=[skip])
    out = trainer.train()
    windows = [r for r in trainer.state.log_history if "loss" in r]
    assert [(r["step"], r["nonfinite_steps"]) for r in windows] == [(2, 0), (4, 1), (6, 1)]
    assert out.global_step == 6 and trainer.state.optimizer_steps_taken == 4 and skip.skipped_steps == 2
    assert all(p.isfinite().all() for p in trainer.model.parameters())
    assert all(r.get("nonfinite_steps") is None for r in trainer.state.log_history if "loss" not in r)


@pytest.mark.parametrize("skip_first", [False, True])
def test_an_fp16_overflow_stays_the_loss_scalers_skip_and_is_not_taken_back_twice(skip_first: bool) -> None:
    skip, amp = SkipNonFinite(), MixedPrecision("fp16", init_scale=2.0**4)
    engine = make_engine(6, [skip, amp] if skip_first else [amp, skip], bad_step=3, log_every=2)
    engine.fit()
    assert (amp.skipped_steps, skip.skipped_steps) == (1, 0)
    assert engine.state.optimizer_steps_taken == 5
    assert engine.get_plugin(LRScheduler).scheduler.last_epoch == 5  # type: ignore[union-attr]


# -- no host read per step -------------------------------------------------------------------------------
def syncs(steps: int, plugins: list[Any], log_every: int | None = None) -> int:
    data = batches(steps)
    data[2][0][0, 0] = float("nan")
    engine = make_engine(steps, plugins, log_every=log_every, data=data)
    with count_syncs(on_device=everything_but(data)) as counter:  # the CPU proxy: all but the batches are "GPU"
        engine.fit()
    return counter.count


def test_the_skip_reads_nothing_on_the_host_per_step_only_once_per_logging_window() -> None:
    for steps in (6, 12):
        base = syncs(steps, [])
        assert syncs(steps, [SkipNonFinite()]) - base == 1  # the read at TRAIN_END, however many steps
        assert syncs(steps, [SkipNonFinite()], log_every=3) - syncs(steps, [], log_every=3) == steps // 3 + 1
        assert syncs(steps, [SkipNonFinite(sync=True)]) - base == steps  # what sync=True trades for exactness


def test_the_check_costs_five_scalar_sized_kernels_per_step() -> None:
    runs = []
    for plugins in ([], [SkipNonFinite()]):
        engine = make_engine(4, plugins)
        recorder = OpRecorder()
        engine.on(Event.STEP_START, recorder.mark, priority=Priority.FIRST + 10)
        with recorder:
            engine.fit()
        runs.append(recorder.steps[1:-1])  # per step, without TRAIN_START and the last step's TRAIN_END
    for without, with_skip in zip(*runs):
        assert Counter(without) - Counter(with_skip) == Counter()
        assert Counter(with_skip) - Counter(without) == Counter(
            {
                "aten.detach.default": 1,  # the loss kept for the check (an alias, no kernel)
                "aten.view.default": 1,  # its reshape to a scalar
                "aten.stack.default": 1,
                "aten.zero_.default": 1,
                "aten._amp_foreach_non_finite_check_and_unscale_.default": 1,  # gradients and loss: one launch
                "aten._foreach_sub_.List": 1,  # fused AdamW takes its step count back by found_inf (torch's)
                "aten.add_.Tensor": 1,  # the counter
            }
        )


# -- state and resume -------------------------------------------------------------------------------------
def test_a_resume_between_the_skip_and_the_logging_point_continues_bit_for_bit(tmp_path: Path) -> None:
    def run(out: Path, resume_from: Path | None = None) -> tuple[Any, ...]:
        skip = SkipNonFinite()
        engine = make_engine(
            9, [skip, Checkpointing(out, save_strategy="steps", save_steps=1)], bad_step=4, log_every=6
        )
        rows = record_logs(engine)
        if resume_from is not None:
            resume(engine, resume_from)
        engine.fit()
        return snapshot(engine), engine.state.optimizer_steps_taken, skip.skipped_steps, rows[-1:]

    whole = run(tmp_path / "whole")
    resumed = run(tmp_path / "resumed", tmp_path / "whole" / "checkpoint-5")  # skipped at 4, not yet read
    assert_same(whole, resumed)
    assert whole[1:3] == (8, 1)


def _two_rank_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
        skip = SkipNonFinite()
        engine = Engine(ddp, torch.optim.AdamW(ddp.parameters(), lr=0.1, fused=True), train_data=batches(4, seed=rank),
                        max_epochs=1, loss_fn=torch.nn.MSELoss(), plugins=[skip])  # fmt: skip

        def nan_on_rank0_only(ev: Any) -> None:  # a NaN loss whose gradients stay finite, on one rank
            if rank == 0 and ev.engine.state.global_step == 1:
                ev.loss = ev.loss + torch.tensor(float("nan"))

        engine.on(Event.LOSS, nan_on_rank0_only, priority=Priority.PRODUCER + 1)
        engine.fit()
        params = [p.detach().reshape(-1).tolist() for p in ddp.module.parameters()]
        result = {"params": params, "skipped": skip.skipped_steps, "taken": engine.state.optimizer_steps_taken}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
        close_group()  # every rank waits, and gloo's threads cannot abort the exit (processes.py)
    finally:
        if dist.is_initialized():  # failed before close_group: the other rank may never reach a barrier
            dist.destroy_process_group()


def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    run_processes(_two_rank_worker, (free_port(), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert ranks[0] == ranks[1]  # without the flag's all-reduce rank 1 would step alone and the weights part
    assert ranks[0]["skipped"] == 1 and ranks[0]["taken"] == 3


def test_bad_arguments_and_optimizers_fail_before_training() -> None:
    with pytest.raises(ConfigError, match="sync must be True or False"):
        SkipNonFinite(sync="yes")  # type: ignore[arg-type]
    model = torch.nn.Linear(3, 1)
    with pytest.raises(ConfigError, match=r"SGD without fused=True .*sync=True"):
        Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=batches(2), max_epochs=1,
               loss_fn=torch.nn.MSELoss(), plugins=[SkipNonFinite()])  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    step_lr = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    engine = Engine(model, optimizer, train_data=batches(2), max_epochs=1, loss_fn=torch.nn.MSELoss(),
                    plugins=[LRScheduler(step_lr), SkipNonFinite()])  # fmt: skip
    with pytest.raises(ConfigError, match="StepLR computes each rate from the last"):
        engine.fit()
    assert engine.state.global_step == 0
    with pytest.raises(ConfigError, match="reconciled must be an integer"):
        SkipNonFinite().load_state_dict({"reconciled": -1})


# -- debug="underflow_overflow" ---------------------------------------------------------------------------
class Overflowing(Regressor):
    """Its first layer's activations overflow float32 to inf from the first batch."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Linear(2, 2)
        with torch.no_grad():
            self.scale.weight.fill_(3e38)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return super().forward(self.scale(x.abs() + 1.0), labels)


def test_debug_underflow_overflow_prints_hf_report_and_aborts_at_the_first_inf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = quiet_args(tmp_path, max_steps=2, debug="underflow_overflow")
    trainer = Trainer(Overflowing(), args, train_dataset=regression_data(8))
    with pytest.raises(ValueError, match="DebugUnderflowOverflow: inf/nan detected"):
        trainer.train()
    out = capsys.readouterr().out
    assert "Detected inf/nan during batch_number=0" in out
    assert "scale Linear" in out and "output has infs" in out


def test_debug_underflow_overflow_traces_a_healthy_model_without_aborting_and_detaches(tmp_path: Path) -> None:
    args = quiet_args(tmp_path, max_steps=2, debug=["underflow_overflow"])
    model = Regressor()
    trainer = Trainer(model, args, train_dataset=regression_data(8))
    trainer.train()
    debug = trainer.get_plugin(UnderflowOverflowDebug)
    assert debug is not None and debug.tracer is not None and debug.tracer.batch_number == 2
    assert model.lin._forward_hooks
    trainer.pop_plugin(debug)
    assert not model.lin._forward_hooks and not model._forward_hooks
    assert Trainer(Regressor(), quiet_args(tmp_path, max_steps=1)).get_plugin(UnderflowOverflowDebug) is None


UO = "underflow_overflow"


@pytest.mark.parametrize(("value", "parsed"), [("", []), (None, []), (UO, [UO]), (f" {UO} ", [UO]), ([UO], [UO])])
def test_debug_is_parsed_as_hf_parses_it(value: Any, parsed: list[str]) -> None:
    assert TrainingArguments("out", debug=value).debug == parsed


def test_debug_rejects_tpu_metrics_and_unknown_options() -> None:
    with pytest.raises(ConfigError, match=r"tpu_metrics_debug.*TPU"):
        TrainingArguments("out", debug="tpu_metrics_debug")
    with pytest.raises(ConfigError, match=r"'underflow_overflw'.*did you mean 'underflow_overflow'"):
        TrainingArguments("out", debug="underflow_overflw")
    with pytest.raises(ConfigError, match="max_frames_to_save"):
        UnderflowOverflowDebug(max_frames_to_save=0)
