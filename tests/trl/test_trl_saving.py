"""What trainbus.trl writes to disk, against TRL: the model card only where TRL writes one, and LoRA checkpoints that
hold the adapter (peft's folder) and no full model.

TRL writes ``README.md`` into output_dir with every checkpoint (its ``_save_checkpoint``); transformers'
``save_model`` writes none. With ``save_strategy="no"`` a script that ends with ``trainer.save_model()`` (TRL's
``sft.py`` / ``dpo.py``) therefore leaves no model card.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conformance.harness import compare_files, extra_files
from trl_jobs import IMPLEMENTATIONS, as_run, common_config, dpo_script, preference_rows, sft_script, text_rows

JOBS = {
    "sft": lambda name, tok, out, **c: sft_script(name, tok, "llama", text_rows(6, 1), common_config(out, **c)),
    "dpo": lambda name, tok, out, **c: dpo_script(name, tok, "llama", preference_rows(4, 1), common_config(out, **c)),
}


@pytest.mark.parametrize("job", list(JOBS))
def test_no_model_card_without_checkpoints(tmp_path: Path, tokenizer_dir: str, job: str) -> None:
    """``save_strategy="no"`` then ``save_model()``, as TRL's scripts end: the same files as TRL, no README.md."""
    runs = {}
    for name in IMPLEMENTATIONS:
        trainer = JOBS[job](name, tokenizer_dir, tmp_path / name, max_steps=1, save_strategy="no", max_length=24)
        trainer.save_model()
        runs[name] = as_run(name, trainer)
    assert not any(f.endswith("README.md") for f in runs["trl"].files)  # TRL writes none here
    assert not any(f.endswith("README.md") for f in runs["trainbus"].files), sorted(runs["trainbus"].files)
    assert not compare_files(runs["trl"], runs["trainbus"])
    assert "model.safetensors" in runs["trainbus"].files


@pytest.mark.parametrize("job", list(JOBS))
def test_model_card_with_checkpoints_as_trl(tmp_path: Path, tokenizer_dir: str, job: str) -> None:
    """With checkpoints TRL writes README.md into output_dir (not into checkpoint-N): trainbus.trl too."""
    runs = {}
    for name in IMPLEMENTATIONS:
        trainer = JOBS[job](name, tokenizer_dir, tmp_path / name, max_steps=1, save_strategy="steps", save_steps=1,
                            max_length=24)  # fmt: skip
        runs[name] = as_run(name, trainer)
    cards = {name: sorted(f for f in run.files if f.endswith("README.md")) for name, run in runs.items()}
    assert cards["trl"] == ["README.md"]
    assert cards["trainbus"] == cards["trl"]
    assert not {f for f in extra_files(runs["trl"], runs["trainbus"]) if f.endswith("README.md")}


def test_lora_checkpoint_holds_no_base_model_and_resumes_bit_for_bit(tmp_path: Path, tokenizer_dir: str) -> None:
    """A LoRA checkpoint is peft's folder as TRL's is, without a model.safetensors nor any file holding the frozen
    base (it comes from the model at resume); resuming from it gives the uninterrupted run's records and weights."""
    from safetensors import safe_open
    from test_trl_sft import lora, without_timing

    config = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "max_length": 12, "learning_rate": 5e-2}
    rows = text_rows(12, 3)
    trl = sft_script("trl", tokenizer_dir, "llama", rows, common_config(tmp_path / "trl", **config), peft_config=lora())
    full = sft_script("trainbus", tokenizer_dir, "llama", rows, common_config(tmp_path / "full", **config),
                      peft_config=lora())  # fmt: skip
    checkpoint = tmp_path / "full" / "checkpoint-2"
    ours, theirs = as_run("trainbus", full), as_run("trl", trl)
    assert "checkpoint-2/adapter_model.safetensors" in theirs.files
    assert not compare_files(theirs, ours)  # TRL's files, the adapter tensor by tensor
    assert not {f for f in ours.files if f.endswith("model.safetensors") and "adapter" not in f}
    base = {n for n, p in full.model.named_parameters() if not p.requires_grad}
    assert len(base) > 10
    for path in checkpoint.glob("*.safetensors"):
        with safe_open(str(path), "pt") as f:
            held = set(f.keys())
        assert not held & base, f"{path.name} holds frozen base weights"
    resumed = sft_script("trainbus", tokenizer_dir, "llama", rows, common_config(tmp_path / "resumed", **config),
                         peft_config=lora(), resume=str(checkpoint))  # fmt: skip
    assert without_timing(resumed.state.log_history) == without_timing(full.state.log_history)
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
