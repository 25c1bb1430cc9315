"""The eval loss of padding-free packed batches (SFT ``packing=True``, best-fit decreasing): ``eval_loss`` is TRL's,
and ``eval_loss_per_token`` beside it is the exact mean over every predicted eval token.

TRL's loss of an eval batch is its token mean; transformers' evaluation loop weighs each batch's loss by the rows
the loader put in it (``eval_batch_size``, the rest of the dataset for the last batch), not by its tokens, although
a padding-free batch is one tensor row (``input_ids`` of shape ``(1, tokens)``) holding packed rows of unequal
token counts: ``eval_loss`` is a row-weighted mean of per-batch token means. The test computes both by hand,
running the model on every packed sequence alone (no packing, no TRL code), and compares them with the trainer's
records and with TRL's own run.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from conformance.harness import differences
from trl_jobs import IMPLEMENTATIONS, as_run, common_config, sft_script, text_rows

EXTRA = "eval_loss_per_token"  # trainbus.trl's, beside TRL's eval_loss


def by_hand(model: torch.nn.Module, packed: list[dict], batch_size: int) -> tuple[float, float]:
    """``(TRL's eval loss, the exact token mean)``: each packed sequence's next-token loss sum, on its own."""
    sums, counts, rows = [], [], []
    model.eval()
    for start in range(0, len(packed), batch_size):  # the eval loader: in order, batch_size packed rows a batch
        total, count = 0.0, 0
        for row in packed[start : start + batch_size]:
            offset = 0
            for length in row["seq_lengths"]:
                ids = torch.tensor(row["input_ids"][offset : offset + length])[None]
                offset += length
                with torch.no_grad():
                    logits = model(input_ids=ids, use_cache=False).logits[0, :-1].double()
                total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
                count += length - 1
        sums.append(total)
        counts.append(count)
        rows.append(len(packed[start : start + batch_size]))
    # transformers weighs a batch's loss by the rows the loader put in it (eval_batch_size; the last batch's rest)
    trl_mean = sum(r * s / c for r, s, c in zip(rows, sums, counts, strict=True)) / sum(rows)
    return trl_mean, sum(sums) / sum(counts)


def test_packed_eval_loss_is_trls_with_the_token_mean_beside_it(tmp_path: Path, tokenizer_dir: str) -> None:
    config = {"packing": True, "max_length": 24, "per_device_eval_batch_size": 3, "eval_strategy": "epoch",
              "num_train_epochs": 1, "save_strategy": "no", "gradient_checkpointing": False}  # fmt: skip
    trainers = {
        name: sft_script(name, tokenizer_dir, "llama", text_rows(10, 1), common_config(tmp_path / name, **config),
                         eval_rows=text_rows(11, 7))
        for name in IMPLEMENTATIONS
    }  # fmt: skip
    ours = trainers["trainbus"]
    record = next(r for r in ours.state.log_history if "eval_loss" in r)
    assert "padding_free" not in config and ours.padding_free  # bfd packing is padding-free
    packed = list(ours.eval_dataset)
    assert len(packed) == 4  # batches of 3 packed rows and 1: unequal token counts
    trl_mean, exact = by_hand(ours.model, packed, 3)
    assert not math.isclose(trl_mean, exact, rel_tol=1e-4)  # the two means differ on this data
    assert record[EXTRA] == pytest.approx(exact, rel=1e-5)
    assert record["eval_loss"] == pytest.approx(trl_mean, rel=1e-5)
    # TRL logs the same eval_loss (and no token mean); every other record and key agrees too
    trl_record = next(r for r in trainers["trl"].state.log_history if "eval_loss" in r)
    assert EXTRA not in trl_record
    runs = {name: as_run(name, t) for name, t in trainers.items()}
    found = differences(runs["trl"], runs["trainbus"], ignore=[EXTRA])
    assert not found, "\n".join(found)


def test_padded_eval_logs_no_token_mean(tmp_path: Path, tokenizer_dir: str) -> None:
    """Without padding-free batches the eval records have TRL's keys only."""
    config = {"max_length": 16, "eval_strategy": "epoch", "num_train_epochs": 1, "save_strategy": "no"}
    trainer = sft_script("trainbus", tokenizer_dir, "llama", text_rows(6, 1), common_config(tmp_path, **config),
                         eval_rows=text_rows(5, 7))  # fmt: skip
    record = next(r for r in trainer.state.log_history if "eval_loss" in r)
    assert EXTRA not in record and "eval_mean_token_accuracy" in record
