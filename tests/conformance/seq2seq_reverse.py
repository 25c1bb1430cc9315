"""Seq2seq conformance script: a tiny T5 learns to reverse token sequences (transformers' example style).

Written as a transformers example script is (local json data files, a tokenizer saved to and
loaded from a directory, ``DataCollatorForSeq2Seq``, ``compute_metrics`` on generated ids, train /
evaluate / predict / save_model, log_metrics / save_metrics / save_state); the only line that
differs between the two runs is the import of Seq2SeqTrainer / Seq2SeqTrainingArguments, chosen by
``impl``. tests/test_seq2seq.py runs it under both and compares every number.

Run alone: ``python tests/conformance/seq2seq_reverse.py {hf,trainbus} OUTPUT_DIR [DROPOUT]`` (prints the results).
The training arguments are built from keywords, not HfArgumentParser, until trainbus's
TrainingArguments parses with it (issue #22 item 5).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB_WORDS = 30  # w0 .. w29, ids 3 .. 32; 0 pad, 1 eos, 2 unk
TRAINING = {
    "per_device_train_batch_size": 4,
    "per_device_eval_batch_size": 4,
    "learning_rate": 5e-3,
    "num_train_epochs": 3,
    "logging_steps": 1,
    "eval_strategy": "epoch",
    "save_strategy": "no",
    "predict_with_generate": True,
    "generation_max_length": 12,
    "seed": 42,
    "use_cpu": True,
    "report_to": "none",
    "disable_tqdm": True,
}


def build_tokenizer(directory: Path) -> Any:
    """A word-level tokenizer that appends </s>, saved and loaded back as a script would load a hub one."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB_WORDS)}}
    raw = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = WhitespaceSplit()
    raw.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


#: examples per split: 12 validation examples make whole eval batches of 4, the 9 test examples do not
SPLITS = {"train": 48, "validation": 12, "test": 9}


def write_data(directory: Path, seed: int = 0) -> dict[str, str]:
    """train / validation / test json-lines files of word sequences (3 to 8 words) and their reversal."""
    rng = random.Random(seed)
    files = {}
    for split, n in SPLITS.items():
        path = directory / f"{split}.json"
        with path.open("w") as f:
            for _ in range(n):
                words = [f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(rng.randint(3, 8))]
                f.write(json.dumps({"source": " ".join(words), "target": " ".join(reversed(words))}) + "\n")
        files[split] = str(path)
    return files


def main(impl: str, output_dir: Path, dropout: float = 0.0) -> dict[str, Any]:
    """Train, evaluate and predict under ``impl`` ("hf" or "trainbus"); every number the run produced."""
    if impl == "trainbus":
        from trainbus.plugins import Seq2SeqTrainer, Seq2SeqTrainingArguments
    else:
        from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments
    from datasets import load_dataset
    from transformers import DataCollatorForSeq2Seq, T5Config, T5ForConditionalGeneration, set_seed

    output_dir.mkdir(parents=True, exist_ok=True)
    work = output_dir / "inputs"
    work.mkdir(exist_ok=True)
    training_args = Seq2SeqTrainingArguments(output_dir=str(output_dir / "run"), **TRAINING)
    set_seed(training_args.seed)
    tokenizer = build_tokenizer(work / "tokenizer")
    raw = load_dataset("json", data_files=write_data(work), cache_dir=str(work / "cache"))
    config = T5Config(
        vocab_size=40, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=2, dropout_rate=dropout,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    model = T5ForConditionalGeneration(config)

    def preprocess(examples: dict[str, list[str]]) -> Any:
        return tokenizer(examples["source"], text_target=examples["target"], max_length=16, truncation=True)

    columns = raw["train"].column_names
    datasets = {split: raw[split].map(preprocess, batched=True, remove_columns=columns) for split in raw}
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)

    def compute_metrics(eval_preds: Any) -> dict[str, float]:
        preds, labels = eval_preds
        preds = preds[0] if isinstance(preds, tuple) else preds
        preds = np.where(preds != -100, preds, tokenizer.pad_token_id)
        labels = np.where(labels != -100, labels, tokenizer.pad_token_id)
        decoded_preds = tokenizer.batch_decode(preds, skip_special_tokens=True)
        decoded_labels = tokenizer.batch_decode(labels, skip_special_tokens=True)
        exact = [p.split() == t.split() for p, t in zip(decoded_preds, decoded_labels, strict=True)]
        pairs = zip(decoded_preds, decoded_labels, strict=True)
        hits = sum(a == b for p, t in pairs for a, b in zip(p.split(), t.split(), strict=False))
        total = sum(len(t.split()) for t in decoded_labels)
        lengths = [int(np.count_nonzero(row != tokenizer.pad_token_id)) for row in preds]
        return {"exact_match": float(np.mean(exact)), "token_accuracy": hits / total,
                "gen_len": float(np.mean(lengths))}  # fmt: skip

    trainer = Seq2SeqTrainer(
        model=model,
        args=training_args,
        train_dataset=datasets["train"],
        eval_dataset=datasets["validation"],
        processing_class=tokenizer,
        data_collator=collator,
        compute_metrics=compute_metrics,
    )
    train_result = trainer.train()
    trainer.save_model()
    trainer.log_metrics("train", train_result.metrics)
    trainer.save_metrics("train", train_result.metrics)
    trainer.save_state()
    eval_metrics = trainer.evaluate(metric_key_prefix="eval")
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("eval", eval_metrics)
    beam = trainer.predict(datasets["test"], metric_key_prefix="predict", max_length=10, num_beams=2)
    trainer.save_metrics("predict", beam.metrics)
    greedy = trainer.predict(datasets["test"])
    return {
        "log_history": trainer.state.log_history,
        "eval": eval_metrics,
        "predict_beam": {"predictions": beam.predictions.tolist(), "label_ids": beam.label_ids.tolist(),
                         "metrics": beam.metrics},
        "predict_greedy": {"predictions": greedy.predictions.tolist(), "label_ids": greedy.label_ids.tolist(),
                           "metrics": greedy.metrics},
        "weights": {k: v.detach().double().sum().item() for k, v in trainer.model.state_dict().items()},
    }  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    dropout = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    print(json.dumps(main(sys.argv[1], Path(sys.argv[2]), dropout), indent=1, default=str))
