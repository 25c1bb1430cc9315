"""Causal LM (GPT-2, Llama; accumulation 4) and masked LM (BERT, random masks): transformers.Trainer vs trainbus."""

from __future__ import annotations

from pathlib import Path

import pytest
import run_language_modeling
from harness import assert_same, check_losses_logged, common_argv, run_both, sentences, write_tokenizer

CONFIGS = {
    "gpt2": "n_embd=32,n_layer=2,n_head=2,n_positions=32",
    "llama": "hidden_size=32,intermediate_size=64,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
    "max_position_embeddings=32",
    "bert": "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=37,max_position_embeddings=32",
}


def argv_for(tmp_path: Path, model_type: str, dropout: float, **overrides: object):
    texts = [r["text"] for r in sentences(40, seed=2, min_words=2, max_words=14)]
    (tmp_path / "train.txt").write_text("\n".join(texts[:30]) + "\n", encoding="utf-8")
    (tmp_path / "validation.txt").write_text("\n".join(texts[30:]) + "\n", encoding="utf-8")
    mlm = model_type == "bert"
    tokenizer = write_tokenizer(tmp_path / "tokenizer", texts, bert_template=mlm)

    def argv(name: str) -> list[str]:
        return common_argv(
            tmp_path / name, tokenizer_name=tokenizer, model_type=model_type, config_overrides=CONFIGS[model_type],
            dropout=dropout, cache_dir=tmp_path / f"cache-{name}", train_file=tmp_path / "train.txt",
            validation_file=tmp_path / "validation.txt", mlm=mlm, **overrides,
        )  # fmt: skip

    return argv


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_causal_lm_with_accumulation_matches_transformers(tmp_path: Path, model_type: str, dropout: float) -> None:
    """30 lines, batch 2, accumulation 4: windows of 4, 4, 4 and a partial one of 3 micro-batches per epoch."""
    argv = argv_for(tmp_path, model_type, dropout, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    hf, tb = run_both(run_language_modeling.main, argv)
    check_losses_logged(hf)
    assert_same(hf, tb)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_masked_lm_matches_transformers(tmp_path: Path, dropout: float) -> None:
    """Random masks in the collator: with dropout, equal numbers need transformers' order of random draws."""
    hf, tb = run_both(run_language_modeling.main, argv_for(tmp_path, "bert", dropout))
    check_losses_logged(hf)
    assert_same(hf, tb)
