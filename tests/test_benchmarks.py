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
