"""Real transformers models of several families, built from small configs, through train / evaluate / predict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainbus.plugins import Trainer, TrainingArguments

SEQ, VOCAB = 6, 40


def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0))  # fmt: skip


def bert() -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=37, num_labels=3)  # fmt: skip
    return BertForSequenceClassification(config)


def t5() -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=2,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)  # fmt: skip
    return T5ForConditionalGeneration(config)


def data(family: str, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (n, SEQ), generator=g)
    if family == "bert":
        return [{"input_ids": row, "labels": torch.tensor(int(row[0]) % 3)} for row in ids]
    return [{"input_ids": row, "labels": row.flip(0) if family == "t5" else row} for row in ids]


@pytest.mark.parametrize("family", ["gpt2", "bert", "t5"])
def test_train_evaluate_predict_on_transformers_models(family: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = {"gpt2": gpt2, "bert": bert, "t5": t5}[family]()
    seen: list[Any] = []

    def metrics(prediction: Any) -> dict[str, float]:
        seen.append(prediction)
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        return {"accuracy": float((logits.argmax(-1) == prediction.label_ids).mean())}

    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, per_device_eval_batch_size=3, max_steps=3,
        save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    trainer = Trainer(model, args, train_dataset=data(family, 12), compute_metrics=metrics)
    trainer.train()
    evaluated = trainer.evaluate(data(family, 7))
    assert np.isfinite(evaluated["eval_loss"]) and 0 <= evaluated["eval_accuracy"] <= 1
    prediction = trainer.predict(data(family, 7))
    logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
    assert logits.shape[0] == 7 and logits.shape[-1] == (3 if family == "bert" else VOCAB)
    # the cache of a causal / seq2seq LM (config.keys_to_ignore_at_inference) is left out, as HF does
    outputs = prediction.predictions if isinstance(prediction.predictions, tuple) else (prediction.predictions,)
    assert all(isinstance(o, np.ndarray) for o in outputs)
    assert "test_loss" in prediction.metrics and "test_accuracy" in prediction.metrics
    # ignore_keys given explicitly wins over the config's
    if family == "t5":
        only_logits = trainer.predict(data(family, 7), ignore_keys=["past_key_values", "encoder_last_hidden_state"])
        assert isinstance(only_logits.predictions, np.ndarray) and only_logits.predictions.shape == (7, SEQ, VOCAB)
