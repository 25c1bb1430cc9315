"""Image classification, as transformers' examples/pytorch/image-classification/run_image_classification.py.

A ViT built from its config, a local image processor (``AutoImageProcessor.from_pretrained(dir)``),
json lines with image paths (cast to ``datasets.Image``) and labels, ``with_transform`` applying the
processor plus a random horizontal flip on the training set (torchvision's RandomHorizontalFlip,
written with torch: a draw from the global generator per example, in the data loader), a collate_fn,
``remove_unused_columns=False`` (the example's requirement: the raw ``image`` column feeds the
transform). ``main(argv, trainer_module)``: only the Trainer import differs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
import torch
from harness import implementation, set_dropout
from transformers import (
    CONFIG_MAPPING,
    AutoImageProcessor,
    AutoModelForImageClassification,
    HfArgumentParser,
    set_seed,
)


@dataclass
class ModelArguments:
    image_processor_name: str = field(metadata={"help": "Local directory of the image processor"})
    model_type: str = field(default="vit")
    config_overrides: str | None = field(default=None)
    dropout: float = field(default=0.0)
    cache_dir: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "json lines with image (a path) and label"})
    validation_file: str = field(metadata={"help": "json lines with image (a path) and label"})
    flip_probability: float = field(default=0.5)


def collate_fn(examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    pixel_values = torch.stack([example["pixel_values"] for example in examples])
    labels = torch.tensor([example["label"] for example in examples])
    return {"pixel_values": pixel_values, "labels": labels}


def main(argv: list[str] | None = None, trainer_module: str = "transformers") -> dict[str, Any]:
    Trainer, TrainingArguments = implementation(trainer_module)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    dataset = datasets.load_dataset("json", data_files=data_files, cache_dir=model_args.cache_dir)
    dataset = dataset.cast_column("image", datasets.Image())
    labels = sorted(dataset["train"].unique("label"))

    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    config.num_labels = len(labels)
    config.label2id = {str(label): i for i, label in enumerate(labels)}
    config.id2label = {i: str(label) for i, label in enumerate(labels)}
    set_dropout(config, model_args.dropout)
    model = AutoModelForImageClassification.from_config(config)
    image_processor = AutoImageProcessor.from_pretrained(model_args.image_processor_name)

    def pixels(images: list[Any]) -> torch.Tensor:
        rgb = [image.convert("RGB") for image in images]
        return image_processor(rgb, return_tensors="pt")["pixel_values"]

    def train_transforms(example_batch: dict[str, Any]) -> dict[str, Any]:
        values = pixels(example_batch["image"])
        flip = torch.rand(len(values)) < data_args.flip_probability  # RandomHorizontalFlip, per example
        values = torch.where(flip[:, None, None, None], values.flip(-1), values)
        example_batch["pixel_values"] = list(values)
        return example_batch

    def val_transforms(example_batch: dict[str, Any]) -> dict[str, Any]:
        example_batch["pixel_values"] = list(pixels(example_batch["image"]))
        return example_batch

    with training_args.main_process_first(desc="dataset transforms"):
        train_dataset = dataset["train"].with_transform(train_transforms)
        eval_dataset = dataset["validation"].with_transform(val_transforms)

    def compute_metrics(p: Any) -> dict[str, float]:
        return {"accuracy": float((np.argmax(p.predictions, axis=1) == p.label_ids).mean())}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        compute_metrics=compute_metrics,
        processing_class=image_processor,
        data_collator=collate_fn,
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
        results["predict"] = trainer.predict(eval_dataset)
    return results


if __name__ == "__main__":
    main(sys.argv[1:], "transformers")
