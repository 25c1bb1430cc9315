"""Semantic segmentation (SegFormer from a config, a local image processor, set_transform with random crops
and flips, masks with an ignored index): transformers.Trainer vs trainbus."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import run_semantic_segmentation
from families import listing, logged_losses, resume_differences, write_segmentation_images
from harness import assert_same, check_losses_logged, common_argv, run_both, write_json_lines

#: a 2-stage SegFormer (6k parameters): 16x16 images give 8x8 logits
SEGFORMER = {
    "num_encoder_blocks": 2, "depths": [1, 1], "sr_ratios": [2, 1], "hidden_sizes": [8, 16], "patch_sizes": [3, 3],
    "strides": [2, 2], "num_attention_heads": [1, 2], "mlp_ratios": [2, 2], "decoder_hidden_size": 16,
}  # fmt: skip


def argv_for(tmp_path: Path, dropout: float, **overrides: object):
    from transformers import SegformerImageProcessor

    rows = write_segmentation_images(tmp_path / "images", 28, seed=13)
    train = write_json_lines(tmp_path / "train.json", rows[:20])
    validation = write_json_lines(tmp_path / "validation.json", rows[20:])
    processor = tmp_path / "processor"
    SegformerImageProcessor(size={"height": 16, "width": 16}).save_pretrained(str(processor))

    def argv(name: str) -> list[str]:
        return common_argv(
            tmp_path / name, image_processor_name=processor, config_json=json.dumps(SEGFORMER), dropout=dropout,
            cache_dir=tmp_path / f"cache-{name}", train_file=train, validation_file=validation,
            remove_unused_columns=False, **overrides,
        )  # fmt: skip

    return argv


def test_semantic_segmentation_matches_transformers(tmp_path: Path) -> None:
    hf, tb = run_both(run_semantic_segmentation.main, argv_for(tmp_path, 0.1))
    check_losses_logged(hf)
    # the comparison has teeth: masks with ignored pixels reached the metrics, the model card was written
    assert np.asarray(hf.label_ids).shape == (8, 16, 16) and (np.asarray(hf.label_ids) == 255).any()
    assert {"eval_mean_iou", "eval_iou_disc", "eval_accuracy_square"} <= set(hf.eval_metrics)
    assert "README.md" in hf.files
    assert_same(hf, tb)


def test_semantic_segmentation_resume_continues_the_run(tmp_path: Path) -> None:
    """Resumed mid-epoch from checkpoint-3 (5 steps an epoch): the crops and flips drawn after it are those
    of the uninterrupted run, so trainbus's resumed run is its uninterrupted run, which is transformers'.

    transformers' own resume is not exact here: its loader makes batch i+1 (drawing its crops and flips
    from the global generator) before step i ends, and the checkpoint of step i saves the generator
    after those draws; the resumed run makes batch i+1 again from that state, with other crops. So its
    resumed run is no reference: the uninterrupted one is (the files it writes are still required).
    """
    argv = argv_for(tmp_path, 0.1, save_strategy="steps", save_steps=3, save_total_limit=4)
    found, runs = resume_differences(
        run_semantic_segmentation.main, argv, tmp_path, step=3, transformers_resumes_exactly=False
    )
    (hf_full, hf), _ = runs["transformers"], runs["trainbus"]
    check_losses_logged(hf)
    # where transformers differs: its first resumed step trains on other crops than its uninterrupted run
    assert logged_losses(hf)[:3] == logged_losses(hf_full)[:3] and logged_losses(hf)[3] != logged_losses(hf_full)[3]
    assert not found, listing(found)
