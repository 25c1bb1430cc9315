"""Protocols transformers models declare, read as transformers reads them (issue 34 item 3), run under both.

- whether a model's loss honours ``num_items_in_batch``: transformers' rule (loss kwargs, a labels tensor it
  counts), with the division measured where transformers assumes it. A detection model (YOLOS: labels are a
  list of per-image dicts, the loss ignores the count) trains on transformers' loss under accumulation 2;
  it trained on twice that when a source-text guess said its ``self.loss_function(...)`` divided.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.differential.hf_diff import assert_same_logs, assert_same_weights, run_both

pytest.importorskip("scipy")  # transformers' Hungarian matcher for detection losses


# -- a detection model: YOLOS from a config (a ViT: no timm backbone) -----------------------------------------
def yolos() -> Any:
    from transformers import YolosConfig, YolosForObjectDetection

    torch.manual_seed(0)
    config = YolosConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                         image_size=[32, 32], patch_size=8, num_detection_tokens=4, num_labels=3,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return YolosForObjectDetection(config)


def detection_rows(n: int = 8) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        boxes = 1 + i % 3
        target = {
            "class_labels": torch.randint(0, 3, (boxes,), generator=g),
            "boxes": torch.rand(boxes, 4, generator=g) * 0.5 + 0.25,
        }
        rows.append({"pixel_values": torch.randn(3, 32, 32, generator=g), "labels": target})
    return rows


def detection_collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """As transformers' object-detection example: images stacked, the targets a list of dicts."""
    return {"pixel_values": torch.stack([r["pixel_values"] for r in rows]), "labels": [r["labels"] for r in rows]}


def test_a_detection_model_trains_on_transformers_loss_under_accumulation(tmp_path: Path) -> None:
    rows = detection_rows()

    def scenario(impl: Any, workdir: Path) -> Any:
        args = impl.args(workdir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                         logging_steps=1, save_strategy="no", learning_rate=1e-2, remove_unused_columns=False,
                         train_sampling_strategy="sequential")  # fmt: skip
        trainer = impl.Trainer(model=yolos(), args=args, train_dataset=rows, data_collator=detection_collate)
        trainer.train()
        return trainer

    hf, tb = run_both(scenario, tmp_path)
    assert_same_logs(hf.state.log_history, tb.state.log_history)
    assert_same_weights(hf.model, tb.model)
    # independent: step 1's loss is the mean of its two micro-batches' losses under the initial model (no
    # dropout), the loss each returns itself (transformers passes no count for a list of targets)
    model = yolos()
    first = [model(**detection_collate(rows[i : i + 2])).loss.item() for i in (0, 2)]
    assert hf.state.log_history[0]["loss"] == pytest.approx(sum(first) / 2, rel=1e-5)
