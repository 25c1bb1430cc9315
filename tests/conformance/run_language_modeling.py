"""Causal and masked language modeling, as transformers' examples/pytorch/language-modeling/run_clm.py and
run_mlm.py (line by line: one padded sequence per line, no grouping into blocks).

``--mlm false``: a causal LM (GPT-2 or Llama from a config); ``DataCollatorForLanguageModeling(mlm=False)``
pads and sets the padding's labels to -100, so micro-batches hold uneven numbers of tokens.
``--mlm true``: a masked LM (BERT); the collator draws random masks from torch's global generator,
in the data loader. compute_metrics is the examples' accuracy over predicted tokens, with
``preprocess_logits_for_metrics`` taking the argmax. ``main(argv, trainer_module)``: only the Trainer
import differs.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
from harness import implementation, set_dropout
from transformers import (
    CONFIG_MAPPING,
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    set_seed,
)


@dataclass
class ModelArguments:
    tokenizer_name: str = field(metadata={"help": "Local directory of the tokenizer"})
    model_type: str = field(default="gpt2", metadata={"help": "gpt2 / llama (causal) or bert (masked)"})
    config_overrides: str | None = field(default=None)
    dropout: float = field(default=0.0)
    cache_dir: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "A text file, one example per line"})
    validation_file: str = field(metadata={"help": "A text file, one example per line"})
    max_seq_length: int = field(default=24)
    mlm: bool = field(default=False, metadata={"help": "Masked (True) or causal (False) language modeling"})
    mlm_probability: float = field(default=0.15)


def main(argv: list[str] | None = None, trainer_module: str = "transformers") -> dict[str, Any]:
    Trainer, TrainingArguments = implementation(trainer_module)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file, "validation": data_args.validation_file}
    raw_datasets = datasets.load_dataset("text", data_files=data_files, cache_dir=model_args.cache_dir)

    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name, cache_dir=model_args.cache_dir)
    config = CONFIG_MAPPING[model_args.model_type]()
    if model_args.config_overrides is not None:
        config.update_from_string(model_args.config_overrides)
    set_dropout(config, model_args.dropout)
    config.vocab_size = len(tokenizer)
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id, config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    auto_model = AutoModelForMaskedLM if data_args.mlm else AutoModelForCausalLM
    model = auto_model.from_config(config)

    def tokenize_function(examples: dict[str, Any]) -> Any:
        lines = [line for line in examples["text"] if len(line) > 0 and not line.isspace()]
        return tokenizer(lines, padding=False, truncation=True, max_length=data_args.max_seq_length,
                         return_special_tokens_mask=data_args.mlm)  # fmt: skip

    with training_args.main_process_first(desc="dataset map tokenization"):
        tokenized = raw_datasets.map(
            tokenize_function, batched=True, remove_columns=["text"], desc="Running tokenizer on every text in dataset"
        )
    train_dataset, eval_dataset = tokenized["train"], tokenized["validation"]

    def preprocess_logits_for_metrics(logits: Any, labels: Any) -> Any:
        if isinstance(logits, tuple):
            logits = logits[0]
        return logits.argmax(dim=-1)

    def compute_metrics(eval_preds: Any) -> dict[str, float]:
        preds, labels = eval_preds
        if not data_args.mlm:  # the prediction at position i is for the token at i + 1
            labels, preds = labels[:, 1:], preds[:, :-1]
        mask = labels != -100
        return {"accuracy": float((preds[mask] == labels[mask]).mean())}

    data_collator = DataCollatorForLanguageModeling(
        tokenizer=tokenizer, mlm=data_args.mlm, mlm_probability=data_args.mlm_probability
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
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
        metrics["perplexity"] = math.exp(metrics["eval_loss"]) if metrics["eval_loss"] < 700 else math.inf
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results["eval"] = metrics
    if training_args.do_predict:  # the examples stop at evaluate(); predict() on the validation set
        predicted = trainer.predict(eval_dataset)
        results["predict"] = predicted
        results["predict_accuracy"] = float(np.mean(predicted.metrics.get("test_accuracy", np.nan)))
    return results


if __name__ == "__main__":
    main(sys.argv[1:], "transformers")
