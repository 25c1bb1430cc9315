"""Multi-label classification, as transformers' examples/pytorch/text-classification/run_classification.py
reads a json file whose ``label`` is a list of label names.

The label names become multi-hot float vectors, ``problem_type="multi_label_classification"`` makes the
model's loss ``BCEWithLogitsLoss`` over every (example, label) pair, and a prediction is every label
whose logit is positive (micro F1 and subset accuracy). A BERT built from its config, a local tokenizer;
the raw ``text`` column stays in the dataset (the Trainer removes it). ``main(argv, trainer_module)``:
only the Trainer import differs.
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
    model_type: str = field(default="bert")
    config_overrides: str | None = field(default=None)
    dropout: float = field(default=0.0)
    cache_dir: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "json lines: text, label (a list of label names)"})
    validation_file: str = field(metadata={"help": "json lines: text, label (a list of label names)"})
    test_file: str | None = field(default=None)
    max_seq_length: int = field(default=32)
    loss_pos_weight: float | None = field(default=None, metadata={"help": "BCE weight of the positive labels "
                                          "(a Trainer subclass overriding compute_loss)"})  # fmt: skip
    in_order: bool = field(default=False, metadata={"help": "Train in the file's order (the subclass's sampler)"})


def multi_label_trainer(base: type) -> type:
    """A Trainer subclass as users write one for imbalanced labels: a weighted BCE in ``compute_loss``, and
    an optional in-order sampler; both read attributes set after ``super().__init__`` (the train loader is
    made in ``train()``, as in transformers)."""

    class MultiLabelTrainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, pos_weight: float | None = None, in_order: bool = False, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.pos_weight = pos_weight
            self.in_order = in_order

        def compute_loss(
            self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            labels = inputs.pop("labels")
            outputs = model(**inputs)
            weight = None if self.pos_weight is None else torch.full_like(outputs.logits[0], self.pos_weight)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(outputs.logits, labels, pos_weight=weight)
            return (loss, outputs) if return_outputs else loss

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:  # the signature changed in 4.5x
            if self.in_order:
                return torch.utils.data.SequentialSampler(self.train_dataset)
            return super()._get_train_sampler(*args, **kwargs)

    return MultiLabelTrainer


def main(argv: list[str] | None = None, trainer_module: str = "transformers") -> dict[str, Any]:
    Trainer, TrainingArguments = implementation(trainer_module)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    if data_args.test_file is not None:
        data_files["test"] = data_args.test_file
    raw_datasets = datasets.load_dataset("json", data_files=data_files, cache_dir=model_args.cache_dir)
    if not isinstance(raw_datasets["train"][0]["label"], list):
        raise ValueError("this script is the multi-label path: each label must be a list of label names")
    label_list = sorted({name for names in raw_datasets["train"]["label"] for name in names})
    label_to_id = {name: i for i, name in enumerate(label_list)}

    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    config.problem_type = "multi_label_classification"
    config.num_labels = len(label_list)
    config.label2id, config.id2label = label_to_id, dict(enumerate(label_list))
    set_dropout(config, model_args.dropout)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name, cache_dir=model_args.cache_dir)
    config.vocab_size = len(tokenizer)
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForSequenceClassification.from_config(config)

    def multi_hot(names: list[str]) -> list[float]:
        vector = [0.0] * len(label_list)
        for name in names:
            vector[label_to_id[name]] = 1.0  # a name unseen in training raises: no silent drop
        return vector

    def preprocess_function(examples: dict[str, Any]) -> Any:
        result = tokenizer(examples["text"], padding=False, max_length=data_args.max_seq_length, truncation=True)
        result["label"] = [multi_hot(names) for names in examples["label"]]
        return result

    with training_args.main_process_first(desc="dataset map pre-processing"):
        raw_datasets = raw_datasets.map(preprocess_function, batched=True, desc="Running tokenizer on dataset")
    train_dataset, eval_dataset = raw_datasets["train"], raw_datasets["validation"]
    predict_dataset = raw_datasets.get("test")

    def compute_metrics(p: EvalPrediction) -> dict[str, float]:
        logits = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        predicted, truth = (logits > 0).astype(np.int64), p.label_ids.astype(np.int64)
        true_positives = int((predicted & truth).sum())
        denominator = int(predicted.sum() + truth.sum())
        return {
            "f1": 2.0 * true_positives / denominator if denominator else 0.0,  # micro-averaged
            "subset_accuracy": float((predicted == truth).all(axis=1).mean()),
        }

    subclassed = data_args.loss_pos_weight is not None or data_args.in_order
    extra = {"pos_weight": data_args.loss_pos_weight, "in_order": data_args.in_order} if subclassed else {}
    trainer = (multi_label_trainer(Trainer) if subclassed else Trainer)(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        compute_metrics=compute_metrics,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer),
        **extra,
    )
    results: dict[str, Any] = {"trainer": trainer}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.save_model()
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
