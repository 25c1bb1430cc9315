"""Translation, as transformers' examples/pytorch/translation/run_translation.py is written.

A T5 built from its config, a unigram tokenizer trained by the test, json lines of
``{"translation": {source_lang: ..., target_lang: ...}}``, a source prefix ("translate English to Pig
Latin: "), ``DataCollatorForSeq2Seq``, no forced BOS token, ``evaluate`` / ``predict`` given generate's
``max_length`` and ``num_beams`` as the example passes them, ``compute_metrics`` on the decoded text
(seq_families' BLEU-like score, as the example's sacrebleu, a chrF-like one, and the generated length).
``main(argv, trainer_module)``: only where Seq2SeqTrainer and Seq2SeqTrainingArguments come from differs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from harness import set_dropout
from seq2seq_reverse import seq2seq_implementation
from seq_families import bleu_like, chrf_like
from transformers import (
    CONFIG_MAPPING,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    default_data_collator,
    set_seed,
)


@dataclass
class ModelArguments:
    tokenizer_name: str = field(metadata={"help": "Local directory of the tokenizer"})
    model_type: str = field(default="t5")
    config_overrides: str | None = field(default=None, metadata={"help": "e.g. d_model=32,num_layers=2"})
    dropout: float = field(default=0.0, metadata={"help": "Every dropout probability of the config"})
    cache_dir: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    source_lang: str = field(metadata={"help": "Source language id"})
    target_lang: str = field(metadata={"help": "Target language id"})
    train_file: str = field(metadata={"help": "json lines with a translation column"})
    validation_file: str = field(metadata={"help": "json lines with a translation column"})
    test_file: str | None = field(default=None)
    max_source_length: int = field(default=32)
    max_target_length: int = field(default=32)
    val_max_target_length: int | None = field(default=None, metadata={"help": "generate's max_length"})
    pad_to_max_length: bool = field(default=False)
    num_beams: int | None = field(default=None)
    ignore_pad_token_for_loss: bool = field(default=True)
    source_prefix: str | None = field(default=None, metadata={"help": "prefix before every source text (T5)"})
    forced_bos_token: str | None = field(default=None, metadata={"help": "multilingual models only"})

    def __post_init__(self) -> None:
        if self.val_max_target_length is None:
            self.val_max_target_length = self.max_target_length


def main(argv: list[str] | None = None, trainer_module: str = "transformers") -> dict[str, Any]:
    Seq2SeqTrainer, Seq2SeqTrainingArguments = seq2seq_implementation(trainer_module)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, Seq2SeqTrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    if data_args.test_file is not None:
        data_files["test"] = data_args.test_file
    raw_datasets = datasets.load_dataset("json", data_files=data_files, cache_dir=model_args.cache_dir)

    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name, cache_dir=model_args.cache_dir)
    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    set_dropout(config, model_args.dropout)
    config.vocab_size = len(tokenizer)
    config.pad_token_id = config.decoder_start_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    model = AutoModelForSeq2SeqLM.from_config(config)
    if model.config.decoder_start_token_id is None:
        raise ValueError("Make sure that `config.decoder_start_token_id` is correctly defined")
    if data_args.forced_bos_token is not None:  # the example's multilingual (mBART, M2M100) case only
        raise ValueError(f"--forced_bos_token {data_args.forced_bos_token!r} needs a multilingual tokenizer")
    prefix = data_args.source_prefix or ""
    padding = "max_length" if data_args.pad_to_max_length else False

    def preprocess(max_target_length: int) -> Any:
        def preprocess_function(examples: dict[str, Any]) -> Any:
            inputs = [prefix + ex[data_args.source_lang] for ex in examples["translation"]]
            targets = [ex[data_args.target_lang] for ex in examples["translation"]]
            model_inputs = tokenizer(inputs, max_length=data_args.max_source_length, padding=padding, truncation=True)
            labels = tokenizer(text_target=targets, max_length=max_target_length, padding=padding, truncation=True)
            model_inputs["labels"] = labels["input_ids"]
            if padding == "max_length" and data_args.ignore_pad_token_for_loss:
                model_inputs["labels"] = [
                    [token if token != tokenizer.pad_token_id else -100 for token in label]
                    for label in model_inputs["labels"]
                ]
            return model_inputs

        return preprocess_function

    column_names = raw_datasets["train"].column_names

    def tokenized(split: str, max_target_length: int) -> Any:
        with training_args.main_process_first(desc=f"{split} dataset map pre-processing"):
            return raw_datasets[split].map(
                preprocess(max_target_length), batched=True, remove_columns=column_names,
                desc=f"Running tokenizer on {split} dataset",
            )  # fmt: skip

    train_dataset = tokenized("train", data_args.max_target_length) if training_args.do_train else None
    eval_dataset = tokenized("validation", data_args.val_max_target_length) if training_args.do_eval else None
    predict_dataset = tokenized("test", data_args.val_max_target_length) if training_args.do_predict else None

    if data_args.pad_to_max_length:
        data_collator = default_data_collator
    else:
        label_pad_token_id = -100 if data_args.ignore_pad_token_for_loss else tokenizer.pad_token_id
        data_collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=label_pad_token_id)

    def compute_metrics(eval_preds: Any) -> dict[str, float]:
        preds, labels = eval_preds
        preds = preds[0] if isinstance(preds, tuple) else preds
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)  # the collector pads across batches
        decoded_preds = [p.strip() for p in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        if data_args.ignore_pad_token_for_loss:
            labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded_labels = [t.strip() for t in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        result = {"bleu": bleu_like(decoded_preds, decoded_labels), "chrf": chrf_like(decoded_preds, decoded_labels)}
        result["gen_len"] = float(np.mean([np.count_nonzero(p != tokenizer.pad_token_id) for p in preds]))
        return {k: round(v, 4) for k, v in result.items()}

    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics if training_args.predict_with_generate else None,
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
    generation = {"max_length": data_args.val_max_target_length, "num_beams": data_args.num_beams}
    if training_args.do_eval:
        metrics = trainer.evaluate(metric_key_prefix="eval", **generation)
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results["eval"] = metrics
    if training_args.do_predict:
        predicted = trainer.predict(predict_dataset, metric_key_prefix="predict", **generation)
        predicted.metrics["predict_samples"] = len(predict_dataset)
        trainer.log_metrics("predict", predicted.metrics)
        trainer.save_metrics("predict", predicted.metrics)
        results["predict"] = predicted
        if trainer.is_world_process_zero() and training_args.predict_with_generate:
            ids = np.where(predicted.predictions != -100, predicted.predictions, tokenizer.pad_token_id)
            texts = [t.strip() for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]
            path = Path(training_args.output_dir) / "generated_predictions.txt"
            path.write_text("\n".join(texts), encoding="utf-8")
    trainer.create_model_card(tasks="translation", language=[data_args.source_lang, data_args.target_lang])
    return results


if __name__ == "__main__":
    main(sys.argv[1:], "transformers")
