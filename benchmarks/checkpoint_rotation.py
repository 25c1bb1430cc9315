"""Does a save cost more when output_dir holds many checkpoints? 10 against 200, ``save_total_limit=None``.

Usage: python -m benchmarks.checkpoint_rotation [--job tiny|mlp] [--rounds N] [--many M] [--dir DIR]

HF's default keeps every checkpoint (``save_total_limit=None``). A save is what ``Checkpointing.save``
does on the main process: ``save_checkpoint`` then ``rotate_checkpoints``. Two output_dirs, one with
10 checkpoints and one with 200 (``--many``; copies of one), are saved into in turn (which first alternates),
each save timed (wall clock, fsyncs included); the checkpoint just written is deleted untimed, so
the counts stay, and ``os.sync()`` runs untimed after each pair.

Rows:
  trainbus               rotation with no limit lists names only (rotation.py)
  manifests read (before) the same save, then every checkpoint's manifest read, as rotation did

Printed: the median ms with 10 and with 200 checkpoints, and the median of each round's ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.checkpoint_speed import JOBS, make_engine
from benchmarks.common import print_table
from trainbus.plugins.checkpoints.checkpoint import list_checkpoints, rotate_checkpoints, save_checkpoint

COUNTS = (10, 200)
MODES = ("trainbus", "manifests read (before)")


def run_mode(
    widths: tuple[int, ...], rounds: int, directory: Path, before: bool, counts: tuple[int, int] = COUNTS
) -> dict[int, list[float]]:
    """Seconds per save with each number of checkpoints there, one per round."""
    engine = make_engine(widths)
    dirs = {}
    for count in counts:
        out = directory / f"with-{count}"
        engine.state.global_step = 1
        template = save_checkpoint(engine, out)
        for step in range(2, count + 1):
            shutil.copytree(template, out / f"checkpoint-{step}")
        dirs[count] = out
    os.sync()
    times: dict[int, list[float]] = {count: [] for count in counts}
    for round_ in range(rounds):
        for count in counts if round_ % 2 == 0 else counts[::-1]:
            out = dirs[count]
            engine.state.global_step = 10_000 + round_
            began = time.perf_counter()
            written = save_checkpoint(engine, out)
            rotate_checkpoints(out, None, None, [written])
            if before:
                list_checkpoints(out)  # what rotation read at every save
            times[count].append(time.perf_counter() - began)
            shutil.rmtree(written)
        os.sync()
    return times


def table(results: dict[str, dict[int, list[float]]]) -> list[list[str]]:
    rows = []
    for mode, times in results.items():
        few, many = sorted(times)
        ratios = [b / a for a, b in zip(times[few], times[many], strict=True)]
        rows.append(
            [
                mode,
                *(f"{statistics.median(times[c]) * 1e3:.2f}" for c in (few, many)),
                f"{statistics.median(ratios):.2f}x",
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, dict[int, list[float]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="tiny", choices=sorted(JOBS))
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--many", type=int, default=COUNTS[1], help="checkpoints in the fuller output_dir")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    widths = JOBS[args.job][0]
    counts = (COUNTS[0], args.many)
    results = {}
    for mode in MODES:
        with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-rotation-") as directory:
            results[mode] = run_mode(widths, args.rounds, Path(directory), before=mode != MODES[0], counts=counts)
    print_table(
        f"{args.job}: MLP {'-'.join(map(str, widths))}, save_total_limit=None, {args.rounds} rounds",
        ["save", *(f"ms with {c} checkpoints" for c in counts), f"{counts[1]} / {counts[0]}"],
        table(results),
    )
    return results


if __name__ == "__main__":
    main()
