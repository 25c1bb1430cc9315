"""The scripts of the TRL differential tests: one script, run under ``trl`` and under ``trainbus.trl``.

``sft_script`` / ``dpo_script`` are written as a TRL user writes them: a tokenizer (trained here, locally,
with a chat template set on it), a tiny GPT-2 or Llama made from a config, a ``datasets.Dataset``, the
config and the trainer. ``implementation`` picks the one import a port changes; nothing else differs.
The runs are compared with the conformance harness (``tests/conformance/harness.py``): every log record
key by key (losses and TRL's metrics at rtol 1e-5), and the output folders file by file.
"""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch
from conformance.harness import Run, files_under

IMPLEMENTATIONS = ("trl", "trainbus")

WORDS = ["cat", "dog", "bird", "tree", "river", "book", "sees", "likes", "reads", "the", "a", "very", "big", "small"]
#: ChatML with generation markers around the assistant's content and end-of-turn (assistant_only_loss)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant ' }}{% endif %}"
)
SPECIALS = ["<pad>", "<unk>", "<eos>", "<|im_start|>", "<|im_end|>"]
CONFIGS = {
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64},
    "llama": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "max_position_embeddings": 64},
}  # fmt: skip


def sentence(rng: random.Random, low: int = 2, high: int = 9) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def write_tokenizer(directory: Path) -> str:
    """A WordPiece tokenizer trained on the words above, with ChatML special tokens and the chat template."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    rng = random.Random(0)
    tokenizer.train_from_iterator(
        [sentence(rng) for _ in range(200)] + ["user assistant system"] * 20, trainers.WordPieceTrainer(
            vocab_size=100, special_tokens=SPECIALS)
    )  # fmt: skip
    tokenizer.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(directory))
    return str(directory)


def tiny_model(model_type: str, vocab_size: int, dropout: float = 0.0, seed: int = 0) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, vocab_size=vocab_size, **CONFIGS[model_type])
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
        if hasattr(config, name):
            setattr(config, name, dropout)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


# -- data -------------------------------------------------------------------------------------------------
def text_rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"text": sentence(rng, 2, 14)} for _ in range(n)]


def conversation_rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"messages": [{"role": "user", "content": sentence(rng)}, {"role": "assistant", "content": sentence(rng)}]}
        for _ in range(n)
    ]


def prompt_completion_rows(n: int, seed: int, conversational: bool = True) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    if not conversational:
        return [{"prompt": sentence(rng), "completion": " " + sentence(rng)} for _ in range(n)]
    return [
        {"prompt": [{"role": "user", "content": sentence(rng)}],
         "completion": [{"role": "assistant", "content": sentence(rng)}]}
        for _ in range(n)
    ]  # fmt: skip


def preference_rows(n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [
        {"prompt": [{"role": "user", "content": sentence(rng)}],
         "chosen": [{"role": "assistant", "content": sentence(rng, 1, 6)}],
         "rejected": [{"role": "assistant", "content": sentence(rng, 1, 6)}]}
        for _ in range(n)
    ]  # fmt: skip


# -- the scripts ------------------------------------------------------------------------------------------
def common_config(output_dir: Path, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "output_dir": str(output_dir), "seed": 42, "use_cpu": True, "bf16": False, "report_to": "none",
        "disable_tqdm": True, "logging_steps": 1, "num_train_epochs": 2, "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4, "learning_rate": 5e-3, "save_strategy": "epoch",
    }  # fmt: skip
    config.update(overrides)
    return config


def sft_script(implementation: str, tokenizer_dir: str, model_type: str, train: list[dict[str, Any]],
               config: dict[str, Any], eval_rows: list[dict[str, Any]] | None = None, peft_config: Any = None,
               resume: Any = None, dropout: float = 0.0, compute_metrics: Any = None) -> Any:  # fmt: skip
    """The SFT script; returns the trainer after ``train()``."""
    if implementation == "trl":
        from trl import SFTConfig, SFTTrainer
    else:
        from trainbus.trl import SFTConfig, SFTTrainer
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(model_type, len(tokenizer), dropout)
    args = SFTConfig(**config)
    eval_dataset = None if eval_rows is None else Dataset.from_list(eval_rows)
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(train), eval_dataset=eval_dataset,
        processing_class=tokenizer, peft_config=copy.deepcopy(peft_config), compute_metrics=compute_metrics,
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def as_run(name: str, trainer: Any) -> Run:
    output_dir = Path(trainer.args.output_dir)
    return Run(
        implementation="transformers" if name == "trl" else "trainbus", output_dir=output_dir,
        log_history=copy.deepcopy(list(trainer.state.log_history)), train_metrics={}, eval_metrics={},
        predictions=None, label_ids=None, predict_metrics={}, files=files_under(output_dir),
    )  # fmt: skip


def logged(trainer: Any, key: str) -> list[float]:
    return [float(r[key]) for r in trainer.state.log_history if key in r]


def dpo_script(implementation: str, tokenizer_dir: str, model_type: str, train: list[dict[str, Any]],
               config: dict[str, Any], eval_rows: list[dict[str, Any]] | None = None, peft_config: Any = None,
               with_ref_model: bool = True, ref_seed: int = 0, resume: Any = None) -> Any:  # fmt: skip
    """The DPO script; ``with_ref_model`` passes a reference model (the initial policy when ``ref_seed`` is 0)."""
    if implementation == "trl":
        from trl import DPOConfig, DPOTrainer
    else:
        from trainbus.trl import DPOConfig, DPOTrainer
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(model_type, len(tokenizer))
    ref_model = tiny_model(model_type, len(tokenizer), seed=ref_seed) if with_ref_model else None
    eval_dataset = None if eval_rows is None else Dataset.from_list(eval_rows)
    trainer = DPOTrainer(
        model=model, ref_model=ref_model, args=DPOConfig(**config), train_dataset=Dataset.from_list(train),
        eval_dataset=eval_dataset, processing_class=tokenizer, peft_config=copy.deepcopy(peft_config),
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=resume)
    return trainer
