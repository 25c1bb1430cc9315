"""Sequence classification (BERT, raw text column left in the dataset): transformers.Trainer vs trainbus."""

from __future__ import annotations

from pathlib import Path

import pytest
import run_text_classification
from harness import (
    IMPLEMENTATIONS,
    assert_same,
    check_losses_logged,
    common_argv,
    differences,
    run_both,
    run_script,
    sentences,
    write_csv,
    write_tokenizer,
)

BERT = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=37,max_position_embeddings=64"


def argv_for(tmp_path: Path, dropout: float, **overrides: object):
    rows = sentences(46, seed=0)
    files = {
        split: write_csv(tmp_path / f"{split}.csv", part, ["text", "label"])
        for split, part in (("train", rows[:30]), ("validation", rows[30:38]), ("test", rows[38:]))
    }
    tokenizer = write_tokenizer(tmp_path / "tokenizer", [r["text"] for r in rows])

    def argv(name: str) -> list[str]:
        return common_argv(
            tmp_path / name, tokenizer_name=tokenizer, config_overrides=BERT, dropout=dropout,
            cache_dir=tmp_path / f"cache-{name}", train_file=files["train"], validation_file=files["validation"],
            test_file=files["test"], **overrides,
        )  # fmt: skip

    return argv


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_text_classification_matches_transformers(tmp_path: Path, dropout: float) -> None:
    hf, tb = run_both(run_text_classification.main, argv_for(tmp_path, dropout))
    check_losses_logged(hf)
    assert_same(hf, tb)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_resume_matches_transformers(tmp_path: Path, dropout: float) -> None:
    """Resumed mid-epoch from checkpoint-6 in a fresh output_dir: the same run under both, and the same as
    the uninterrupted one (trainbus: bit for bit on CPU)."""
    argv = argv_for(tmp_path, dropout, save_strategy="steps", save_steps=6, save_total_limit=3)
    runs = {}
    for name in IMPLEMENTATIONS:
        full = run_script(run_text_classification.main, argv(name), name)
        checkpoint = tmp_path / name / "checkpoint-6"  # mid-epoch: the resume skips 6 batches
        resumed_argv = [*argv(f"{name}-resumed"), "--resume_from_checkpoint", str(checkpoint)]
        runs[name] = full, run_script(run_text_classification.main, resumed_argv, name)
    (hf_full, hf), (tb_full, tb) = runs["transformers"], runs["trainbus"]
    check_losses_logged(hf)
    # train_loss after a resume: transformers averages only this train() call's steps (7 to 16); trainbus
    # the whole run's, as if never interrupted (#23). Both shown against the logged step losses.
    step_losses = [float(r["loss"]) for r in tb_full.log_history if "loss" in r]
    assert len(step_losses) == 16  # one record per step
    assert tb.train_metrics["train_loss"] == pytest.approx(sum(step_losses) / 16, rel=1e-6)
    resumed_part = sum(step_losses[6:])
    # transformers >= 5.21: the mean of the resumed steps; before (5.18): their sum over all 16 steps
    assert hf.train_metrics["train_loss"] in (
        pytest.approx(resumed_part / 10, rel=1e-5),
        pytest.approx(resumed_part / 16, rel=1e-5),
    )
    assert hf_full.train_metrics["train_loss"] == pytest.approx(tb.train_metrics["train_loss"], rel=1e-5)
    found = differences(hf, tb, ignore=["train_loss"])
    continued = differences(tb_full, tb, files=False)
    found += [f"trainbus resumed (as 'trainbus') vs uninterrupted (as 'transformers'): {d}" for d in continued]
    assert not found, f"{len(found)} differences:\n" + "\n".join(found)
