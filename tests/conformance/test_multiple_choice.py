"""Multiple choice (BertForMultipleChoice, a collator padding the choices): transformers.Trainer vs trainbus, and
gradient accumulation against one batch of the whole window.

Under accumulation transformers sums the micro-batch losses of this model instead of averaging them:
``BertForMultipleChoice.forward`` takes ``**kwargs``, so its Trainer takes the model to divide by
``num_items_in_batch`` and does not divide by the accumulation steps, but the model's loss is a plain
``CrossEntropyLoss()`` mean over its own micro-batch (it never reads the count). Each step then
follows, and logs, the sum of 2 micro-batch means. The independent reference is one batch of the
window's 4 examples without accumulation (the shuffled order does not depend on the batch size; every
choice padded to the same length), whose loss is the mean accumulation must give.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import run_swag
from families import BERT, listing, resume_differences, swag_rows, transformers_sums_micro_batches
from harness import (
    Run,
    assert_same,
    check_losses_logged,
    common_argv,
    differences,
    logged,
    run_both,
    run_script,
    write_csv,
    write_tokenizer,
)
from transformers import BertForMultipleChoice

COLUMNS = ["sent1", "sent2", "ending0", "ending1", "ending2", "ending3", "label"]


def argv_for(tmp_path: Path, dropout: float, **overrides: object):
    rows = swag_rows(40, seed=7)
    files = {
        split: write_csv(tmp_path / f"{split}.csv", part, COLUMNS)
        for split, part in (("train", rows[:24]), ("validation", rows[24:32]), ("test", rows[32:]))
    }
    texts = [" ".join(str(r[c]) for c in COLUMNS[:-1]) for r in rows]
    tokenizer = write_tokenizer(tmp_path / "tokenizer", texts, vocab_size=90)

    def argv(name: str) -> list[str]:
        return common_argv(
            tmp_path / name, tokenizer_name=tokenizer, config_overrides=BERT, dropout=dropout,
            cache_dir=tmp_path / f"cache-{name}", train_file=files["train"], validation_file=files["validation"],
            test_file=files["test"], max_seq_length=20, **overrides,
        )  # fmt: skip

    return argv


def test_multiple_choice_matches_transformers(tmp_path: Path) -> None:
    hf, tb = run_both(run_swag.main, argv_for(tmp_path, 0.1))
    check_losses_logged(hf)
    assert_same(hf, tb)


def test_multiple_choice_accumulation_equals_one_batch(tmp_path: Path) -> None:
    """Batch 2 x accumulation 2 under trainbus equals batch 4 without accumulation; transformers' sums."""
    padded = {"pad_to_max_length": True}
    accumulated = argv_for(tmp_path, 0.0, per_device_train_batch_size=2, gradient_accumulation_steps=2, **padded)
    one_batch = argv_for(tmp_path, 0.0, per_device_train_batch_size=4, **padded)
    reference = run_script(run_swag.main, one_batch("reference"), "transformers")
    hf = run_script(run_swag.main, accumulated("transformers"), "transformers")
    tb = run_script(run_swag.main, accumulated("trainbus"), "trainbus")
    check_losses_logged(reference)
    ratio = logged(hf)[0] / logged(reference)[0]
    # where transformers differs: the sum of the 2 micro-batch means
    if transformers_sums_micro_batches(BertForMultipleChoice):
        assert 1.5 < ratio < 2.5, f"transformers' accumulated loss / the one-batch loss = {ratio}"
    else:
        assert ratio == pytest.approx(1.0, rel=1e-5)
    # trainbus's accumulated run is the one-batch run: every loss, grad_norm, learning rate, metric,
    # prediction (epoch fractions count micro-batches, so they come from transformers' accumulated run).
    # The predictions are compared less their mean over the choices: the classifier's bias adds the same
    # to every choice, so its exact gradient is 0 and it moves by rounding noise only (softmax-invariant)
    found = differences(centred(reference), centred(tb), ignore=["epoch", "grad_norm"], files=False)
    # the accumulated gradient is the sum of two half-batch gradients: float32 rounding apart from the
    # one-batch gradient, compounding over the steps (up to 1.5e-4 of the norm seen with 2 threads)
    norms = [[r["grad_norm"] for r in run.log_history if "grad_norm" in r] for run in (reference, tb)]
    assert len(norms[0]) == len(norms[1]) > 0 and norms[1] == pytest.approx(norms[0], rel=1e-3)
    epochs = [[r.get("epoch") for r in run.log_history] for run in (hf, tb)]
    found += [] if epochs[0] == epochs[1] else [f"epochs: transformers {epochs[0]}, trainbus {epochs[1]}"]
    assert not found, f"{len(found)} differences from the one-batch run:\n" + "\n".join(found)


def centred(run: Run) -> Run:
    logits = np.asarray(run.predictions, dtype=np.float64)
    return dataclasses.replace(run, predictions=logits - logits.mean(axis=1, keepdims=True))


def test_multiple_choice_resume_matches_transformers(tmp_path: Path) -> None:
    """Resumed mid-epoch from checkpoint-4 (6 steps an epoch) in a fresh output_dir."""
    argv = argv_for(tmp_path, 0.1, save_strategy="steps", save_steps=4, save_total_limit=3)
    found, runs = resume_differences(run_swag.main, argv, tmp_path, step=4)
    check_losses_logged(runs["transformers"][1])
    assert not found, listing(found)
