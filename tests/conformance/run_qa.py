"""Extractive question answering, as transformers' examples/pytorch/question-answering/run_qa.py.

SQuAD-shaped json lines (id, question, context, answers), a BERT built from its config and a local
tokenizer. Long contexts overflow ``max_seq_length`` into several features with ``doc_stride``; the
evaluation features keep ``example_id`` and ``offset_mapping`` (the Trainer drops them from the batches,
the post-processing reads them). ``QuestionAnsweringTrainer`` (qa_trainer.py) evaluates and predicts
itself; its exact match / F1 choose the best checkpoint when ``metric_for_best_model`` names them.
``main(argv, trainer_module)``: only the Trainer import differs.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import datasets
from harness import implementation, set_dropout
from qa_trainer import postprocess_qa_predictions, question_answering_trainer, squad_metrics
from transformers import (
    CONFIG_MAPPING,
    AutoModelForQuestionAnswering,
    AutoTokenizer,
    DataCollatorWithPadding,
    EarlyStoppingCallback,
    EvalPrediction,
    HfArgumentParser,
    default_data_collator,
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
    train_file: str = field(metadata={"help": "json lines: id, question, context, answers"})
    validation_file: str = field(metadata={"help": "json lines: id, question, context, answers"})
    test_file: str | None = field(default=None)
    max_seq_length: int = field(default=32)
    doc_stride: int = field(default=8)
    pad_to_max_length: bool = field(default=False)
    n_best_size: int = field(default=5)
    max_answer_length: int = field(default=6)
    early_stopping_patience: int | None = field(default=None, metadata={"help": "Evaluations without a better "
                                                "metric_for_best_model before training stops"})  # fmt: skip


def main(argv: list[str] | None = None, trainer_module: str = "transformers") -> dict[str, Any]:
    Trainer, TrainingArguments = implementation(trainer_module)
    QuestionAnsweringTrainer = question_answering_trainer(Trainer)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    if data_args.test_file is not None:
        data_files["test"] = data_args.test_file
    raw_datasets = datasets.load_dataset("json", data_files=data_files, cache_dir=model_args.cache_dir)
    column_names = raw_datasets["train"].column_names

    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    set_dropout(config, model_args.dropout)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name, cache_dir=model_args.cache_dir)
    config.vocab_size = len(tokenizer)
    config.pad_token_id = tokenizer.pad_token_id
    model = AutoModelForQuestionAnswering.from_config(config)
    pad_on_right = tokenizer.padding_side == "right"
    context_side = 1 if pad_on_right else 0

    def tokenize(examples: dict[str, Any]) -> Any:
        questions = [q.lstrip() for q in examples["question"]]  # leading spaces would eat the context's room
        pair = (questions, examples["context"]) if pad_on_right else (examples["context"], questions)
        return tokenizer(
            *pair, truncation="only_second" if pad_on_right else "only_first", max_length=data_args.max_seq_length,
            stride=data_args.doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True,
            padding="max_length" if data_args.pad_to_max_length else False,
        )  # fmt: skip

    def prepare_train_features(examples: dict[str, Any]) -> Any:
        features = tokenize(examples)
        sample_of = features.pop("overflow_to_sample_mapping")
        offset_mapping = features.pop("offset_mapping")
        features["start_positions"], features["end_positions"] = [], []
        for i, offsets in enumerate(offset_mapping):
            input_ids = features["input_ids"][i]
            cls_index = input_ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in input_ids else 0
            sequence_ids = features.sequence_ids(i)
            answers = examples["answers"][sample_of[i]]
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])
            in_context = [k for k, side in enumerate(sequence_ids) if side == context_side]
            first, last = in_context[0], in_context[-1]
            if not (offsets[first][0] <= start_char and offsets[last][1] >= end_char):
                start, end = cls_index, cls_index  # the answer is not in this feature's window
            else:
                start = max(k for k in in_context if offsets[k][0] <= start_char)
                end = min(k for k in in_context if offsets[k][1] >= end_char)
            features["start_positions"].append(start)
            features["end_positions"].append(end)
        return features

    def prepare_validation_features(examples: dict[str, Any]) -> Any:
        features = tokenize(examples)
        sample_of = features.pop("overflow_to_sample_mapping")
        features["example_id"] = []
        for i in range(len(features["input_ids"])):
            sequence_ids = features.sequence_ids(i)
            features["example_id"].append(examples["id"][sample_of[i]])
            # None outside the context: post-processing never picks the question or a special token
            offsets = zip(features["offset_mapping"][i], sequence_ids)
            features["offset_mapping"][i] = [o if side == context_side else None for o, side in offsets]
        return features

    with training_args.main_process_first(desc="dataset map pre-processing"):
        train_dataset = raw_datasets["train"].map(prepare_train_features, batched=True, remove_columns=column_names)
        eval_examples = raw_datasets["validation"]
        eval_dataset = eval_examples.map(prepare_validation_features, batched=True, remove_columns=column_names)
        predict_examples = raw_datasets.get("test")
        predict_dataset = None
        if predict_examples is not None:
            predict_dataset = predict_examples.map(
                prepare_validation_features, batched=True, remove_columns=column_names
            )
    data_collator = default_data_collator if data_args.pad_to_max_length else DataCollatorWithPadding(tokenizer)

    def post_processing_function(examples: Any, features: Any, predictions: Any, stage: str = "eval") -> EvalPrediction:
        written_to = None if trainer.is_in_train else training_args.output_dir  # no file per in-training evaluation
        answers = postprocess_qa_predictions(
            examples, features, predictions, n_best_size=data_args.n_best_size,
            max_answer_length=data_args.max_answer_length, output_dir=written_to, prefix=stage,
        )  # fmt: skip
        formatted = [{"id": str(k), "prediction_text": v} for k, v in answers.items()]
        references = [{"id": str(ex["id"]), "answers": ex["answers"]} for ex in examples]
        return EvalPrediction(predictions=formatted, label_ids=references)

    if training_args.load_best_model_at_end and training_args.metric_for_best_model not in ("exact_match", "f1"):
        warnings.warn("--metric_for_best_model should be exact_match or f1", stacklevel=1)

    def compute_metrics(p: EvalPrediction) -> dict[str, float]:
        return squad_metrics(p.predictions, p.label_ids)

    trainer = QuestionAnsweringTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        eval_examples=eval_examples if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=data_collator,
        post_process_function=post_processing_function,
        compute_metrics=compute_metrics,
        callbacks=[EarlyStoppingCallback(patience)] if (patience := data_args.early_stopping_patience) else None,
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
        predicted = trainer.predict(predict_dataset, predict_examples)
        predicted.metrics["predict_samples"] = len(predict_dataset)
        trainer.log_metrics("predict", predicted.metrics)
        trainer.save_metrics("predict", predicted.metrics)
        results["predict"] = predicted
    return results


if __name__ == "__main__":
    main(sys.argv[1:], "transformers")
