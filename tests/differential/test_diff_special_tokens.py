"""The tokenizer's special tokens copied into the model's config at train(), as the installed transformers does.

transformers' Trainer aligns ``model.config`` / ``model.generation_config``'s pad, bos and eos ids with the
tokenizer's before training (4.57 - 5.0 in ``Trainer._align_special_tokens``, newer releases in
``trainer_utils.align_special_tokens``, each its own way: 4.57 keeps the generation config's old eos id
beside the new one). trainbus runs the installed release's own code: both configs come out the same.
"""

from __future__ import annotations

import pytest
import torch
from hf_diff import run_both

VOCAB = 24


def tokenizer() -> object:
    """A word-level tokenizer whose special tokens differ from the model config's (new ids for fine-tuning)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 4)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")  # fmt: skip


def gpt2() -> object:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=8, bos_token_id=5,
                        eos_token_id=5)  # fmt: skip
    return GPT2LMHeadModel(config)


def stack(rows: list[dict]) -> dict:
    return {key: torch.stack([row[key] for row in rows]) for key in rows[0]}


def configs_after_training(impl, d, processing_class) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": row, "labels": row} for row in torch.randint(4, VOCAB, (8, 6), generator=g)]
    args = impl.args(d, max_steps=1, per_device_train_batch_size=4, save_strategy="no", learning_rate=0.0)
    trainer = impl.Trainer(gpt2(), args, train_dataset=data, processing_class=processing_class, data_collator=stack)
    trainer.train()
    config, generation = trainer.model.config.to_dict(), trainer.model.generation_config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "architectures"):
        config.pop(volatile, None), generation.pop(volatile, None)
    return config, generation


def test_special_tokens_aligned_as_the_installed_release_does(tmp_path):
    tok = tokenizer()
    (hf_config, hf_generation), (tb_config, tb_generation) = run_both(
        lambda impl, d: configs_after_training(impl, d, tok), tmp_path
    )
    assert tb_config == hf_config
    assert tb_generation == hf_generation
    # every supported release copies the tokenizer's ids (the generation config may keep the old eos beside)
    assert (tb_config["pad_token_id"], tb_config["bos_token_id"], tb_config["eos_token_id"]) == (1, 2, 3)
    eos = tb_generation["eos_token_id"]
    assert eos == 3 or (isinstance(eos, list) and eos[0] == 3), eos


@pytest.mark.parametrize("processing_class", ["image_processor", "none"])
def test_nothing_aligned_without_a_tokenizer(tmp_path, processing_class):
    """An image processor (or none): neither implementation touches the config's special tokens."""
    from transformers import ViTImageProcessor

    processor = ViTImageProcessor() if processing_class == "image_processor" else None
    (hf_config, hf_generation), (tb_config, tb_generation) = run_both(
        lambda impl, d: configs_after_training(impl, d, processor), tmp_path
    )
    assert tb_config == hf_config and tb_generation == hf_generation
    assert (tb_config["pad_token_id"], tb_config["bos_token_id"], tb_config["eos_token_id"]) == (None, 5, 5)
