"""DPO under ``trl`` and under ``trainbus.trl``, the same script with only the import changed.

Compared as the SFT runs are: every log record key by key (loss, ``rewards/*``, ``logps/*``, ``logits/*``,
``entropy``, ``mean_token_accuracy``, ``num_tokens``, the eval metrics) at rtol 1e-5 and the output folders.
Where TRL is not exact (micro-batches of a window holding different numbers of pairs: TRL averages their
means), ``test_dpo_accumulation_is_the_mean_over_pairs`` computes the step's loss by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conformance.harness import differences
from trl_jobs import IMPLEMENTATIONS, as_run, common_config, dpo_script, logged, preference_rows, tiny_model

DPO_METRICS = {
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
    "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens",
}  # fmt: skip


def lora() -> object:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


#: the loss variants run one epoch with no evaluation (the loss and metrics are what they add)
ONE_EPOCH = {"num_train_epochs": 1, "eval_strategy": "no"}
SCENARIOS = {
    "sigmoid_ref_model": ({"with_ref_model": True}, {}),
    "ipo_ref_model": ({"with_ref_model": True}, {"loss_type": "ipo", "beta": 0.5, **ONE_EPOCH}),
    "hinge_ref_model": ({"with_ref_model": True}, {"loss_type": "hinge", **ONE_EPOCH}),
    # a new LoRA adapter: the base model (adapters disabled) is the reference
    "adapter_as_reference": ({"with_ref_model": False, "peft": True}, ONE_EPOCH),
    # the initial policy's log-probabilities computed once, before training, into the datasets
    "precomputed_reference": ({"with_ref_model": False}, {"precompute_ref_log_probs": True}),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_dpo_matches_trl(tmp_path: Path, tokenizer_dir: str, scenario: str) -> None:
    """12 pairs, batch 4, accumulation 2 (windows of 2 + 1 micro-batches), eval every epoch, checkpoints."""
    setting, extra = SCENARIOS[scenario]
    config = {"gradient_accumulation_steps": 2, "max_length": 24, "eval_strategy": "epoch", **extra}
    evaluates = config["eval_strategy"] != "no"
    runs = {}
    for name in IMPLEMENTATIONS:
        trainer = dpo_script(name, tokenizer_dir, "llama", preference_rows(12, 1), common_config(tmp_path / name,
                             **config), eval_rows=preference_rows(4, 2) if evaluates else None,
                             with_ref_model=setting["with_ref_model"],
                             peft_config=lora() if setting.get("peft") else None)  # fmt: skip
        runs[name] = (trainer, as_run(name, trainer))
    found = differences(runs["trl"][1], runs["trainbus"][1])
    assert not found, f"{len(found)} differences from trl:\n" + "\n".join(found)
    history = runs["trainbus"][0].state.log_history
    assert set(history[0]) >= DPO_METRICS
    assert not evaluates or any(f"eval_{m}" in r for r in history for m in DPO_METRICS)


def test_dpo_accumulation_is_the_mean_over_pairs(tmp_path: Path, tokenizer_dir: str) -> None:
    """6 pairs, batch 4, accumulation 2: one window of micro-batches of 4 and 2 pairs. At learning rate 0 the
    step's loss by hand: trainbus logs the mean over the 6 pairs; TRL the mean of the two micro-batch means
    (the 2-pair batch weighs as much as the 4-pair one). A reference other than the policy makes pairs differ."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    config = {"max_steps": 1, "learning_rate": 0.0, "gradient_accumulation_steps": 2, "save_strategy": "no",
              "max_length": 24, "num_train_epochs": 1}  # fmt: skip
    trainers = {n: dpo_script(n, tokenizer_dir, "llama", preference_rows(6, 3), common_config(tmp_path / n, **config),
                              ref_seed=1) for n in IMPLEMENTATIONS}  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    policy, reference = tiny_model("llama", len(tokenizer)), tiny_model("llama", len(tokenizer), seed=1)
    prepared = trainers["trainbus"].train_dataset
    assert isinstance(prepared, Dataset)
    order = torch.randperm(len(prepared), generator=torch.Generator().manual_seed(42)).tolist()  # seeded sampler
    collate = DataCollatorForPreference(pad_token_id=tokenizer.pad_token_id, max_length=24)
    per_batch = []
    for start in (0, 4):
        batch = collate([prepared[i] for i in order[start : start + 4]])
        per_batch.append(pair_losses(policy, reference, batch, beta=0.1))
    every_pair = torch.cat(per_batch)
    assert logged(trainers["trainbus"], "loss")[0] == pytest.approx(float(every_pair.mean()), rel=1e-5)
    trl_value = float((per_batch[0].mean() + per_batch[1].mean()) / 2)
    assert logged(trainers["trl"], "loss")[0] == pytest.approx(trl_value, rel=1e-5)
    assert abs(trl_value - float(every_pair.mean())) > 1e-4  # the case tells the two apart


def pair_losses(policy: torch.nn.Module, reference: torch.nn.Module, batch: dict, beta: float) -> torch.Tensor:
    """DPO's sigmoid loss per pair from plain forwards (log-softmax of the full logits)."""

    def completion_logps(model: torch.nn.Module) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        targets = batch["input_ids"][:, 1:]
        logps = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return (logps * batch["completion_mask"][:, 1:]).sum(1)

    chosen, rejected = completion_logps(policy).chunk(2)
    ref_chosen, ref_rejected = completion_logps(reference).chunk(2)
    delta = (chosen - ref_chosen) - (rejected - ref_rejected)
    return -torch.nn.functional.logsigmoid(beta * delta)


def test_dpo_resume_is_the_uninterrupted_run(tmp_path: Path, tokenizer_dir: str) -> None:
    """A resume from a checkpoint inside a logging window logs the uninterrupted run's records (rewards,
    logps, ... included) bit for bit and ends with the same weights."""
    config = {"max_steps": 6, "save_strategy": "steps", "save_steps": 3, "logging_steps": 2, "max_length": 24,
              "gradient_accumulation_steps": 2}  # fmt: skip
    rows = preference_rows(16, 1)
    full = dpo_script("trainbus", tokenizer_dir, "llama", rows, common_config(tmp_path / "full", **config), ref_seed=1)
    resumed = dpo_script("trainbus", tokenizer_dir, "llama", rows, common_config(tmp_path / "resumed", **config),
                         ref_seed=1, resume=str(tmp_path / "full" / "checkpoint-3"))  # fmt: skip

    def kept(history: list) -> list:
        return [{k: v for k, v in r.items() if not k.endswith(("_runtime", "_per_second"))} for r in history]

    assert kept(resumed.state.log_history) == kept(full.state.log_history)
    assert "rewards/margins" in full.state.log_history[0]
    for a, b in zip(full.model.state_dict().values(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
