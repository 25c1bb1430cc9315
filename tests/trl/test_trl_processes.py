"""SFT on 2 gloo processes through torchrun: the script under trl and under trainbus.trl logs the same values.

The loss is the token mean over both processes' window (transformers gathers ``num_items_in_batch``), and
TRL's metrics are gathered over processes; trainbus.trl's TRLMetrics sums over processes before dividing.
"""

from __future__ import annotations

import math
from pathlib import Path

from dist_helpers import launch_job, results

SCRIPT = Path(__file__).resolve().parent / "trl_dist_jobs.py"
KEYS = ("loss", "mean_token_accuracy", "num_tokens", "entropy", "grad_norm", "learning_rate")


def test_sft_on_two_processes_logs_what_trl_logs(tmp_path: Path, tokenizer_dir: str) -> None:
    for job in ("sft-trl", "sft-trainbus"):
        launch_job(SCRIPT, job, tmp_path, 2, env={"TRL_TOKENIZER_DIR": tokenizer_dir})
    ours, theirs = results(tmp_path, "sft-trainbus"), results(tmp_path, "sft-trl")
    steps = [r for r in theirs["log_history"] if "loss" in r]
    assert len(steps) >= 3
    assert len([r for r in ours["log_history"] if "loss" in r]) == len(steps)
    for mine, trl in zip([r for r in ours["log_history"] if "loss" in r], steps):
        for key in KEYS:
            assert math.isclose(mine[key], trl[key], rel_tol=1e-5, abs_tol=1e-8), (key, mine, trl)
    for name, total in theirs["weights"].items():
        assert math.isclose(ours["weights"][name], total, rel_tol=1e-5, abs_tol=1e-6), name
    assert results(tmp_path, "sft-trainbus", 1)["weights"] == ours["weights"]  # the ranks agree
