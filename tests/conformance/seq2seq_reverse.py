"""Seq2seq conformance script: a tiny T5 learns to reverse word sequences, as transformers'
examples/pytorch/summarization/run_summarization.py is written.

Arguments parsed with ``HfArgumentParser`` into dataclasses next to Seq2SeqTrainingArguments, json
lines data files, a tokenizer loaded from a local directory, ``DataCollatorForSeq2Seq``,
``compute_metrics`` on the generated ids (exact match, token accuracy, generated length), train /
evaluate / predict with ``num_beams`` / save_model, log_metrics / save_metrics / save_state.
``main(argv, trainer_module)``: only the import of Seq2SeqTrainer / Seq2SeqTrainingArguments differs
("transformers" or "trainbus"). ``write_inputs`` writes the data files and the tokenizer a test passes in.

Run alone: ``python tests/conformance/seq2seq_reverse.py --output_dir out --tokenizer_name ... ``.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from transformers import (
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    T5Config,
    T5ForConditionalGeneration,
    set_seed,
)

VOCAB_WORDS = 30  # w0 .. w29 are ids 3 .. 32; 0 is <pad> (and T5's decoder start), 1 </s>, 2 <unk>
#: examples per split: 12 validation examples fill eval batches of 4, the 9 test examples do not
SPLITS = {"train": 48, "validation": 12, "test": 9}


def seq2seq_implementation(name: str) -> tuple[type, type]:
    """``(Seq2SeqTrainer, Seq2SeqTrainingArguments)`` of ``name``: the one import a port changes."""
    if name == "transformers":
        from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
    elif name == "trainbus":
        from trainbus.plugins import Seq2SeqTrainer, Seq2SeqTrainingArguments
    else:
        raise ValueError(f"trainer_module must be 'transformers' or 'trainbus', got {name!r}")
    return Seq2SeqTrainer, Seq2SeqTrainingArguments


@dataclass
class ModelArguments:
    tokenizer_name: str = field(metadata={"help": "Local directory of the tokenizer"})
    d_model: int = field(default=32)
    num_layers: int = field(default=2)
    dropout: float = field(default=0.0, metadata={"help": "T5's dropout_rate"})
    cache_dir: str | None = field(default=None)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "json lines with source and target"})
    validation_file: str = field(metadata={"help": "json lines with source and target"})
    test_file: str | None = field(default=None)
    max_source_length: int = field(default=16)
    max_target_length: int = field(default=16)
    num_beams: int | None = field(default=None, metadata={"help": "num_beams for predict's generate"})
    predict_max_length: int | None = field(default=None, metadata={"help": "max_length for predict's generate"})


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
    config = T5Config(
        vocab_size=len(tokenizer) + 7, d_model=model_args.d_model, d_kv=8, d_ff=37, num_layers=model_args.num_layers,
        num_heads=2, dropout_rate=model_args.dropout, decoder_start_token_id=tokenizer.pad_token_id,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config)

    def preprocess_function(examples: dict[str, list[str]]) -> Any:
        model_inputs = tokenizer(examples["source"], max_length=data_args.max_source_length, truncation=True)
        labels = tokenizer(text_target=examples["target"], max_length=data_args.max_target_length, truncation=True)
        model_inputs["labels"] = labels["input_ids"]
        return model_inputs

    column_names = raw_datasets["train"].column_names
    with training_args.main_process_first(desc="dataset map pre-processing"):
        processed = raw_datasets.map(
            preprocess_function, batched=True, remove_columns=column_names, desc="Running tokenizer on dataset"
        )
    train_dataset, eval_dataset = processed["train"], processed["validation"]
    predict_dataset = processed.get("test", None)
    data_collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)

    def compute_metrics(eval_preds: Any) -> dict[str, float]:
        preds, labels = eval_preds
        preds = preds[0] if isinstance(preds, tuple) else preds
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded_preds = [p.split() for p in tokenizer.batch_decode(preds, skip_special_tokens=True)]
        decoded_labels = [t.split() for t in tokenizer.batch_decode(labels, skip_special_tokens=True)]
        pairs = list(zip(decoded_preds, decoded_labels, strict=True))
        hits = sum(a == b for p, t in pairs for a, b in zip(p, t, strict=False))
        return {
            "exact_match": float(np.mean([p == t for p, t in pairs])),
            "token_accuracy": hits / sum(len(t) for t in decoded_labels),
            "gen_len": float(np.mean([np.count_nonzero(row != tokenizer.pad_token_id) for row in preds])),
        }

    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=data_collator,
        compute_metrics=compute_metrics if training_args.predict_with_generate else None,
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
        metrics = trainer.evaluate(metric_key_prefix="eval")
        metrics["eval_samples"] = len(eval_dataset)
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results["eval"] = metrics
    if training_args.do_predict and predict_dataset is not None:
        predicted = trainer.predict(
            predict_dataset, metric_key_prefix="predict", max_length=data_args.predict_max_length,
            num_beams=data_args.num_beams,
        )  # fmt: skip
        trainer.log_metrics("predict", predicted.metrics)
        trainer.save_metrics("predict", predicted.metrics)
        results["predict"] = predicted
        results["predict_default"] = trainer.predict(predict_dataset)  # the arguments' generation settings
    return results


def write_inputs(directory: Path, seed: int = 0) -> dict[str, str]:
    """The tokenizer (a word-level one that appends </s>) and json lines files of 3 to 8 words and their
    reversal: ``--tokenizer_name`` and ``--{split}_file`` paths for ``main``."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB_WORDS)}}
    raw = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = WhitespaceSplit()
    raw.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    tokenizer.save_pretrained(directory / "tokenizer")
    paths = {"tokenizer_name": str(directory / "tokenizer")}
    rng = random.Random(seed)
    for split, n in SPLITS.items():
        path = directory / f"{split}.json"
        with path.open("w") as f:
            for _ in range(n):
                words = [f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(rng.randint(3, 8))]
                f.write(json.dumps({"source": " ".join(words), "target": " ".join(reversed(words))}) + "\n")
        paths[f"{split}_file"] = str(path)
    return paths


if __name__ == "__main__":
    main(sys.argv[1:], "transformers")
