"""Summarization (BART, label smoothing, beam search): transformers' Seq2SeqTrainer vs trainbus's.

transformers is wrong on the evaluation loss when the last eval batch is partial: its evaluation loop
repeats each batch's mean loss by the loader's batch size and relies on ``gather_for_metrics`` to cut
the repeats of the last batch down to its real size, but ``Seq2SeqTrainer.evaluate`` / ``predict`` swap
in ``accelerator.gather``, which cuts nothing (the plain Trainer weighs the batches right). The 2
examples of the last batch then weigh as 4, and ``eval_loss`` is the plain mean of the batch means.
trainbus weighs each batch by its size: the mean over examples. ``test_eval_loss_is_the_mean_over_examples``
recomputes the batch losses (label smoothed, by torch's own cross entropy) from the saved model and
pins both; the other tests use full eval batches, so every loss compares.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path

import numpy as np
import pytest
import run_summarization
import torch
from families import listing, resume_differences
from harness import assert_same, check_losses_logged, common_argv, run_both
from seq_families import (
    loading_problems,
    summaries,
    write_bart_tokenizer,
    write_splits,
)

BART = (
    "d_model=32,encoder_layers=2,decoder_layers=2,encoder_attention_heads=2,decoder_attention_heads=2,"
    "encoder_ffn_dim=37,decoder_ffn_dim=37,max_position_embeddings=64"
)
#: eval batches of 4: full ones, so every loss is comparable (the partial last batch: its own test)
SPLITS = {"train": 32, "validation": 12, "test": 8}
PARTIAL_SPLITS = {"train": 32, "validation": 10, "test": 7}  # eval batches of 4, 4, 2 and 4, 3
LABEL_SMOOTHING = 0.1


def argv_for(tmp_path: Path, splits: dict[str, int] = SPLITS, **overrides: object):
    rows = summaries(sum(splits.values()), seed=4)
    files = write_splits(tmp_path / "data", rows, splits)
    tokenizer = write_bart_tokenizer(tmp_path / "tokenizer", [r["text"] for r in rows])

    def argv(name: str) -> list[str]:
        arguments = {
            "per_device_eval_batch_size": 4, "label_smoothing_factor": LABEL_SMOOTHING, "predict_with_generate": True,
            "generation_num_beams": 2, "val_max_target_length": 10, "dropout": 0.1, "learning_rate": 1e-2,
            "num_train_epochs": 4, **overrides,
        }  # fmt: skip
        return common_argv(
            tmp_path / name, tokenizer_name=tokenizer, config_overrides=BART, cache_dir=tmp_path / f"cache-{name}",
            **files, **arguments,
        )  # fmt: skip

    return argv


def label_smoother_counts_the_window() -> bool:
    """Whether the installed LabelSmoother divides by the accumulation window's label tokens (transformers >= 5.x
    with ``num_items_in_batch``), as trainbus does; 4.57 - 5.0 average the micro-batches' own token means."""
    from transformers.trainer_pt_utils import LabelSmoother

    return "num_items_in_batch" in inspect.signature(LabelSmoother.__call__).parameters


def test_summarization_matches_transformers(tmp_path: Path) -> None:
    """Micro-batches of 2 accumulated 2 by 2 where transformers' label smoother counts the window's tokens
    (elsewhere batches of 4: its mean of micro-batch means is not the window's token mean trainbus trains on)."""
    from transformers import BartForConditionalGeneration

    batches = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2}
    hf, tb = run_both(
        run_summarization.main, argv_for(tmp_path, **(batches if label_smoother_counts_the_window() else {}))
    )
    check_losses_logged(hf)
    assert "eval_rougeL" in hf.eval_metrics and hf.eval_metrics["eval_gen_len"] > 0
    assert hf.predictions.shape[0] == SPLITS["test"] and hf.predictions.dtype.kind == "i"  # generated ids
    assert_same(hf, tb)
    generated = [(run.output_dir / "generated_predictions.txt").read_text() for run in (hf, tb)]
    assert generated[1] == generated[0]
    problems = loading_problems(hf, BartForConditionalGeneration) + loading_problems(tb, BartForConditionalGeneration)
    assert not problems, "\n".join(problems)


def test_resume_matches_transformers(tmp_path: Path) -> None:
    """Resumed mid-epoch from checkpoint-6 (of 16 steps) in a fresh output_dir."""
    argv = argv_for(tmp_path, num_train_epochs=2, save_strategy="steps", save_steps=6, save_total_limit=3)
    found, runs = resume_differences(run_summarization.main, argv, tmp_path, step=6)
    check_losses_logged(runs["transformers"][1])
    assert not found, listing(found)


def test_eval_loss_is_the_mean_over_examples(tmp_path: Path) -> None:
    """Validation 10 and test 7 examples in eval batches of 4: transformers repeats each batch's mean loss
    by 4, trainbus weighs each batch by its size. The batch losses are recomputed from the saved model."""
    argv = argv_for(tmp_path, PARTIAL_SPLITS, num_train_epochs=1, eval_strategy="no", save_strategy="no")
    hf, tb = run_both(run_summarization.main, argv)
    checked = (("validation", "eval_loss", "eval_metrics"), ("test", "predict_loss", "predict_metrics"))
    for split, key, run_key in checked:
        losses, sizes = batch_losses(tb.output_dir, tmp_path / "data" / f"{split}.json", batch_size=4)
        assert sizes == ([4, 4, 2] if split == "validation" else [4, 3])
        per_example, batch_mean = float(np.average(losses, weights=sizes)), float(np.mean(losses))
        assert not math.isclose(per_example, batch_mean, rel_tol=1e-4)  # 10x the tolerance below
        assert getattr(tb, run_key)[key] == pytest.approx(per_example, rel=1e-5), key
        assert getattr(hf, run_key)[key] == pytest.approx(batch_mean, rel=1e-5), key
    hf.predict_metrics.pop("predict_loss"), tb.predict_metrics.pop("predict_loss")  # predict() takes no ignore
    assert_same(hf, tb, ignore=["eval_loss", "predict_loss"])  # everything else the runs share


def batch_losses(model_dir: Path, data_file: Path, batch_size: int) -> tuple[list[float], list[int]]:
    """Each eval batch's label-smoothed token-mean loss, by torch's cross entropy, without any trainer."""
    from transformers import AutoTokenizer, BartForConditionalGeneration, DataCollatorForSeq2Seq

    model = BartForConditionalGeneration.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in data_file.read_text().splitlines()]
    features = [
        {"input_ids": tokenizer(r["text"], max_length=32, truncation=True)["input_ids"],
         "labels": tokenizer(text_target=r["summary"], max_length=10, truncation=True)["input_ids"]}
        for r in rows
    ]  # fmt: skip
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    losses, sizes = [], []
    with torch.no_grad():
        for start in range(0, len(features), batch_size):
            batch = collator(features[start : start + batch_size])
            labels = batch.pop("labels")
            logits = model(**batch).logits
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), ignore_index=-100, label_smoothing=LABEL_SMOOTHING
            )
            losses.append(float(loss))
            sizes.append(len(labels))
    return losses, sizes
