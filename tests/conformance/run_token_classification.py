"""Token classification, as transformers' examples/pytorch/token-classification/run_ner.py.

json lines with ``tokens`` and ``tags``; a word-piece tokenizer whose small vocabulary splits rarer
words, so only a word's first piece is labelled and the rest (with [CLS], [SEP] and the collator's
padding) is -100: uneven per sentence and per batch. ``DataCollatorForTokenClassification``, seqeval-
style accuracy with numpy. ``main(argv, trainer_module)``: only the Trainer import differs.
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
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    HfArgumentParser,
    set_seed,
)


@dataclass
class ModelArguments:
    tokenizer_name: str = field(metadata={"help": "Local directory of the tokenizer"})
    model_type: str = field(default="bert")
    config_overrides: str | None = field(default=None)
    dropout: float = field(default=0.0)
    cache_dir: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "json lines with tokens and tags"})
    validation_file: str = field(metadata={"help": "json lines with tokens and tags"})
    test_file: str | None = field(default=None)
    label_all_tokens: bool = field(default=False)
    max_seq_length: int = field(default=48)
    pad_to_max_length: bool = field(default=False, metadata={"help": "Pad every sequence to max_seq_length"})


def main(argv: list[str] | None = None, trainer_module: str = "transformers") -> dict[str, Any]:
    Trainer, TrainingArguments = implementation(trainer_module)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    if data_args.test_file is not None:
        data_files["test"] = data_args.test_file
    raw_datasets = datasets.load_dataset("json", data_files=data_files, cache_dir=model_args.cache_dir)
    label_list = sorted({tag for tags in raw_datasets["train"]["tags"] for tag in tags})
    label_to_id = {label: i for i, label in enumerate(label_list)}

    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    config.num_labels = len(label_list)
    config.label2id, config.id2label = label_to_id, dict(enumerate(label_list))
    set_dropout(config, model_args.dropout)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name, cache_dir=model_args.cache_dir)
    config.vocab_size = len(tokenizer)
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForTokenClassification.from_config(config)

    def tokenize_and_align_labels(examples: dict[str, Any]) -> Any:
        tokenized = tokenizer(
            examples["tokens"], padding="max_length" if data_args.pad_to_max_length else False, truncation=True,
            max_length=data_args.max_seq_length, is_split_into_words=True,
        )  # fmt: skip
        labels = []
        for i, tags in enumerate(examples["tags"]):
            previous, label_ids = None, []
            for word_idx in tokenized.word_ids(batch_index=i):
                if word_idx is None:
                    label_ids.append(-100)
                elif word_idx != previous:
                    label_ids.append(label_to_id[tags[word_idx]])
                else:
                    label_ids.append(label_to_id[tags[word_idx]] if data_args.label_all_tokens else -100)
                previous = word_idx
            labels.append(label_ids)
        tokenized["labels"] = labels
        return tokenized

    column_names = raw_datasets["train"].column_names
    with training_args.main_process_first(desc="dataset map pre-processing"):
        processed = raw_datasets.map(
            tokenize_and_align_labels, batched=True, remove_columns=column_names, desc="Running tokenizer on dataset"
        )
    train_dataset, eval_dataset = processed["train"], processed["validation"]
    predict_dataset = processed.get("test", None)
    data_collator = DataCollatorForTokenClassification(tokenizer)

    def compute_metrics(p: Any) -> dict[str, float]:
        predictions = np.argmax(p.predictions, axis=2)
        mask = p.label_ids != -100
        per_tag = {
            f"{tag.lower()}_accuracy": float((predictions[mask & (p.label_ids == i)] == i).mean())
            for i, tag in enumerate(label_list)
            if (mask & (p.label_ids == i)).any()
        }
        return {"accuracy": float((predictions[mask] == p.label_ids[mask]).mean()), **per_tag}

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
        metrics = train_result.metrics
        trainer.save_model()
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
