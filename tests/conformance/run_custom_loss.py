"""A plain ``torch.nn.Module`` trained by a Trainer subclass whose ``compute_loss`` pops the labels, as
transformers' Trainer docs show (``labels = inputs.pop("labels")``), with class weights in the loss.

json lines with ``features`` (a vector) and ``label``; the default collator; an MLP with dropout that
returns logits only. ``main(argv, trainer_module)``: only the Trainer import differs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
import torch
from harness import implementation
from transformers import HfArgumentParser, set_seed


@dataclass
class ModelArguments:
    hidden_size: int = field(default=32)
    dropout: float = field(default=0.0)
    cache_dir: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "json lines with features and label"})
    validation_file: str = field(metadata={"help": "json lines with features and label"})
    class_weights: str = field(default="1.0,2.0,0.5")


class MLP(torch.nn.Module):
    def __init__(self, features: int, hidden: int, classes: int, dropout: float) -> None:
        super().__init__()
        layers = [torch.nn.Linear(features, hidden), torch.nn.GELU(), torch.nn.Dropout(dropout)]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(hidden, classes))

    def forward(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.net(features)}


def main(argv: list[str] | None = None, trainer_module: str = "transformers") -> dict[str, Any]:
    Trainer, TrainingArguments = implementation(trainer_module)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    raw = datasets.load_dataset("json", data_files=data_files, cache_dir=model_args.cache_dir)
    with training_args.main_process_first(desc="dataset formatting"):
        raw = raw.with_format("torch")
    weights = torch.tensor([float(w) for w in data_args.class_weights.split(",")])
    features = len(raw["train"][0]["features"])
    model = MLP(features, model_args.hidden_size, len(weights), model_args.dropout)

    class WeightedLossTrainer(Trainer):  # type: ignore[misc, valid-type]
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            loss = torch.nn.functional.cross_entropy(outputs["logits"], labels, weight=weights.to(labels.device))
            return (loss, outputs) if return_outputs else loss

    def compute_metrics(p: Any) -> dict[str, float]:
        return {"accuracy": float((np.argmax(p.predictions, axis=1) == p.label_ids).mean())}

    trainer = WeightedLossTrainer(
        model=model,
        args=training_args,
        train_dataset=raw["train"] if training_args.do_train else None,
        eval_dataset=raw["validation"] if training_args.do_eval else None,
        compute_metrics=compute_metrics,
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
        results["predict"] = trainer.predict(raw["validation"])
    return results


if __name__ == "__main__":
    main(sys.argv[1:], "transformers")
