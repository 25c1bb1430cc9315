"""A plain nn.Module with a compute_loss override that pops the labels: transformers.Trainer vs trainbus."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import run_custom_loss
from harness import assert_same, check_losses_logged, common_argv, run_both, write_json_lines


def rows(n: int, seed: int) -> list[dict[str, object]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        x = [rng.gauss(0, 1) for _ in range(6)]
        out.append({"features": x, "label": 0 if x[0] + x[1] < -0.5 else 1 if x[2] > 0 else 2})
    return out


def argv_for(tmp_path: Path, dropout: float):
    train = write_json_lines(tmp_path / "train.json", rows(36, seed=4))
    validation = write_json_lines(tmp_path / "validation.json", rows(11, seed=5))

    def argv(name: str) -> list[str]:
        # a forward without a labels argument: transformers finds no label names, so the script names them
        return common_argv(
            tmp_path / name, dropout=dropout, cache_dir=tmp_path / f"cache-{name}", train_file=train,
            validation_file=validation, learning_rate=1e-2, label_names="labels",
        )  # fmt: skip

    return argv


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_custom_compute_loss_matches_transformers(tmp_path: Path, dropout: float) -> None:
    hf, tb = run_both(run_custom_loss.main, argv_for(tmp_path, dropout))
    check_losses_logged(hf)
    assert "eval_accuracy" in hf.eval_metrics and "eval_loss" in hf.eval_metrics  # labels read before compute_loss
    assert_same(hf, tb)
