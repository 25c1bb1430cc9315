"""SFT under ``trl`` and under ``trainbus.trl``, the same script with only the import changed.

Every log record is compared key by key (loss, grad_norm, learning_rate, TRL's ``entropy``,
``mean_token_accuracy``, ``num_tokens``, the eval metrics) at rtol 1e-5, and the output folders file by
file (weights tensor by tensor, configs and tokenizer files as JSON, trainer_state.json's history).

Where TRL is not exact the test shows it independently and keeps trainbus's value: on transformers releases
that count a GPT-2's ``num_items_in_batch`` over unshifted labels (``GPT2LMHeadModel.loss_type`` is None),
TRL divides the window's token loss sum by one token per sequence too many; the differential run then
corrects transformers' count (``hf_release.hf_counting_shifted_labels``) and
``test_gpt2_logged_loss_is_the_token_mean`` computes the first step's loss by hand.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import hf_release
import pytest
import torch
from conformance.harness import differences
from trl_jobs import IMPLEMENTATIONS, as_run, common_config, logged, sft_script, text_rows, tiny_model


def run_pair(
    tmp_path: Path,
    tokenizer_dir: str,
    model_type: str,
    rows: list,
    eval_rows: list | None = None,
    peft_config: object = None,
    dropout: float = 0.0,
    **config: object,
) -> dict:
    """The script under trl (its causal-LM item count corrected where transformers miscounts) and trainbus."""
    runs = {}
    for name in IMPLEMENTATIONS:
        fix = name == "trl" and hf_release.hf_counts_unshifted(tiny_model(model_type, 64))
        with hf_release.hf_counting_shifted_labels() if fix else contextlib.nullcontext():
            trainer = sft_script(name, tokenizer_dir, model_type, rows, common_config(tmp_path / name, **config),
                                 eval_rows=eval_rows, peft_config=peft_config, dropout=dropout)  # fmt: skip
        runs[name] = (trainer, as_run(name, trainer))
    return runs


def assert_same(runs: dict) -> None:
    found = differences(runs["trl"][1], runs["trainbus"][1])
    assert not found, f"{len(found)} differences from trl:\n" + "\n".join(found)
    assert logged(runs["trainbus"][0], "mean_token_accuracy"), "TRL's metrics were not logged"


@pytest.mark.parametrize(("model_type", "dropout"), [("llama", 0.1), ("gpt2", 0.0)])
def test_sft_plain_text_matches_trl(tmp_path: Path, tokenizer_dir: str, model_type: str, dropout: float) -> None:
    """Plain text, truncated to max_length, accumulation 2 over micro-batches of uneven token counts (the
    last one a partial batch), gradient checkpointing on (TRL's default), a checkpoint every epoch; Llama
    with attention dropout (the same random draws, in the same order, recomputation included)."""
    runs = run_pair(tmp_path, tokenizer_dir, model_type, text_rows(14, 1), eval_rows=text_rows(5, 2), max_length=12,
                    gradient_accumulation_steps=2, eval_strategy="epoch", dropout=dropout)  # fmt: skip
    assert_same(runs)
    history = runs["trainbus"][0].state.log_history
    assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(history[0])
    assert any("eval_mean_token_accuracy" in r for r in history)


def test_gpt2_logged_loss_is_the_token_mean(tmp_path: Path, tokenizer_dir: str) -> None:
    """The first window's loss at learning rate 0, by hand: trainbus logs the mean over the predicted tokens;
    TRL on a transformers release that counts GPT-2's labels unshifted logs the sum over one token per sequence
    too many (both the installed release's behaviour, asked of it)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    rows = text_rows(8, 3)
    config = {"max_steps": 1, "learning_rate": 0.0, "gradient_accumulation_steps": 2, "save_strategy": "no",
              "max_length": 12}  # fmt: skip
    trainers = {n: sft_script(n, tokenizer_dir, "gpt2", rows, common_config(tmp_path / n, **config))
                for n in IMPLEMENTATIONS}  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model("gpt2", len(tokenizer)).eval()
    prepared = trainers["trainbus"].train_dataset
    assert isinstance(prepared, Dataset)
    order = torch.randperm(len(prepared), generator=torch.Generator().manual_seed(42)).tolist()  # seeded sampler
    collate = DataCollatorForLanguageModeling(pad_token_id=tokenizer.pad_token_id)
    total, predicted, counted = 0.0, 0, 0
    for start in (0, 4):  # the window: 2 micro-batches of 4
        batch = collate([prepared[i] for i in order[start : start + 4]])
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"]
        total += float(torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                                         reduction="sum"))  # fmt: skip
        predicted += int((labels[:, 1:] != -100).sum())
        counted += int((labels != -100).sum())
    assert counted == predicted + 8
    trl_items = counted if hf_release.hf_counts_unshifted(model) else predicted
    assert logged(trainers["trl"], "loss")[0] == pytest.approx(total / trl_items, rel=1e-5)
    assert logged(trainers["trainbus"], "loss")[0] == pytest.approx(total / predicted, rel=1e-5)


def without_timing(history: list) -> list:
    return [{k: v for k, v in r.items() if not k.endswith(("_runtime", "_per_second"))} for r in history]


def test_sft_resume_is_the_uninterrupted_run(tmp_path: Path, tokenizer_dir: str) -> None:
    """A resume from a checkpoint inside a logging window (step 3 of windows of 2 steps) logs what the
    uninterrupted run logs, bit for bit, TRL's metrics included, and ends with the same weights.

    TRL keeps its metrics outside the checkpoint: its resumed run counts ``num_tokens`` from 0 again and
    loses the open window's values (shown on its own resumed run)."""
    rows = text_rows(14, 4)
    config = {"max_steps": 6, "save_strategy": "steps", "save_steps": 3, "logging_steps": 2, "max_length": 12,
              "gradient_accumulation_steps": 2}  # fmt: skip
    full, resumed = {}, {}
    for name in IMPLEMENTATIONS:
        full[name] = sft_script(name, tokenizer_dir, "llama", rows, common_config(tmp_path / name, **config))
        checkpoint = str(tmp_path / name / "checkpoint-3")
        resumed[name] = sft_script(name, tokenizer_dir, "llama", rows, common_config(tmp_path / f"{name}-resumed",
                                   **config), resume=checkpoint)  # fmt: skip
    tb, tb_resumed = full["trainbus"], resumed["trainbus"]
    assert without_timing(tb_resumed.state.log_history) == without_timing(tb.state.log_history)
    for a, b in zip(tb.model.state_dict().values(), tb_resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # TRL: after the resume, num_tokens counts only the tokens seen since it
    trl_tokens, trl_resumed_tokens = logged(full["trl"], "num_tokens"), logged(resumed["trl"], "num_tokens")
    assert trl_tokens == logged(tb, "num_tokens")
    assert trl_resumed_tokens[-1] < trl_tokens[-1]


def lora() -> object:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


SCENARIOS = {
    # prompt-completion conversations: the loss on the completion only (TRL's default for that format)
    "completion_only": ({"rows": "prompt_completion"}, {}),
    "assistant_only": ({"rows": "conversation"}, {"assistant_only_loss": True}),
    # best-fit-decreasing packing into rows of 24 tokens, padding-free with position ids
    "packed_bfd": ({"rows": "text"}, {"packing": True, "max_length": 24}),
    "lora": ({"rows": "text", "peft": True}, {}),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_sft_scenario_matches_trl(tmp_path: Path, tokenizer_dir: str, scenario: str) -> None:
    from trl_jobs import conversation_rows, prompt_completion_rows

    setting, extra = SCENARIOS[scenario]
    make = {"text": text_rows, "conversation": conversation_rows, "prompt_completion": prompt_completion_rows}
    rows = make[setting["rows"]](14, 5)
    config = {"max_length": 16, "gradient_accumulation_steps": 2, "num_train_epochs": 1, **extra}
    runs = run_pair(tmp_path, tokenizer_dir, "llama", rows, peft_config=lora() if setting.get("peft") else None,
                    **config)  # fmt: skip
    assert_same(runs)


def next_token_accuracy(prediction: object) -> dict:
    predicted = prediction.predictions.argmax(-1)[:, :-1]  # type: ignore[attr-defined]
    labels = prediction.label_ids[:, 1:]  # type: ignore[attr-defined]
    kept = labels != -100
    return {"next_token_accuracy": float((predicted[kept] == labels[kept]).mean())}


def test_sft_compute_metrics_matches_trl(tmp_path: Path, tokenizer_dir: str) -> None:
    """compute_metrics gets the logits of an extra forward without the fused head (TRL's), next to TRL's metrics."""
    config = {"max_length": 12, "eval_strategy": "epoch", "save_strategy": "no", "num_train_epochs": 1}
    runs = {}
    for name in IMPLEMENTATIONS:
        trainer = sft_script(name, tokenizer_dir, "llama", text_rows(8, 1), common_config(tmp_path / name, **config),
                             eval_rows=text_rows(6, 2), compute_metrics=next_token_accuracy)  # fmt: skip
        runs[name] = (trainer, as_run(name, trainer))
    assert_same(runs)
    assert logged(runs["trainbus"][0], "eval_next_token_accuracy")
