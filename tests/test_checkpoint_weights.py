"""Which weights a checkpoint holds, by which names (#27 item 4), on plain modules: fast, no transformers model.

* a model with frozen parameters that is no adapter model is saved whole, and its checkpoints
  written before (trainable weights + the frozen base's fingerprint) still resume bit for bit;
* of tied names the one a module's ``_tied_weights_keys`` does not declare is kept (transformers' rule);
* an adapter model is recognised through DDP / compile wrappers, and only then saved adapter-only.
The transformers and peft models themselves: tests/conformance/test_checkpoint_folders.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import load_file

from trainbus.engine import Engine
from trainbus.plugins.checkpoints import frozen
from trainbus.plugins.checkpoints import writing as ckpt
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, resume
from trainbus.plugins.checkpoints.verified import read_manifest
from trainbus.plugins.checkpoints.weights import state_to_save


def partly_frozen() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    model[0].requires_grad_(False)  # a frozen encoder
    return model


def run(out: Path, max_steps: int, checkpoint: Path | None = None) -> Engine:
    model = partly_frozen()
    data = [(torch.randn(2, 3, generator=torch.Generator().manual_seed(i)), torch.ones(2, 1)) for i in range(3)]
    engine = Engine(
        model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05), train_data=data,
        max_steps=max_steps, loss_fn=torch.nn.MSELoss(),
        plugins=[Checkpointing(out, save_strategy="steps", save_steps=2)],
    )  # fmt: skip
    if checkpoint is not None:
        resume(engine, checkpoint)
    engine.fit()
    return engine


def test_a_frozen_layer_of_a_plain_model_is_in_its_checkpoint(tmp_path: Path) -> None:
    engine = run(tmp_path / "full", 4)
    folder = tmp_path / "full" / "checkpoint-2"
    assert set(load_file(str(folder / "model.safetensors"))) == set(engine.model.state_dict())
    assert "frozen_base" not in read_manifest(folder)
    resumed = run(tmp_path / "resumed", 4, folder)
    for (name, a), b in zip(engine.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_an_older_trainable_only_checkpoint_still_resumes_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = run(tmp_path / "full", 4)
    with monkeypatch.context() as patch:  # as trainbus wrote a partly frozen model before: no frozen weights
        patch.setattr(ckpt, "checkpoint_fingerprint", frozen.base_fingerprint)
        run(tmp_path / "old", 2)
    folder = tmp_path / "old" / "checkpoint-2"
    assert set(load_file(str(folder / "model.safetensors"))) == {"2.weight", "2.bias"}
    assert read_manifest(folder)["frozen_base"]["parameters"] == 2
    resumed = run(tmp_path / "resumed", 4, folder)
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name


class Tied(torch.nn.Module):
    """A head tied to an embedding, declared as transformers models declare it (5.x: target -> source).

    The target sorts first, as GPT-2's ``lm_head.weight`` before ``transformer.wte.weight``:
    safetensors' own rule would keep it.
    """

    _tied_weights_keys: ClassVar[Any] = {"head.weight": "wte.weight"}

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.wte.weight


class Outer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Tied()


@pytest.mark.parametrize("declared", [{"head.weight": "wte.weight"}, ["head.weight"], [r"hea.\.weight"]])
def test_a_tied_weight_keeps_the_name_its_module_does_not_declare(
    monkeypatch: pytest.MonkeyPatch, declared: Any
) -> None:
    monkeypatch.setattr(Tied, "_tied_weights_keys", declared)  # 5.x dict, 4.x list, a pattern
    assert list(state_to_save(Tied())) == ["wte.weight"]
    assert list(state_to_save(Outer())) == ["inner.wte.weight"]  # prefixed with the submodule's path


def test_undeclared_ties_keep_the_sorted_first_name_and_untied_models_every_name() -> None:
    model = Tied()
    model._tied_weights_keys = None  # type: ignore[misc]
    assert list(state_to_save(model)) == ["head.weight"]  # safetensors' rule
    model._tied_weights_keys = ["wte.weight", "head.weight"]  # type: ignore[misc]
    assert list(state_to_save(model)) == ["wte.weight"]  # all declared: transformers keeps the last sorted
    plain = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    assert list(state_to_save(plain)) == list(plain.state_dict())


def test_an_adapter_model_is_found_through_wrappers_and_only_it_is_saved_adapter_only() -> None:
    peft = pytest.importorskip("peft")
    base = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    lora = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0"]))

    class Wrapper(torch.nn.Module):  # DDP's .module / torch.compile's ._orig_mod
        def __init__(self, inner: torch.nn.Module, attribute: str) -> None:
            super().__init__()
            setattr(self, attribute, inner)

    for model in (lora, Wrapper(lora, "module"), Wrapper(Wrapper(lora, "_orig_mod"), "module")):
        assert frozen.adapter_model(model) is lora
        assert frozen.checkpoint_fingerprint(model) == frozen.base_fingerprint(model) is not None
    assert frozen.adapter_model(partly_frozen()) is None
    assert frozen.checkpoint_fingerprint(partly_frozen()) is None
    assert frozen.base_fingerprint(partly_frozen()) is not None  # still checked on an older checkpoint


def two_adapters() -> Any:
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    config = peft.LoraConfig(r=2, target_modules=["0"], init_lora_weights=False)  # both factors train from step 1
    model = peft.get_peft_model(base, config, adapter_name="task_a")
    model.add_adapter("task_b", config)
    return model


def adapter_run(out: Path, max_steps: int, checkpoint: Path | None = None) -> Engine:
    from trainbus.plugins import AdapterSwitch, adapter_parameters

    model = two_adapters()
    data = [(torch.randn(2, 3, generator=torch.Generator().manual_seed(i)), torch.ones(2, 1)) for i in range(3)]
    engine = Engine(
        model, torch.optim.AdamW(adapter_parameters(model), lr=0.05), train_data=data, max_steps=max_steps,
        loss_fn=torch.nn.MSELoss(), plugins=[AdapterSwitch(["task_a", "task_b"], at="step"),
                                             Checkpointing(out, save_strategy="steps", save_steps=2)],
    )  # fmt: skip
    if checkpoint is not None:
        resume(engine, checkpoint)
    engine.fit()
    return engine


def test_adapters_trained_in_turn_are_all_saved_and_resume_bit_for_bit(tmp_path: Path) -> None:
    """peft freezes the adapter not active: it is still saved, and the base fingerprint ignores which one is."""
    full = adapter_run(tmp_path / "full", 5)
    folder = tmp_path / "full" / "checkpoint-2"
    saved = set(load_file(str(folder / "trainbus_weights.safetensors")))  # the resume's: peft's folder is the model's
    assert {n for n in full.model.state_dict() if "lora_" in n} == saved  # both adapters, no base weight
    assert not (folder / "model.safetensors").exists()  # no second copy of the adapter for from_pretrained to misread
    assert read_manifest(folder)["frozen_base"]["parameters"] == 4  # the two Linear layers' weights and biases
    assert all((folder / name / "adapter_model.safetensors").is_file() for name in ("task_a", "task_b"))
    assert not (folder / "config.json").exists()
    resumed = adapter_run(tmp_path / "resumed", 5, folder)
    for (name, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name
