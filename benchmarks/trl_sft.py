"""trainbus.trl against TRL, per optimizer step, on the same SFT job (CPU): counted work and time.

Usage: python -m benchmarks.trl_sft [--steps 10] [--rounds 3]

The job: a tiny Llama (hidden 64, 2 layers) on 128 short texts with a locally trained tokenizer, batch 8,
accumulation 2, max_length 64, logging every 10 steps (TRL's default), no checkpoints, gradient
checkpointing off, fp32. The same script runs under ``trl`` and ``trainbus.trl`` (only the import differs).

Per optimizer step, each figure taken as (run of 2N steps - run of N steps) / N, so the constructor, the
optimizer's creation and the first step's caches are left out:

* ATen ops (``benchmarks.work.OpCounter``): the tensor work, which does not jitter;
* scalar reads of device values (``count_syncs``, CPU proxy: every tensor but the collator's batches
  counts as a device tensor; on a GPU each is a host sync);
* milliseconds (median of ``--rounds`` alternating rounds; noisy on a shared VM).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from benchmarks.work import aten_ops
from trainbus.engine.testing import count_syncs

IMPLEMENTATIONS = ("trl", "trainbus")
WORDS = ["the", "a", "cat", "dog", "bird", "tree", "river", "book", "sees", "likes", "reads", "very", "big", "small"]


def tokenizer(directory: str) -> Any:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.normalizer = normalizers.Lowercase()
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<pad>", "<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(directory)
    return fast


def texts(n: int) -> list[dict[str, str]]:
    rng = random.Random(0)
    return [{"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 60)))} for _ in range(n)]


def make_trainer(implementation: str, steps: int, tok: Any, output_dir: str, host: set[int]) -> Any:
    """The SFT script; the collator's batches are noted in ``host`` (the CPU proxy's host tensors)."""
    if implementation == "trl":
        from trl import SFTConfig, SFTTrainer
    else:
        from trainbus.trl import SFTConfig, SFTTrainer
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)  # fmt: skip
    args = SFTConfig(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8,
                     gradient_accumulation_steps=2, max_length=64, logging_steps=10, save_strategy="no",
                     report_to="none", disable_tqdm=True, use_cpu=True, bf16=False, gradient_checkpointing=False,
                     seed=0)  # fmt: skip
    trainer = SFTTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=Dataset.from_list(texts(128)),
                         processing_class=tok)  # fmt: skip
    collate = trainer.data_collator

    def noting(features: list[Any]) -> Any:
        batch = collate(features)
        host.update(v.untyped_storage().data_ptr() for v in batch.values() if isinstance(v, torch.Tensor))
        return batch

    trainer.data_collator = noting
    return trainer


def measure(implementation: str, steps: int, tok: Any, what: str) -> float:
    """One run of ``steps`` optimizer steps: its ATen ops, scalar reads or seconds (construction excluded)."""
    host: set[int] = set()
    with tempfile.TemporaryDirectory() as out:
        trainer = make_trainer(implementation, steps, tok, out, host)
        if what == "ops":
            return float(sum(aten_ops(trainer.train).values()))
        if what == "reads":
            with count_syncs(on_device=lambda t: t.untyped_storage().data_ptr() not in host) as counter:
                trainer.train()
            return float(counter.count)
        start = time.perf_counter()
        trainer.train()
        return time.perf_counter() - start


def per_step(implementation: str, steps: int, tok: Any, what: str) -> float:
    return (measure(implementation, 2 * steps, tok, what) - measure(implementation, steps, tok, what)) / steps


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args(argv)
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        tok = tokenizer(directory)
    rows: dict[str, dict[str, float]] = {name: {} for name in IMPLEMENTATIONS}
    for name in IMPLEMENTATIONS:
        measure(name, 1, tok, "time")  # warm-up: imports and first-call caches
        rows[name]["ATen ops / step"] = per_step(name, options.steps, tok, "ops")
        rows[name]["scalar reads / step"] = per_step(name, options.steps, tok, "reads")
    timings: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    for _ in range(options.rounds):  # alternating, so both see the same machine load
        for name in IMPLEMENTATIONS:
            timings[name].append(per_step(name, options.steps, tok, "time") * 1000)
    for name in IMPLEMENTATIONS:
        rows[name]["ms / step (median)"] = statistics.median(timings[name])
    _print(rows)
    return rows


def _print(rows: dict[str, dict[str, float]]) -> None:
    print(f"{'per optimizer step':<24}{'trainbus.trl':>14}{'trl':>14}")
    for key in rows["trl"]:
        print(f"{key:<24}{rows['trainbus'][key]:>14.2f}{rows['trl'][key]:>14.2f}")


if __name__ == "__main__":
    main()
