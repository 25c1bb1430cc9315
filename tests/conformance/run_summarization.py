"""Summarization, as transformers' examples/pytorch/summarization/run_summarization.py is written.

A BART built from its config, a byte-level BPE tokenizer trained by the test, json lines with a text
and a summary column, ``DataCollatorForSeq2Seq`` (labels padded with -100), label smoothing
(``--label_smoothing_factor``), evaluation and prediction with ``generate`` (beam search,
``generation_num_beams``), ``compute_metrics`` on the decoded text (seq_families' ROUGE-like overlap,
as the example's ROUGE), the generated summaries written to ``generated_predictions.txt``, a model card.
``main(argv, trainer_module)``: only where Seq2SeqTrainer and Seq2SeqTrainingArguments come from differs.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from harness import set_dropout
from seq2seq_reverse import seq2seq_implementation
from seq_families import rouge_like
from transformers import (
    CONFIG_MAPPING,
    AutoModelForSeq2SeqLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    set_seed,
)

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    tokenizer_name: str = field(metadata={"help": "Local directory of the tokenizer"})
    model_type: str = field(default="bart")
    config_overrides: str | None = field(default=None, metadata={"help": "e.g. d_model=32,encoder_layers=2"})
    dropout: float = field(default=0.0, metadata={"help": "Every dropout probability of the config"})
    cache_dir: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "json lines with a text and a summary column"})
    validation_file: str = field(metadata={"help": "json lines with a text and a summary column"})
    test_file: str | None = field(default=None)
    text_column: str | None = field(default=None, metadata={"help": "default: the first column"})
    summary_column: str | None = field(default=None, metadata={"help": "default: the second column"})
    max_source_length: int = field(default=32)
    max_target_length: int = field(default=12)
    val_max_target_length: int | None = field(default=None, metadata={"help": "generate's max_length; default "
                                                                      "max_target_length"})  # fmt: skip
    num_beams: int | None = field(default=None, metadata={"help": "overrides generation_num_beams"})
    ignore_pad_token_for_loss: bool = field(default=True)
    source_prefix: str | None = field(default=None, metadata={"help": "e.g. 'summarize: ' for T5"})

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
    config.pad_token_id, config.bos_token_id = tokenizer.pad_token_id, tokenizer.bos_token_id
    config.eos_token_id = config.decoder_start_token_id = tokenizer.eos_token_id  # BART starts decoding with </s>
    model = AutoModelForSeq2SeqLM.from_config(config)
    if model.config.decoder_start_token_id is None:
        raise ValueError("Make sure that `config.decoder_start_token_id` is correctly defined")
    if model.config.max_position_embeddings < data_args.max_source_length:
        raise ValueError(f"--max_source_length {data_args.max_source_length} exceeds the model's "
                         f"{model.config.max_position_embeddings} positions")  # fmt: skip
    prefix = data_args.source_prefix or ""

    column_names = raw_datasets["train"].column_names
    text_column = data_args.text_column or column_names[0]
    summary_column = data_args.summary_column or column_names[1]
    for name in (text_column, summary_column):
        if name not in column_names:
            raise ValueError(f"column {name!r} needs to be one of: {', '.join(column_names)}")
    if training_args.label_smoothing_factor > 0 and not hasattr(model, "prepare_decoder_input_ids_from_labels"):
        logger.warning("label smoothing without prepare_decoder_input_ids_from_labels computes the loss twice")

    def preprocess(max_target_length: int) -> Any:
        def preprocess_function(examples: dict[str, list[str]]) -> Any:
            pairs = [(t, s) for t, s in zip(examples[text_column], examples[summary_column]) if t and s]
            inputs = [prefix + text for text, _ in pairs]
            model_inputs = tokenizer(inputs, max_length=data_args.max_source_length, truncation=True)
            labels = tokenizer(text_target=[s for _, s in pairs], max_length=max_target_length, truncation=True)
            model_inputs["labels"] = labels["input_ids"]
            return model_inputs

        return preprocess_function

    def tokenized(split: str, max_target_length: int) -> Any:
        with training_args.main_process_first(desc=f"{split} dataset map pre-processing"):
            return raw_datasets[split].map(
                preprocess(max_target_length), batched=True, remove_columns=column_names,
                desc=f"Running tokenizer on {split} dataset",
            )  # fmt: skip

    train_dataset = tokenized("train", data_args.max_target_length) if training_args.do_train else None
    eval_dataset = tokenized("validation", data_args.val_max_target_length) if training_args.do_eval else None
    predict_dataset = tokenized("test", data_args.val_max_target_length) if training_args.do_predict else None

    label_pad_token_id = -100 if data_args.ignore_pad_token_for_loss else tokenizer.pad_token_id
    data_collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=label_pad_token_id)

    def compute_metrics(eval_preds: Any) -> dict[str, float]:
        preds, labels = eval_preds
        preds = preds[0] if isinstance(preds, tuple) else preds
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded_preds = [p.strip() for p in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        decoded_labels = [t.strip() for t in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        result = {k: round(v, 4) for k, v in rouge_like(decoded_preds, decoded_labels).items()}
        result["gen_len"] = float(np.mean([np.count_nonzero(p != tokenizer.pad_token_id) for p in preds]))
        return result

    # the example's overrides of the generation settings
    if training_args.generation_max_length is None:
        training_args.generation_max_length = data_args.val_max_target_length
    if data_args.num_beams is not None:
        training_args.generation_num_beams = data_args.num_beams

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
        trainer.save_model()  # the tokenizer too
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results["train"] = metrics
    if training_args.do_eval:
        metrics = trainer.evaluate(metric_key_prefix="eval")
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results["eval"] = metrics
    if training_args.do_predict:
        predicted = trainer.predict(predict_dataset, metric_key_prefix="predict")
        predicted.metrics["predict_samples"] = len(predict_dataset)
        trainer.log_metrics("predict", predicted.metrics)
        trainer.save_metrics("predict", predicted.metrics)
        results["predict"] = predicted
        if trainer.is_world_process_zero() and training_args.predict_with_generate:
            ids = np.where(predicted.predictions != -100, predicted.predictions, tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
            path = Path(training_args.output_dir) / "generated_predictions.txt"
            path.write_text("\n".join(t.strip() for t in texts), encoding="utf-8")
    trainer.create_model_card(tasks="summarization")
    return results


if __name__ == "__main__":
    main(sys.argv[1:], "transformers")
