"""Many kill trials of asynchronous checkpoints (#36 item 3): a signal at a random moment of a background write.

Usage: python -m benchmarks.async_kill_trials [--trials N] [--trainer N] [--sigterm N] [--seed S] [--dir DIR]

Each trial (``tests/async_kill_jobs.py``: ``kill_trial``) starts a run with ``save_async=True``, a save every 3
steps and ``save_total_limit=2`` (an Engine, or a Trainer for ``--trainer`` of them), whose writer's phases are
slowed by 8 ms each in the child; it waits for the start of a seeded save (9 to 21 of 24 steps), sleeps a seeded
random 0-96 ms and sends SIGKILL (SIGTERM for ``--sigterm`` of them), checks what the run left, resumes it from
True to the end and compares it with an uninterrupted synchronous run. Every trial is a fresh process (forked
from a server that imported torch and trainbus once).

Printed: one row per phase the signal landed in (the writer's last event before it: ``file`` = between or
before tensor files, ``sync`` = manifest written, ``publish`` = synced, not renamed, ``published`` = renamed,
``rotate`` / ``remove`` = rotation, ``idle`` = no write in flight), with how many trials kept each promise:

  killed        the signal ended the run (SIGKILL: -9, SIGTERM: exit 143 with a stop checkpoint)
  intact        every checkpoint-N left is complete and byte-equal to the uninterrupted run's
  kept          no checkpoint published before the signal was lost
  newest        the resume took the newest complete checkpoint (a complete .tmp put back counts)
  bit-exact     the resumed run's weights and optimizer state equal the uninterrupted run's
  tidied        no checkpoint-N.tmp/.old/.del left after the resume, and rotation kept the 2 newest
  stop twice    (SIGTERM) the stop checkpoint was written twice (the xfail in tests/test_async_checkpoint_kills.py)
"""

from __future__ import annotations

import argparse
import shutil
import signal
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from benchmarks.common import print_table
from tests import async_kill_jobs as jobs

COLUMNS = ["killed", "intact", "kept", "newest", "bit-exact", "tidied", "stop twice"]


def outcome(record: dict[str, Any]) -> dict[str, bool]:
    """Which promises one trial kept (``intact`` False when inspecting what it left raised)."""
    left, after = record["left"], record["after"]
    stop = record["signal"] == "SIGTERM"
    spans = [what.split()[1] for _, what in record["events"] if what.startswith("start ")]
    newest = left["steps"][-1] if left["steps"] else None
    return {
        "killed": record["exit"] == (143 if stop else -signal.SIGKILL),
        "intact": True,
        "kept": newest is not None and newest >= record["published"],
        "newest": newest is not None and str(record["resumed_from"]).endswith(f"checkpoint-{newest}"),
        "bit-exact": record["bit_exact"],
        # rotation keeps two: the last two saves, or a stop's checkpoint after the last scheduled one (23) and 24
        "tidied": after["leftovers"] == [] and len(after["steps"]) == 2 and after["steps"][-1] == jobs.MAX_STEPS
        and after["steps"][0] >= jobs.MAX_STEPS - jobs.SAVE_STEPS,
        "stop twice": stop and len(spans) != len(set(spans)),
    }


def run_trials(root: Path, trials: int, trainer: int, sigterm: int, seed: int) -> list[dict[str, Any]]:
    refs = {kind: jobs.reference(kind, root / f"reference-{kind}") for kind in ("engine", "trainer") if kind == "engine"
            or trainer}  # fmt: skip
    results = []
    for i in range(trials):
        kind = "trainer" if i < trainer else "engine"
        signum = signal.SIGTERM if trainer <= i < trainer + sigterm else signal.SIGKILL
        work = root / f"trial-{i}"
        try:
            record = jobs.kill_trial(kind, work, refs[kind], seed + i, signum)
            record["kept"] = outcome(record)
        except AssertionError as exc:  # inspect_after_kill: a torn or different checkpoint-N
            record = {"kind": kind, "signal": signal.Signals(signum).name, "phase": "?", "error": str(exc)[:300]}
            record["kept"] = {name: name != "intact" and name != "stop twice" for name in COLUMNS}
        results.append(record)
        shutil.rmtree(work, ignore_errors=True)
        bad = [name for name, ok in record["kept"].items() if ok == (name == "stop twice")]
        print(f"trial {i}: {record['kind']} {record['signal']} in {record['phase']}: {bad or 'every promise kept'}",
              flush=True)  # fmt: skip
    return results


def table(results: list[dict[str, Any]]) -> None:
    by_phase: dict[str, Counter[str]] = defaultdict(Counter)
    for record in results:
        for key in (f"{record['signal']} in {record['phase']}", f"{record['signal']}, all"):
            by_phase[key]["trials"] += 1
            by_phase[key].update(name for name, ok in record["kept"].items() if ok)
    rows = [[key, str(c["trials"]), *(f"{c[name]}" for name in COLUMNS)] for key, c in sorted(by_phase.items())]
    print_table("async checkpoint kill trials (counts of trials that kept each promise)", ["signal in phase",
                "trials", *COLUMNS], rows)  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=120)
    parser.add_argument("--trainer", type=int, default=10, help="how many of the trials kill a Trainer")
    parser.add_argument("--sigterm", type=int, default=20, help="how many of the Engine trials send SIGTERM")
    parser.add_argument("--seed", type=int, default=1000)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args(argv)
    root = args.dir or Path(tempfile.mkdtemp(prefix="async-kills-"))
    started = time.monotonic()
    results = run_trials(root, args.trials, args.trainer, args.sigterm, args.seed)
    table(results)
    print(f"\n{len(results)} trials in {time.monotonic() - started:.0f} s")
    for record in results:
        if "error" in record:
            print(f"error: {record['error']}")
    return results


if __name__ == "__main__":
    main()
