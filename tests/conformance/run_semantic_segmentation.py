"""Semantic segmentation, as transformers' examples/pytorch/semantic-segmentation/run_semantic_segmentation.py.

A SegFormer built from its config (``--config_json``: its list-valued fields), a local image processor
(``AutoImageProcessor.from_pretrained(dir)``: its size, mean and std), json lines with the paths of an
image and its mask (both cast to ``datasets.Image``). ``set_transform`` applies, on the training set,
padding to the processor's size (mask padded with 255, the ignored index), a random crop and a random
horizontal flip (the example's albumentations pipeline, written with torch draws from the global
generator in the data loader), then normalisation; on the validation set a resize. Mean IoU and
per-class accuracy / IoU in numpy. ``main(argv, trainer_module)``: only the Trainer import differs.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
import torch
from harness import implementation, set_dropout
from PIL import Image
from transformers import (
    CONFIG_MAPPING,
    AutoImageProcessor,
    AutoModelForSemanticSegmentation,
    HfArgumentParser,
    default_data_collator,
    set_seed,
)

IGNORE_INDEX = 255


@dataclass
class ModelArguments:
    image_processor_name: str = field(metadata={"help": "Local directory of the image processor"})
    model_type: str = field(default="segformer")
    config_json: str | None = field(default=None, metadata={"help": "A JSON object of config fields"})
    dropout: float = field(default=0.0)
    cache_dir: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "json lines: image and label (paths of an image and its mask)"})
    validation_file: str = field(metadata={"help": "json lines: image and label"})
    classes: str = field(default="background,square,disc", metadata={"help": "Class names, by mask value"})


def mean_iou(predicted: np.ndarray, labels: np.ndarray, num_labels: int) -> dict[str, Any]:
    """``evaluate``'s mean_iou metric: pixels labelled IGNORE_INDEX are left out."""
    valid = labels != IGNORE_INDEX
    p, t = predicted[valid].astype(np.int64), labels[valid].astype(np.int64)
    intersection = np.bincount(t[p == t], minlength=num_labels)
    predicted_area, label_area = np.bincount(p, minlength=num_labels), np.bincount(t, minlength=num_labels)
    union = predicted_area + label_area - intersection
    with np.errstate(invalid="ignore", divide="ignore"):
        iou, accuracy = intersection / union, intersection / label_area
    return {
        "mean_iou": float(np.nanmean(iou)),
        "mean_accuracy": float(np.nanmean(accuracy)),
        "overall_accuracy": float(intersection.sum() / label_area.sum()),
        "per_category_iou": iou,
        "per_category_accuracy": accuracy,
    }


def main(argv: list[str] | None = None, trainer_module: str = "transformers") -> dict[str, Any]:
    Trainer, TrainingArguments = implementation(trainer_module)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    dataset = datasets.load_dataset("json", data_files=data_files, cache_dir=model_args.cache_dir)
    dataset = dataset.cast_column("image", datasets.Image()).cast_column("label", datasets.Image())
    id2label = dict(enumerate(data_args.classes.split(",")))
    label2id = {name: str(i) for i, name in id2label.items()}

    config = CONFIG_MAPPING[model_args.model_type](**json.loads(model_args.config_json or "{}"))
    config.num_labels, config.id2label, config.label2id = len(id2label), id2label, label2id
    set_dropout(config, model_args.dropout)
    model = AutoModelForSemanticSegmentation.from_config(config)
    image_processor = AutoImageProcessor.from_pretrained(model_args.image_processor_name)
    size = image_processor.size
    height, width = (size["shortest_edge"],) * 2 if size.get("shortest_edge") else (size["height"], size["width"])
    mean = torch.tensor(image_processor.image_mean).view(3, 1, 1)
    std = torch.tensor(image_processor.image_std).view(3, 1, 1)

    def as_tensors(image: Any, mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
        pixels = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).float()
        return pixels, torch.from_numpy(np.array(mask)).long()

    def train_transform(image: Any, mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
        pixels, target = as_tensors(image, mask)
        pad_h, pad_w = max(height - pixels.shape[1], 0), max(width - pixels.shape[2], 0)
        pixels = torch.nn.functional.pad(pixels, (0, pad_w, 0, pad_h), value=0.0)
        target = torch.nn.functional.pad(target, (0, pad_w, 0, pad_h), value=IGNORE_INDEX)  # padding is ignored
        top = int(torch.randint(0, pixels.shape[1] - height + 1, ()))
        left = int(torch.randint(0, pixels.shape[2] - width + 1, ()))
        rows, columns = slice(top, top + height), slice(left, left + width)
        pixels, target = pixels[:, rows, columns], target[rows, columns]
        if torch.rand(()) < 0.5:
            pixels, target = pixels.flip(-1), target.flip(-1)
        return (pixels / 255.0 - mean) / std, target

    def val_transform(image: Any, mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
        image = image.convert("RGB").resize((width, height), Image.BILINEAR)
        pixels, target = as_tensors(image, mask.resize((width, height), Image.NEAREST))
        return (pixels / 255.0 - mean) / std, target

    def preprocess_batch(example_batch: dict[str, Any], transform: Any) -> dict[str, torch.Tensor]:
        pairs = [transform(image, mask) for image, mask in zip(example_batch["image"], example_batch["label"])]
        return {"pixel_values": torch.stack([p for p, _ in pairs]), "labels": torch.stack([t for _, t in pairs])}

    dataset["train"].set_transform(lambda batch: preprocess_batch(batch, train_transform))
    dataset["validation"].set_transform(lambda batch: preprocess_batch(batch, val_transform))

    @torch.no_grad()
    def compute_metrics(eval_pred: Any) -> dict[str, float]:
        logits, labels = eval_pred
        upsampled = torch.nn.functional.interpolate(
            torch.from_numpy(logits), size=labels.shape[-2:], mode="bilinear", align_corners=False
        )
        metrics = mean_iou(upsampled.argmax(dim=1).numpy(), labels, len(id2label))
        per_iou, per_accuracy = metrics.pop("per_category_iou"), metrics.pop("per_category_accuracy")
        metrics.update({f"accuracy_{id2label[i]}": float(v) for i, v in enumerate(per_accuracy)})
        metrics.update({f"iou_{id2label[i]}": float(v) for i, v in enumerate(per_iou)})
        return metrics

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=dataset["train"] if training_args.do_train else None,
        eval_dataset=dataset["validation"] if training_args.do_eval else None,
        compute_metrics=compute_metrics,
        processing_class=image_processor,
        data_collator=default_data_collator,
    )
    results: dict[str, Any] = {"trainer": trainer}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", train_result.metrics)
        trainer.save_metrics("train", train_result.metrics)
        trainer.save_state()
        results["train"] = train_result.metrics
    if training_args.do_eval:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results["eval"] = metrics
    if training_args.do_predict:
        results["predict"] = trainer.predict(dataset["validation"])
    trainer.create_model_card(finetuned_from=None, dataset="synthetic shapes", tags=["image-segmentation", "vision"])
    return results


if __name__ == "__main__":
    main(sys.argv[1:], "transformers")
