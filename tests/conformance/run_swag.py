"""Multiple choice, as transformers' examples/pytorch/multiple-choice/run_swag.py.

SWAG-shaped csv files (``sent1``, ``sent2``, ``ending0..3``, ``label``), a BERT built from its config
(``BertForMultipleChoice``) and a local tokenizer. Each example becomes four (context, sent2 + ending)
pairs; the collator pads the flattened choices and folds them back to (batch, choices, length). The
tokenized dataset keeps its raw columns and ``label``: the Trainer removes what the forward does not
take and keeps ``label`` for the collator. ``main(argv, trainer_module)``: only the Trainer import differs.
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
    AutoModelForMultipleChoice,
    AutoTokenizer,
    EvalPrediction,
    HfArgumentParser,
    set_seed,
)

ENDINGS = [f"ending{i}" for i in range(4)]


@dataclass
class ModelArguments:
    tokenizer_name: str = field(metadata={"help": "Local directory of the tokenizer"})
    model_type: str = field(default="bert")
    config_overrides: str | None = field(default=None)
    dropout: float = field(default=0.0)
    cache_dir: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "csv: sent1, sent2, ending0..3, label"})
    validation_file: str = field(metadata={"help": "csv: sent1, sent2, ending0..3, label"})
    test_file: str | None = field(default=None)
    max_seq_length: int = field(default=32)
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad every choice to max_seq_length"})


@dataclass
class MultipleChoiceCollator:
    """Pads the choices of a batch together, as ``(batch, choices, length)`` tensors, with ``labels``."""

    tokenizer: Any
    padding: bool | str = True
    max_length: int | None = None

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        label_name = "label" if "label" in features[0] else "labels"
        labels = [feature[label_name] for feature in features]
        choices = len(features[0]["input_ids"])
        flat = [
            {key: value[i] for key, value in feature.items() if key != label_name}
            for feature in features
            for i in range(choices)
        ]
        batch = self.tokenizer.pad(flat, padding=self.padding, max_length=self.max_length, return_tensors="pt")
        batch = {key: value.view(len(features), choices, -1) for key, value in batch.items()}
        batch["labels"] = torch.tensor(labels, dtype=torch.int64)
        return batch


def main(argv: list[str] | None = None, trainer_module: str = "transformers") -> dict[str, Any]:
    Trainer, TrainingArguments = implementation(trainer_module)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    if data_args.test_file is not None:
        data_files["test"] = data_args.test_file
    raw_datasets = datasets.load_dataset("csv", data_files=data_files, cache_dir=model_args.cache_dir)

    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    set_dropout(config, model_args.dropout)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name, cache_dir=model_args.cache_dir)
    config.vocab_size = len(tokenizer)
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForMultipleChoice.from_config(config)

    def preprocess_function(examples: dict[str, Any]) -> dict[str, list[Any]]:
        contexts = [context for context in examples["sent1"] for _ in ENDINGS]
        continuations = [f"{start} {examples[e][i]}" for i, start in enumerate(examples["sent2"]) for e in ENDINGS]
        tokenized = tokenizer(
            contexts, continuations, truncation=True, max_length=data_args.max_seq_length,
            padding="max_length" if data_args.pad_to_max_length else False,
        )  # fmt: skip
        n = len(ENDINGS)  # back to one row per example, its choices as lists
        return {key: [values[i : i + n] for i in range(0, len(values), n)] for key, values in tokenized.items()}

    with training_args.main_process_first(desc="dataset map pre-processing"):
        processed = raw_datasets.map(preprocess_function, batched=True)  # raw columns stay: the Trainer drops them
    train_dataset, eval_dataset = processed["train"], processed["validation"]
    predict_dataset = processed.get("test")
    data_collator = MultipleChoiceCollator(tokenizer, padding="max_length" if data_args.pad_to_max_length else True,
                                           max_length=data_args.max_seq_length)  # fmt: skip

    def compute_metrics(p: EvalPrediction) -> dict[str, float]:
        predictions = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        return {"accuracy": float((np.argmax(predictions, axis=1) == p.label_ids).astype(np.float32).mean())}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics,
    )
    results: dict[str, Any] = {"trainer": trainer}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results["train"] = metrics
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results["eval"] = metrics
    if training_args.do_predict and predict_dataset is not None:
        predicted = trainer.predict(predict_dataset, metric_key_prefix="predict")
        trainer.log_metrics("predict", predicted.metrics)
        trainer.save_metrics("predict", predicted.metrics)
        results["predict"] = predicted
    return results


if __name__ == "__main__":
    main(sys.argv[1:], "transformers")
