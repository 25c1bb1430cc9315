"""Image classification (ViT from a config, with_transform, random flips): transformers.Trainer vs trainbus."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import run_image_classification
from harness import assert_same, check_losses_logged, common_argv, run_both, write_json_lines

VIT = "image_size=16,patch_size=4,num_channels=3,hidden_size=32,num_hidden_layers=2,num_attention_heads=2," \
      "intermediate_size=37"  # fmt: skip


def write_images(directory: Path, n: int, seed: int) -> list[dict[str, object]]:
    """Small PNGs: label 1 is red on the left half, label 0 blue on the right, plus noise."""
    from PIL import Image

    rng = random.Random(seed)
    rows = []
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        label = rng.randrange(2)
        image = Image.new("RGB", (16, 16))
        for x in range(16):
            for y in range(16):
                strong = (x < 8) == bool(label)
                red, blue = (200, 30) if (strong and label) else (30, 200) if strong else (60, 60)
                image.putpixel((x, y), (red + rng.randrange(40), rng.randrange(80), blue + rng.randrange(40)))
        path = directory / f"{i}.png"
        image.save(path)
        rows.append({"image": str(path), "label": label})
    return rows


def argv_for(tmp_path: Path, dropout: float, flip_probability: float = 0.5):
    from transformers import ViTImageProcessor

    rows = write_images(tmp_path / "images", 28, seed=3)
    train = write_json_lines(tmp_path / "train.json", rows[:20])
    validation = write_json_lines(tmp_path / "validation.json", rows[20:])
    processor = tmp_path / "processor"
    ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(str(processor))

    def argv(name: str) -> list[str]:
        return common_argv(
            tmp_path / name, image_processor_name=processor, config_overrides=VIT, dropout=dropout,
            cache_dir=tmp_path / f"cache-{name}", train_file=train, validation_file=validation,
            flip_probability=flip_probability, remove_unused_columns=False,
        )  # fmt: skip

    return argv


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_image_classification_matches_transformers(tmp_path: Path, dropout: float) -> None:
    hf, tb = run_both(run_image_classification.main, argv_for(tmp_path, dropout))
    check_losses_logged(hf)
    assert_same(hf, tb)
