"""Sequence classification, as transformers' examples/pytorch/text-classification/run_classification.py.

A BERT built from its config (``--config_overrides``), a local tokenizer, csv files with ``text`` and
``label``. The tokenized dataset keeps its raw ``text`` column: the Trainer removes what the model's
forward does not take, as in the example. ``main(argv, trainer_module)``: only where ``Trainer`` and
``TrainingArguments`` come from differs (``harness.implementation``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
from harness import implementation, set_dropout
from transformers import (
    CONFIG_MAPPING,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    EvalPrediction,
    HfArgumentParser,
    set_seed,
)


@dataclass
class ModelArguments:
    tokenizer_name: str = field(metadata={"help": "Local directory of the tokenizer"})
    model_type: str = field(default="bert", metadata={"help": "Model type, for a model built from its config"})
    config_overrides: str | None = field(default=None, metadata={"help": "e.g. hidden_size=32,num_hidden_layers=2"})
    dropout: float = field(default=0.0, metadata={"help": "Every dropout probability of the config"})
    cache_dir: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A csv file with text and label columns"})
    validation_file: str = field(metadata={"help": "A csv file with text and label columns"})
    test_file: str | None = field(default=None)
    max_seq_length: int = field(default=32)
    overwrite_cache: bool = field(default=False)


def main(argv: list[str] | None = None, trainer_module: str = "transformers") -> dict[str, Any]:
    Trainer, TrainingArguments = implementation(trainer_module)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    if data_args.test_file is not None:
        data_files["test"] = data_args.test_file
    raw_datasets = datasets.load_dataset("csv", data_files=data_files, cache_dir=model_args.cache_dir)
    label_list = sorted(raw_datasets["train"].unique("label"))
    num_labels = len(label_list)

    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    config.num_labels = num_labels
    set_dropout(config, model_args.dropout)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name, cache_dir=model_args.cache_dir)
    config.vocab_size = len(tokenizer)
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForSequenceClassification.from_config(config)

    def preprocess_function(examples: dict[str, Any]) -> Any:
        return tokenizer(examples["text"], padding=False, max_length=data_args.max_seq_length, truncation=True)

    with training_args.main_process_first(desc="dataset map pre-processing"):
        raw_datasets = raw_datasets.map(  # the text column stays: the Trainer removes it
            preprocess_function, batched=True, load_from_cache_file=not data_args.overwrite_cache,
            desc="Running tokenizer on dataset",
        )  # fmt: skip
    train_dataset, eval_dataset = raw_datasets["train"], raw_datasets["validation"]
    predict_dataset = raw_datasets.get("test", None)

    def compute_metrics(p: EvalPrediction) -> dict[str, float]:
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds = np.argmax(preds, axis=1)
        return {"accuracy": float((preds == p.label_ids).astype(np.float32).mean())}

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        compute_metrics=compute_metrics,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
    )
    results: dict[str, Any] = {"trainer": trainer}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.save_model()  # saves the tokenizer too
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results["train"] = metrics
    if training_args.do_eval:
        metrics = trainer.evaluate(eval_dataset=eval_dataset)
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
