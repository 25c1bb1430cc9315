"""Overhead of trainbus against a raw PyTorch loop on a tiny MLP (batch 8, fused AdamW, 1 thread).

Usage: python -m benchmarks.overhead [--steps 3000] [--repeats 7]

Prints: the median time ratio of alternating runs (engine / raw), host syncs per step, and the
dispatch cost of one event with 0, 1 and 10 handlers. Rows for plugin stacks and the Trainer
facade are added by the functions in ROWS when their plugins exist.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import alternate, count_syncs, make_batches, make_model, make_optimizer, print_table, raw_loop
from benchmarks.rows import extra_runs
from trainbus.engine import Engine, Event, EventBus


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


def syncs_per_step(run: Callable[[], None], steps: int) -> float:
    run()  # warm-up outside the counter (lazy optimizer state)
    with count_syncs() as counter:
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


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    batches = make_batches(args.steps)
    runs = {"raw": raw_run(batches), "engine": engine_run(batches)}
    extra = extra_runs(batches)
    runs.update({name: run for name, (run, _) in extra.items()})
    medians = alternate(runs, args.repeats)
    raw = medians["raw"]
    rows = [
        [
            "engine (no plugins)",
            "raw loop",
            f"{medians['engine'] * 1e6 / args.steps:.1f}",
            f"{medians['engine'] / raw:.3f}",
        ]
    ]
    for name, (_, baseline) in extra.items():
        if baseline is None:
            continue
        base = medians[baseline]
        rows.append([name, baseline, f"{medians[name] * 1e6 / args.steps:.1f}", f"{medians[name] / base:.3f}"])
    rows.insert(0, ["raw loop", "-", f"{raw * 1e6 / args.steps:.1f}", "1.000"])
    print_table(
        f"Time per step, median of {args.repeats} alternating runs of {args.steps} steps "
        "(tiny MLP, batch 8, fused AdamW, 1 thread)",
        ["run", "against", "us/step", "ratio"],
        rows,
    )
    sync_steps = 50
    small = make_batches(sync_steps)
    sync_rows = [["engine (no plugins)", f"{syncs_per_step(engine_run(small), sync_steps):.2f}"]]
    for name, (_, baseline) in extra.items():
        if baseline is None:
            continue
        sync_rows.append([name, f"{syncs_per_step(extra_runs(small)[name][0], sync_steps):.2f}"])
    print_table(
        "Host syncs per step (TorchDispatchMode: _local_scalar_dense, is_nonzero, item)",
        ["run", "syncs/step"],
        sync_rows,
    )
    cost = {n: dispatch_cost(n) for n in (0, 1, 10)}
    print_table("Dispatch cost of one event", ["handlers", "us/event"], [[str(n), f"{c:.2f}"] for n, c in cost.items()])
    return {"engine_ratio": medians["engine"] / raw}


if __name__ == "__main__":
    main()
