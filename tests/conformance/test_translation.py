"""Translation (T5, source prefix, greedy generation with max_length): transformers' Seq2SeqTrainer vs trainbus's.

transformers 5 gets accumulation wrong for T5: ``T5ForConditionalGeneration.forward`` takes ``**kwargs``,
so its Trainer decides the model normalises by ``num_items_in_batch`` and does not divide the loss by
the accumulation steps, but T5's loss is a plain ``CrossEntropyLoss()`` mean over its own micro-batch:
each step follows the sum of the micro-batch means (twice the loss with 2 micro-batches).
``test_accumulation_equals_one_batch`` pins trainbus against the independent reference, a run of the
same 4 examples per step in one batch, without accumulation.

The evaluations during train() generate with the model's own generation settings (no
generation_max_length: max_length 20); the final evaluate() and predict() pass ``max_length`` and
``num_beams`` as the example does. Eval batches are full (12 and 8 examples in batches of 4): the
partial-batch loss is pinned in test_summarization.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import run_translation
from families import listing, resume_differences
from harness import assert_same, check_losses_logged, common_argv, differences, logged, run_both, run_script
from seq_families import (
    loading_problems,
    translations,
    write_splits,
    write_t5_tokenizer,
)

T5 = "d_model=32,d_kv=8,d_ff=37,num_layers=2,num_decoder_layers=2,num_heads=2,relative_attention_num_buckets=8"
SPLITS = {"train": 32, "validation": 12, "test": 8}
PREFIX = "translate English to Pig Latin: "


def argv_for(tmp_path: Path, **overrides: object):
    rows = translations(sum(SPLITS.values()), seed=5)
    files = write_splits(tmp_path / "data", rows, SPLITS)
    texts = [PREFIX + r["translation"]["en"] for r in rows] + [r["translation"]["pig"] for r in rows]
    tokenizer = write_t5_tokenizer(tmp_path / "tokenizer", texts)

    def argv(name: str) -> list[str]:
        arguments = {
            "per_device_eval_batch_size": 4, "predict_with_generate": True, "val_max_target_length": 16,
            "dropout": 0.1, "learning_rate": 1e-2, "num_train_epochs": 4, **overrides,
        }  # fmt: skip
        return [
            *common_argv(
                tmp_path / name, tokenizer_name=tokenizer, config_overrides=T5, cache_dir=tmp_path / f"cache-{name}",
                source_lang="en", target_lang="pig", **files, **arguments,
            ),
            f"--source_prefix={PREFIX}",  # its spaces as one argument
        ]  # fmt: skip

    return argv


def test_translation_matches_transformers(tmp_path: Path) -> None:
    from transformers import T5ForConditionalGeneration

    hf, tb = run_both(run_translation.main, argv_for(tmp_path))
    check_losses_logged(hf)
    assert {"eval_bleu", "eval_chrf"} <= set(hf.eval_metrics) and 0 < hf.eval_metrics["eval_gen_len"] <= 16
    during_training = [r["eval_gen_len"] for r in hf.log_history if "eval_gen_len" in r][:-1]
    assert during_training and max(during_training) <= 20  # the model's generation_config.max_length
    assert hf.predictions.shape[0] == SPLITS["test"] and hf.predictions.dtype.kind == "i"
    assert_same(hf, tb)
    generated = [(run.output_dir / "generated_predictions.txt").read_text() for run in (hf, tb)]
    assert generated[1] == generated[0]
    problems = loading_problems(hf, T5ForConditionalGeneration) + loading_problems(tb, T5ForConditionalGeneration)
    assert not problems, "\n".join(problems)


def test_resume_matches_transformers(tmp_path: Path) -> None:
    """Padded to max_length in preprocessing (default_data_collator), resumed mid-epoch from checkpoint-6."""
    argv = argv_for(
        tmp_path, pad_to_max_length=True, max_source_length=24, max_target_length=16, num_train_epochs=2,
        save_strategy="steps", save_steps=6, save_total_limit=3,
    )  # fmt: skip
    found, runs = resume_differences(run_translation.main, argv, tmp_path, step=6)
    check_losses_logged(runs["transformers"][1])
    assert not found, listing(found)


def test_accumulation_equals_one_batch(tmp_path: Path) -> None:
    """Batch 2 x accumulation 2 under trainbus equals batch 4 under transformers. No dropout (the masks drawn
    depend on the batch shapes); padded to max_length in preprocessing, so both see the same tensors. The
    shuffled order does not depend on the batch size: each step takes the same 4 examples. What remains is
    rounding (two micro-batch gradients summed against one), within the harness's tolerances over 16 steps."""
    from transformers import T5ForConditionalGeneration

    same = {"dropout": 0.0, "num_train_epochs": 2, "pad_to_max_length": True, "max_source_length": 24,
            "max_target_length": 16}  # fmt: skip
    accumulated = argv_for(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, **same)
    one_batch = argv_for(tmp_path, per_device_train_batch_size=4, **same)
    reference = run_script(run_translation.main, one_batch("reference"), "transformers")
    hf = run_script(run_translation.main, accumulated("transformers"), "transformers")
    tb = run_script(run_translation.main, accumulated("trainbus"), "trainbus")
    check_losses_logged(reference)
    ratio = logged(hf)[0] / logged(reference)[0]
    if "kwargs" in inspect.signature(T5ForConditionalGeneration.forward).parameters:  # transformers 5: wrong
        assert 1.8 < ratio < 2.2, f"transformers' accumulated loss / the one-batch loss = {ratio}"
    else:  # 4.x divides by the accumulation steps: the mean of the 2 micro-batch means, near the token mean
        assert ratio == pytest.approx(1.0, abs=0.1), ratio
    # every loss, grad_norm, learning rate, metric and generated id
    found = differences(reference, tb, files=False)
    assert not found, f"{len(found)} differences from the one-batch run:\n" + "\n".join(found)
