"""LoRA through peft: a tiny GPT-2 built from a config, trained by the Trainer and a bare Engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import GPT2Config, GPT2LMHeadModel

from trainbus.engine import ConfigError, Engine, Event
from trainbus.plugins import AdapterSwitch, Trainer, TrainingArguments, adapter_parameters, prepare_qlora

VOCAB, SEQ = 256, 8


def base_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    return GPT2LMHeadModel(config)


def lora(adapters: tuple[str, ...] = ("default",)) -> Any:
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
    model = get_peft_model(base_model(), config, adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, config)
    return model


def token_data(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def args_for(tmp_path: Path, **more: Any) -> TrainingArguments:
    settings: dict[str, Any] = dict(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, learning_rate=1e-2, max_steps=6,
        save_strategy="no", logging_steps=2, report_to="none", disable_tqdm=True, use_cpu=True, seed=0,
    )  # fmt: skip
    settings.update(more)
    return TrainingArguments(**settings)


def lora_state(model: Any, adapter: str = "default") -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n and f".{adapter}." in n}


def test_trainer_trains_only_the_adapter_and_saves_peft_format(tmp_path: Path) -> None:
    model = lora()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    adapter_before = lora_state(model)
    trainer = Trainer(model, args_for(tmp_path), train_dataset=token_data(24))
    trainer.train()
    held = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}  # type: ignore[union-attr]
    assert held == {id(p) for p in adapter_parameters(model)} and held
    for name, value in base_before.items():  # the frozen base is untouched
        assert torch.equal(dict(model.named_parameters())[name], value), name
    assert any(not torch.equal(v, lora_state(model)[n]) for n, v in adapter_before.items())
    # save_model writes peft's own format, which PeftModel.from_pretrained loads with equal outputs
    out = tmp_path / "adapter"
    trainer.save_model(str(out))
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert not (out / "model.safetensors").exists()
    loaded = PeftModel.from_pretrained(base_model(), str(out)).eval()
    ids = torch.stack([row["input_ids"] for row in token_data(3, seed=9)])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)


def test_a_bare_engine_trains_a_peft_model() -> None:
    model = lora()
    before = lora_state(model)
    loader = torch.utils.data.DataLoader(token_data(12), batch_size=4)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    engine = Engine(model, optimizer, train_data=loader, max_epochs=1)
    assert engine.fit().global_step == 3
    assert all(not torch.equal(v, lora_state(model)[n]) for n, v in before.items() if "lora_B" in n)


def test_two_adapters_trained_in_turn_and_saved_each(tmp_path: Path) -> None:
    model = lora(("task_a", "task_b"))
    switch = AdapterSwitch(["task_a", "task_b"], at="epoch")
    trained: dict[str, list[str]] = {"task_a": [], "task_b": []}
    snapshots: list[dict[str, dict[str, torch.Tensor]]] = []

    class Watch:  # an HF callback: which adapter is active in each epoch, and the weights after it
        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            trained[model.active_adapter].append(str(state.epoch))

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            snapshots.append({a: lora_state(model, a) for a in ("task_a", "task_b")})

    args = args_for(tmp_path, max_steps=-1, num_train_epochs=4)
    trainer = Trainer(model, args, train_dataset=token_data(8), callbacks=[switch, Watch()])
    trainer.train()
    assert [len(v) for v in trained.values()] == [2, 2]  # epochs 0, 2 train task_a; 1, 3 task_b
    for epoch, (previous, now) in enumerate(zip([None, *snapshots], snapshots)):
        if previous is None:
            continue
        idle = "task_b" if epoch % 2 == 0 else "task_a"  # the adapter not trained in this epoch
        assert all(torch.equal(previous[idle][n], now[idle][n]) for n in now[idle])
        active = "task_a" if idle == "task_b" else "task_b"
        assert any(not torch.equal(previous[active][n], now[active][n]) for n in now[active])
    out = tmp_path / "adapters"
    trainer.save_model(str(out))
    for adapter in ("task_a", "task_b"):
        folder = out / adapter  # peft's layout: a folder per adapter not named "default"
        assert (folder / "adapter_model.safetensors").is_file(), adapter
        reloaded = PeftModel.from_pretrained(base_model(), str(folder), adapter_name=adapter)
        for name, value in lora_state(reloaded, adapter).items():
            torch.testing.assert_close(value, lora_state(model, adapter)[name], rtol=0, atol=0)


def test_bad_adapter_set_ups_fail_before_training(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no adapter named \['task_c'\] in the model; it has \['task_a', 'task_b'\]"):
        Trainer(lora(("task_a", "task_b")), args_for(tmp_path), train_dataset=token_data(8),
                callbacks=[AdapterSwitch(["task_a", "task_c"])])  # fmt: skip
    with pytest.raises(ConfigError, match="need a peft model"):
        Trainer(base_model(), args_for(tmp_path), train_dataset=token_data(8), callbacks=[AdapterSwitch(["a"])])
    with pytest.raises(ConfigError, match="must be 'epoch' or 'step'"):
        AdapterSwitch(["a"], at="batch")
    model = lora(("task_a", "task_b"))
    only_a = torch.optim.SGD(adapter_parameters(model, ["task_a"]), lr=0.1)
    with pytest.raises(ConfigError, match=r"optimizer lacks the parameters of adapter\(s\) \['task_b'\]"):
        Engine(model, only_a, train_data=token_data(4), max_epochs=1, plugins=[AdapterSwitch(["task_a", "task_b"])])
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="QLoRA needs bitsandbytes and a CUDA GPU"):
            prepare_qlora(model)


def _lora_trainer(out: Path, **more: Any) -> Trainer:
    args = args_for(out, save_strategy="steps", save_steps=2, **more)
    return Trainer(lora(), args, train_dataset=token_data(24))


def test_lora_checkpoints_hold_only_what_trains_and_resume_bit_exact(tmp_path: Path) -> None:
    from trainbus.plugins.checkpoints.verified import read_manifest

    full = _lora_trainer(tmp_path / "full")
    full.train()
    checkpoint = tmp_path / "full" / "run" / "checkpoint-2"
    manifest = read_manifest(checkpoint)
    # the resume weights are trainbus's own file (model.safetensors would be mistaken for a model by from_pretrained)
    assert manifest["weights"] == "trainbus_weights.safetensors" and not (checkpoint / "model.safetensors").exists()
    weights = st_load(checkpoint / manifest["weights"])
    assert weights and all("lora_" in name for name in weights)  # the adapter, not the base
    adapter = st_load(checkpoint / "adapter_model.safetensors")  # peft's model folder: the adapter alone too
    assert adapter and all("lora_" in name for name in adapter)
    assert manifest["frozen_base"]["algorithm"] == "sha256" and manifest["frozen_base"]["parameters"] > 0
    # the whole training checkpoint against one holding the full model's weights instead
    whole = tmp_path / "whole.safetensors"
    import safetensors.torch as st

    st.save_model(lora(), str(whole))
    size = sum(f.stat().st_size for f in checkpoint.iterdir())
    full_model_checkpoint = size - (checkpoint / manifest["weights"]).stat().st_size + whole.stat().st_size
    assert size < 0.1 * full_model_checkpoint, (size, full_model_checkpoint)
    # resumed in a fresh Trainer from checkpoint-4: bit for bit the uninterrupted run
    resumed = _lora_trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "run" / "checkpoint-4"))
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name


def test_a_checkpoint_of_another_frozen_base_is_refused_before_training(tmp_path: Path) -> None:
    _lora_trainer(tmp_path / "a").train()
    other = lora()
    with torch.no_grad():
        other.base_model.model.transformer.wte.weight.add_(1.0)  # another base: same shapes, other weights
    trainer = Trainer(
        other, args_for(tmp_path / "b", save_strategy="steps", save_steps=2), train_dataset=token_data(24)
    )
    steps: list[int] = []
    trainer.on(Event.STEP_START, lambda ev: steps.append(ev.engine.state.global_step))
    with pytest.raises(ConfigError, match="was trained on another frozen base: its fingerprint is"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "a" / "run" / "checkpoint-2"))
    assert steps == []


def st_load(path: Path) -> dict[str, torch.Tensor]:
    import safetensors.torch as st

    return st.load_file(str(path))
