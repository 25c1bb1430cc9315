"""Overhead of trainbus against a raw PyTorch loop on a tiny MLP (batch 8, fused AdamW, 1 thread).

Usage: python -m benchmarks.overhead [--steps 250] [--rounds 200]

Prints: the time ratio of each run against its baseline (median over paired, alternating rounds),
host syncs per step, the work per batch counted (ATen ops and Python bytecodes, which do not jitter;
see benchmarks/work.py), and the dispatch cost of one event with 0, 1 and 10 handlers. The
plugin-stack and facade rows come from benchmarks/rows.py, each against a raw loop doing the same
work. The first row times the raw loop against a second copy of itself: how far from 1.000 the
instrument reads on this machine (its bias and noise), to judge the other rows by.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import make_batches, make_model, make_optimizer, paired_ratio, print_table, raw_loop
from benchmarks.rows import extra_runs
from benchmarks.work import work_per_batch
from trainbus.engine import Engine, Event, EventBus
from trainbus.engine.testing import count_syncs, everything_but
from trainbus.hooks import Hooks


def engine_run(batches: list[Any], plugins: Callable[[], list[Any]] = list, **kwargs: Any) -> Callable[[], None]:
    model = make_model()
    optimizer = make_optimizer(model)
    engine = Engine(
        model,
        optimizer,
        train_data=batches,
        max_epochs=1,
        loss_fn=torch.nn.CrossEntropyLoss(),
        plugins=plugins(),
        **kwargs,
    )

    def run() -> None:
        engine.state.epochs_completed = 0  # run the same single epoch again
        engine.state.global_step = 0
        engine.fit()

    return run


def raw_run(batches: list[Any]) -> Callable[[], None]:
    model = make_model()
    optimizer = make_optimizer(model)
    loss_fn = torch.nn.CrossEntropyLoss()
    return lambda: raw_loop(model, optimizer, batches, loss_fn)


def syncs_per_step(run: Callable[[], None], steps: int, batches: Any) -> float:
    """Reads of device values per step, by the CPU proxy: every tensor but ``batches`` counts as on a GPU."""
    run()  # warm-up outside the counter (lazy optimizer state)
    with count_syncs(on_device=everything_but(batches)) as counter:
        run()
    return counter.count / steps


def dispatch_cost(handlers: int, fires: int = 200_000) -> float:
    """Microseconds per bus.fire of one event with ``handlers`` no-op handlers."""
    bus = EventBus()
    for _ in range(handlers):
        bus.on(Event.STEP_END, lambda ev: None)
    fire = bus.fire
    start = time.perf_counter()
    for _ in range(fires):
        fire(Event.STEP_END, None)
    return (time.perf_counter() - start) / fires * 1e6


def bookkeeping_cost(handlers_per_event: int = 0, steps: int = 20_000) -> float:
    """Microseconds per step of the loop itself: events, state, windows; no tensor work."""
    model = torch.nn.Linear(1, 1)
    zero = torch.zeros(())
    noop = Hooks(
        forward=lambda m, b: zero,
        compute_loss=lambda o, b: zero,
        backward=lambda loss: None,
        optimizer_step=lambda o: True,
        zero_grad=lambda o: None,
    )
    batch = (zero, zero)
    engine = Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=[batch] * steps, max_epochs=1, hooks=noop
    )
    for event in Event.ALL:
        for _ in range(handlers_per_event):
            engine.on(event, lambda ev: None)
    start = time.thread_time()
    engine.fit()
    return (time.thread_time() - start) / steps * 1e6


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=250, help="optimizer steps per timed run")
    parser.add_argument("--rounds", type=int, default=200, help="paired rounds per row")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    batches = make_batches(args.steps)
    raw = raw_run(batches)
    rows_spec: list[tuple[str, str, Callable[[], None], Callable[[], None]]] = [
        ("raw loop (A/A: the instrument)", "raw loop", raw, raw_run(batches)),
        ("engine (no plugins)", "raw loop", raw, engine_run(batches)),
    ]
    extra = extra_runs(batches)
    for name, (run, baseline) in extra.items():
        if baseline is not None:
            rows_spec.append((name, baseline, extra[baseline][0], run))
    rows = []
    ratios: dict[str, float] = {}
    for name, baseline_name, baseline, run in rows_spec:
        ratio, iqr, base_s, run_s = paired_ratio(baseline, run, args.rounds)
        ratios[name] = ratio
        per_batch = [f"{base_s * 1e6 / args.steps:.1f}", f"{run_s * 1e6 / args.steps:.1f}"]
        rows.append([name, baseline_name, *per_batch, f"{ratio:.3f}", f"{iqr:.3f}"])
    print_table(
        f"Time per batch: median of {args.rounds} paired rounds of {args.steps} batches "
        "(tiny MLP, batch 8, fused AdamW, 1 thread)",
        ["run", "against", "baseline us/batch", "run us/batch", "ratio", "IQR"],
        rows,
    )
    sync_steps = 40
    small = make_batches(sync_steps)
    sync_rows = [["engine (no plugins)", f"{syncs_per_step(engine_run(small), sync_steps, small):.2f}"]]
    small_extra = extra_runs(small)
    for name, (run, baseline) in small_extra.items():
        if baseline is not None:
            sync_rows.append([name, f"{syncs_per_step(run, sync_steps, small):.2f}"])
    print_table(
        "Reads of device values per step (TorchDispatchMode; CPU proxy: every tensor but the data's batches "
        "stands for a GPU tensor, so each read would be a host sync)",
        ["run", "reads/step"],
        sync_rows,
    )
    work_rows = []
    for name, baseline_name, baseline, run in rows_spec[1:]:  # the timed runs; the A/A row would count alike
        base_ops, base_codes = work_per_batch(baseline, args.steps)
        run_ops, run_codes = work_per_batch(run, args.steps)
        counts = [f"{base_ops:.2f}", f"{run_ops:.2f}", f"{base_codes:.0f}", f"{run_codes - base_codes:+.0f}"]
        work_rows.append([name, baseline_name, *counts])
    print_table(
        "Work per batch of the timed runs, counted (no jitter): ATen ops, Python bytecodes",
        ["run", "against", "baseline ops", "run ops", "baseline bytecodes", "run's extra bytecodes"],
        work_rows,
    )
    print_table(
        "Engine bookkeeping per step, step functions replaced by no-ops (the loop's own cost)",
        ["run", "us/step"],
        [
            ["engine, no handlers", f"{bookkeeping_cost():.2f}"],
            ["engine, 1 handler on every event", f"{bookkeeping_cost(1):.2f}"],
        ],
    )
    cost = {n: dispatch_cost(n) for n in (0, 1, 10)}
    print_table(
        "Dispatch cost of one event (bus.fire)",
        ["handlers", "us/event"],
        [[str(n), f"{c:.2f}"] for n, c in cost.items()],
    )
    return ratios


if __name__ == "__main__":
    main()
