"""The benchmark's runs do what they claim (no timing asserted here: timing lives in benchmarks/)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.common import make_batches, paired_ratio
from benchmarks.overhead import bookkeeping_cost, dispatch_cost, engine_run, raw_run, syncs_per_step
from benchmarks.rows import _engine_stack, _raw_stack


def test_engine_and_plugin_stack_read_no_tensor_value_per_step() -> None:
    torch.set_num_threads(1)
    batches = make_batches(12)
    assert syncs_per_step(engine_run(batches), 12, batches) == 0
    assert syncs_per_step(_engine_stack(batches), 12, batches) == 0


def test_engine_trains_like_the_raw_loop_it_is_timed_against() -> None:
    batches = make_batches(6)
    engine, raw = engine_run(batches), raw_run(batches)
    ratio, iqr, base_s, run_s = paired_ratio(raw, engine, rounds=2)
    assert ratio > 0 and iqr >= 0 and base_s > 0 and run_s > 0


def test_stack_and_its_raw_baseline_take_the_same_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Same model, data, accumulation, clipping and schedule: the weights end up equal."""
    from benchmarks import rows

    batches = make_batches(10)
    models: list[torch.nn.Module] = []
    original = rows.make_model
    monkeypatch.setattr(rows, "make_model", lambda: models.append(original()) or models[-1])
    _engine_stack(batches)()
    _raw_stack(batches)()
    engine_model, raw_model = models
    for a, b in zip(engine_model.parameters(), raw_model.parameters()):
        torch.testing.assert_close(a, b)


def test_cost_probes_run() -> None:
    assert bookkeeping_cost(steps=50) > 0 and dispatch_cost(1, fires=100) > 0


def test_engine_and_stack_run_exactly_the_tensor_ops_of_their_raw_baselines() -> None:
    """The counted half of the benchmark: the Python around the calls differs, the ATen work does not."""
    from benchmarks.work import aten_ops

    torch.set_num_threads(1)
    batches = make_batches(9)  # 3 windows of the stack's 4, the last one short
    for raw, framework in ((raw_run(batches), engine_run(batches)), (_raw_stack(batches), _engine_stack(batches))):
        raw()
        framework()  # warm-up: lazy optimizer state
        raw_ops, framework_ops = aten_ops(raw), aten_ops(framework)
        assert raw_ops and framework_ops == raw_ops


def test_bytecode_count_grows_with_the_work_traced() -> None:
    from benchmarks.work import bytecodes

    def loop(n: int) -> None:
        total = 0
        for i in range(n):
            total += i

    one, two, three = (bytecodes(lambda n=n: loop(n)) for n in (10, 20, 30))
    assert two - one == three - two > 0


def test_async_checkpoint_benchmark_times_what_its_rows_name(capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/checkpoint_async.py --quick: the sync run writes on the training thread with no host copy,
    the async runs copy into host buffers and every write runs on the writer thread; every measured save
    is counted, and the writer's niceness is put back."""
    from benchmarks import checkpoint_async
    from trainbus.plugins.checkpoints import background

    niceness = background.WRITER_NICENESS
    figures = checkpoint_async.main(["--quick", "--rounds", "1", "--saves", "2", "--niceness", "10,0"])
    assert niceness == background.WRITER_NICENESS
    sync = figures[checkpoint_async.SYNC]
    asyncs = [f for name, f in figures.items() if name.startswith("async")]
    assert len(asyncs) == 2
    # 4 saves per run: the warm-up one, 2 measured, the last step's
    assert sync.writes == 4 and sync.off_main == 0 and sync.buffer_bytes == 0 and len(sync.stalls) == 2
    for f in asyncs:
        assert f.writes == f.off_main == 4 and f.buffer_bytes > 0 and len(f.stalls) == len(f.write_s) == 2
        assert all(copy > 0 for copy in f.copy)
    out = capsys.readouterr().out
    assert "async save (writer nice 0)" in out and "sync save" in out
