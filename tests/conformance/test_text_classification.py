"""Sequence classification (BERT, raw text column left in the dataset): transformers.Trainer vs trainbus."""

from __future__ import annotations

from pathlib import Path

import pytest
import run_text_classification
from harness import assert_same, check_losses_logged, common_argv, run_both, sentences, write_csv, write_tokenizer

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
