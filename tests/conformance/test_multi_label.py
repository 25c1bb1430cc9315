"""Multi-label classification (BERT, problem_type="multi_label_classification", float multi-hot labels, BCE):
transformers.Trainer vs trainbus."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import run_multi_label
from families import (
    BERT,
    listing,
    logged_losses,
    multi_label_rows,
    resume_differences,
    transformers_sums_micro_batches,
)
from harness import (
    assert_same,
    check_losses_logged,
    common_argv,
    differences,
    run_both,
    run_script,
    write_json_lines,
    write_tokenizer,
)
from transformers import BertForSequenceClassification


def argv_for(tmp_path: Path, dropout: float, **overrides: object):
    rows = multi_label_rows(46, seed=11)
    files = {
        split: write_json_lines(tmp_path / f"{split}.json", part)
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


def test_multi_label_matches_transformers(tmp_path: Path) -> None:
    hf, tb = run_both(run_multi_label.main, argv_for(tmp_path, 0.1))
    check_losses_logged(hf)
    # the comparison has teeth: float multi-hot labels (several per row, some rows none) reached the metrics
    labels = np.asarray(hf.label_ids)
    assert labels.dtype.kind == "f" and labels.shape == (8, 4) and 0 < labels.sum() < labels.size
    assert {"predict_f1", "predict_subset_accuracy", "predict_loss"} <= set(hf.predict_metrics)
    assert_same(hf, tb)


def test_multi_label_subclass_matches_transformers(tmp_path: Path) -> None:
    """A Trainer subclass with a weighted BCE (compute_loss pops the labels) and an in-order sampler
    (``_get_train_sampler``), both reading attributes set after ``super().__init__``."""
    hf, tb = run_both(run_multi_label.main, argv_for(tmp_path, 0.1, loss_pos_weight=3.0, in_order=True))
    check_losses_logged(hf)
    plain = run_script(run_multi_label.main, argv_for(tmp_path, 0.1)("plain"), "transformers")
    # the comparison has teeth: the subclass's loss and sampler changed transformers' run
    assert logged_losses(hf)[0] != logged_losses(plain)[0] and logged_losses(hf)[1:3] != logged_losses(plain)[1:3]
    assert_same(hf, tb)


def test_multi_label_subclass_accumulation_equals_one_batch(tmp_path: Path) -> None:
    """The subclass's compute_loss returns its micro-batch mean (it ignores ``num_items_in_batch``): batch 2 x
    accumulation 2 under trainbus equals batch 4 without accumulation; transformers sums the 2 means."""
    weighted = {"loss_pos_weight": 3.0}
    accumulated = argv_for(tmp_path, 0.0, per_device_train_batch_size=2, gradient_accumulation_steps=2, **weighted)
    one_batch = argv_for(tmp_path, 0.0, per_device_train_batch_size=4, **weighted)
    reference = run_script(run_multi_label.main, one_batch("reference"), "transformers")
    hf = run_script(run_multi_label.main, accumulated("transformers"), "transformers")
    tb = run_script(run_multi_label.main, accumulated("trainbus"), "trainbus")
    check_losses_logged(reference)
    ratio = logged_losses(hf)[0] / logged_losses(reference)[0]
    if transformers_sums_micro_batches(BertForSequenceClassification):  # where transformers differs
        assert 1.5 < ratio < 2.5, f"transformers' accumulated loss / the one-batch loss = {ratio}"
    else:
        assert ratio == pytest.approx(1.0, rel=1e-5)
    # trainbus's accumulated run is the one-batch run, but for what counts the micro-batches: the epoch
    # fractions and total_flos (the padded tokens of batches of 2), which come from transformers' accumulated run
    found = differences(reference, tb, ignore=["epoch", "total_flos"], files=False)
    for key in ("epoch", "total_flos"):
        values = [[r.get(key) for r in run.log_history] for run in (hf, tb)]
        found += [] if values[0] == values[1] else [f"{key}: transformers {values[0]}, trainbus {values[1]}"]
    assert not found, listing(found)


def test_multi_label_resume_matches_transformers(tmp_path: Path) -> None:
    """Resumed mid-epoch from checkpoint-5 (8 steps an epoch) in a fresh output_dir."""
    argv = argv_for(tmp_path, 0.1, save_strategy="steps", save_steps=5, save_total_limit=4)
    found, runs = resume_differences(run_multi_label.main, argv, tmp_path, step=5)
    check_losses_logged(runs["transformers"][1])
    assert not found, listing(found)
