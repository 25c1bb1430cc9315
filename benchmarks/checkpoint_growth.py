"""Does a save cost more late in a run? A checkpoint at step 1,000 against one at step 20,000, logging every step.

Usage: python -m benchmarks.checkpoint_growth [--job mlp|tiny] [--rounds N] [--every K] [--dir DIR]

Each run is the model of ``checkpoint_speed`` (the crash-test MLP after an AdamW step; ``tiny`` checks
the code path) with a log history of one HF-style record per step (loss, grad_norm, learning_rate,
epoch, step), saved every ``--every`` steps as a run saves: between two saves ``every`` records are
appended. Two runs go side by side, one from step 1,000 and one from step 20,000, their saves
alternating (first which one alternates too), each timed (wall clock, fsyncs included); the
checkpoint before the newest is deleted untimed and ``os.sync()`` runs untimed after each pair.

Rows:
  segmented (trainbus)   the history's full segments of 256 records are hard-linked from the last
                         save, the rest goes into trainer_state.json (checkpoints/history.py)
  whole history (before) the whole history written into trainer_state.json at every save, as before
                         (the segment size set beyond the history's length)

Printed: the median ms at each step, and the median over rounds of each round's ratio of the save
at step 20,000 to the save at step 1,000 (its interquartile range), with the worst round's ratio.
The saves of one run cross segment boundaries, so the rows include the saves that write a segment.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.checkpoint_speed import JOBS, make_engine
from benchmarks.common import print_table
from trainbus.engine import Engine
from trainbus.plugins.checkpoints import history
from trainbus.plugins.checkpoints.checkpoint import save_checkpoint

STEPS = (1_000, 20_000)
MODES = ("segmented (trainbus)", "whole history (before)")


def records(first: int, last: int) -> list[dict[str, float | int]]:
    """HF's per-step training logs for steps ``first`` .. ``last - 1``."""
    return [
        {"loss": 2.0 / (1 + step) ** 0.3, "grad_norm": 1.0 + 1e-3 * step, "learning_rate": 5e-5 * (1 - step / 40_000),
         "epoch": step / 1_250, "step": step}
        for step in range(first, last)
    ]  # fmt: skip


@contextmanager
def whole_history(on: bool) -> Iterator[None]:
    """The way before: every record into trainer_state.json (no segment is ever full)."""
    saved = history.SEGMENT
    history.SEGMENT = 1 << 40 if on else saved
    try:
        yield
    finally:
        history.SEGMENT = saved


def run_mode(widths: tuple[int, ...], rounds: int, every: int, directory: Path, before: bool) -> dict[int, list[float]]:
    """Seconds per save at each starting step, one per round."""
    runs: dict[int, tuple[Engine, Path]] = {}
    for start in STEPS:
        engine = make_engine(widths)
        engine.state.log_history = records(0, start - every)
        engine.state.global_step = start - every
        out = directory / f"from-{start}"
        with whole_history(before):
            save_checkpoint(engine, out)  # the save before, untimed: the one the next links from
        runs[start] = (engine, out)
    times: dict[int, list[float]] = {start: [] for start in STEPS}
    for round_ in range(rounds):
        for start in STEPS if round_ % 2 == 0 else STEPS[::-1]:
            engine, out = runs[start]
            step = engine.state.global_step
            engine.state.log_history.extend(records(step, step + every))
            engine.state.global_step = step + every
            with whole_history(before):
                began = time.perf_counter()
                save_checkpoint(engine, out)
                times[start].append(time.perf_counter() - began)
            shutil.rmtree(out / f"checkpoint-{step}")  # untimed: rotation
        os.sync()
    return times


def table(results: dict[str, dict[int, list[float]]]) -> list[list[str]]:
    rows = []
    for mode, times in results.items():
        ratios = [late / early for early, late in zip(times[STEPS[0]], times[STEPS[1]], strict=True)]
        spread = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        rows.append(
            [
                mode,
                f"{statistics.median(times[STEPS[0]]) * 1e3:.2f}",
                f"{statistics.median(times[STEPS[1]]) * 1e3:.2f}",
                f"{statistics.median(ratios):.2f}x (IQR {spread[2] - spread[0]:.2f}, worst {max(ratios):.2f}x)",
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, dict[int, list[float]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="mlp", choices=sorted(JOBS))
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--every", type=int, default=50, help="steps between saves (one log record per step)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    widths = JOBS[args.job][0]
    results = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-growth-") as directory:
            results[mode] = run_mode(widths, args.rounds, args.every, Path(directory), before=mode != MODES[0])
    print_table(
        f"{args.job}: MLP {'-'.join(map(str, widths))}, a log record per step, a save every {args.every} steps, "
        f"{args.rounds} rounds",
        ["log history", *(f"ms at step {step:,}" for step in STEPS), f"step {STEPS[1]:,} / step {STEPS[0]:,}"],
        table(results),
    )
    return results


if __name__ == "__main__":
    main()
