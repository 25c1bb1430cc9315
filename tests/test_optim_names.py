"""Every HF ``optim`` name maps to its implementation: trained through the Trainer, checked against HF's own
choice of class and arguments, resumed bit for bit, and refused before a run when it cannot work."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from trainbus.engine import ConfigError, Event
from trainbus.plugins.facade.arguments import TrainingArguments
from trainbus.plugins.facade.trainer import Trainer
from trainbus.plugins.optimization.optimizer_modes import ScheduleFreeModes
from trainbus.plugins.optimization.optimizer_names import OPTIMIZER_NAMES, OPTIMIZERS, OptimizerRequest
from trainbus.plugins.optimization.optimizer_state import LayerwiseOptimizer
from trainbus.plugins.optimization.optimizers import create_optimizer, parameter_groups

#: need a CUDA GPU (checked before a run); this machine has none
NEEDS_CUDA = [n for n, s in OPTIMIZERS.items() if s.device == "cuda"]
#: their packages cannot be installed here (torch-xla / torch-npu pin other torch builds; torchdistx is not on PyPI)
NOT_INSTALLABLE = ["adamw_torch_xla", "adamw_torch_npu_fused", "adamw_anyprecision"]
RUNS_ON_CPU = [n for n in OPTIMIZER_NAMES if n not in NEEDS_CUDA and n not in NOT_INSTALLABLE]


class Net(torch.nn.Module):
    """An embedding, a 64x64 Linear (4096 weights: big enough for 8-bit and 4-bit state), a LayerNorm."""

    def __init__(self, vocab: int = 10) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 64)
        self.hidden = torch.nn.Linear(64, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.out = torch.nn.Linear(64, 1)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.out(self.norm(torch.relu(self.hidden(self.emb(ids).mean(1))))).squeeze(-1)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.mse_loss(logits, labels)
        return out


def dataset(n: int = 16) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"ids": torch.randint(0, 10, (4,), generator=g), "labels": torch.randn((), generator=g)} for _ in range(n)]


def arguments(name: str, out: Path, **overrides: Any) -> TrainingArguments:
    spec = OPTIMIZERS[name]
    settings: dict[str, Any] = {
        "optim": name, "max_steps": 3, "per_device_train_batch_size": 8, "learning_rate": 1e-2, "logging_steps": 1,
        "save_strategy": "no", "disable_tqdm": True, "use_cpu": True,
        "weight_decay": 0.0 if spec.fused_backward else 0.01,
    }  # fmt: skip
    if spec.low_rank:
        settings.update(optim_target_modules=["hidden"], optim_args="rank=4,update_proj_gap=2")
    return TrainingArguments(str(out), **{**settings, **overrides})


def trainer_for(name: str, out: Path, **overrides: Any) -> Trainer:
    torch.manual_seed(0)
    evaluated = overrides.get("eval_strategy", "no") != "no"
    args = arguments(name, out, **overrides)
    return Trainer(Net(), args, train_dataset=dataset(), eval_dataset=dataset(8) if evaluated else None)


@pytest.fixture(autouse=True)
def eager_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    # torchao's low-bit AdamW compiles its update (~15 s on CPU); the eager update is the same math
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: fn)


def implementation(optimizer: torch.optim.Optimizer) -> type:
    if isinstance(optimizer, LayerwiseOptimizer):
        return type(next(iter(optimizer.optimizers.values())))
    return type(optimizer)


def test_the_table_holds_every_hf_optimizer_name() -> None:
    from transformers.training_args import OptimizerNames

    assert set(OPTIMIZER_NAMES) == {n.value for n in OptimizerNames}


@pytest.mark.parametrize("name", RUNS_ON_CPU)
def test_each_name_trains_through_the_trainer(name: str, tmp_path: Path) -> None:
    steps = 5 if name == "schedule_free_radam" else 3  # RAdam does not move in its first 4 steps
    trainer = trainer_for(name, tmp_path, max_steps=steps)
    batch = {"ids": torch.stack([d["ids"] for d in dataset()]), "labels": torch.stack([d["labels"] for d in dataset()])}
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with torch.no_grad():
        loss_before = float(trainer.model(**batch)["loss"])
    trainer.train()
    spec = OPTIMIZERS[name]
    assert implementation(trainer.optimizer).__module__.split(".")[0] == spec.module
    assert isinstance(trainer.optimizer, LayerwiseOptimizer) == spec.layerwise
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == steps and all(torch.isfinite(torch.tensor(losses)))
    for param_name, param in trainer.model.named_parameters():
        assert not torch.equal(param, before[param_name]), f"{param_name} did not move"
    with torch.no_grad():
        assert float(trainer.model(**batch)["loss"]) != loss_before


# -- HF's own class and keyword arguments for each name ---------------------------------------------------
def hf_choice(name: str, out: Path, optim_args: str | None, **settings: Any) -> tuple[Any, dict[str, Any], Net]:
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments as HFArguments

    model = Net()
    args = HFArguments(str(out), optim=name, optim_args=optim_args, use_cpu=True, report_to="none", **settings)
    cls, kwargs = HFTrainer.get_optimizer_cls_and_kwargs(args, model)
    return cls, kwargs, model


def ours(name: str, optim_args: dict[str, Any], weight_decay: float, **settings: Any) -> tuple[Any, Any, Any, Net]:
    model = Net()
    request = OptimizerRequest(
        name, model, parameter_groups(model, weight_decay), 0.02, weight_decay, (0.8, 0.99), 1e-6, dict(optim_args),
        settings.get("optim_target_modules"), settings.get("warmup_steps", 0),
    )  # fmt: skip
    return (*OPTIMIZERS[name].resolve(request), model)


def projected_groups(groups: list[dict[str, Any]], model: torch.nn.Module) -> list[tuple[list[str], dict[str, Any]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [
        (sorted(names[id(p)] for p in g["params"]), {k: v for k, v in g.items() if k not in ("params", "weight_decay")})
        for g in groups
        if "rank" in g
    ]


WITH_OPTIM_ARGS = {
    "sgd": ("momentum=0.9,nesterov=true", {"momentum": 0.9, "nesterov": True}),
    "ademamix": ("beta3=0.99,alpha=4.0,t_alpha=100", {"beta3": 0.99, "alpha": 4.0, "t_alpha": 100}),
    # (not block_size: HF passes it on as a string)
    "adamw_torch_8bit": ("bf16_stochastic_round=true", {"bf16_stochastic_round": True}),
    "galore_adamw": ("rank=8,update_proj_gap=50,scale=0.5", {"rank": 8, "update_proj_gap": 50, "scale": 0.5}),
    "apollo_adamw": ("rank=8,scale_type=tensor", {"rank": 8, "scale_type": "tensor"}),
    "schedule_free_sgd": ("r=0.5,weight_lr_power=1.0", {"r": 0.5, "weight_lr_power": 1.0}),
    "grokadamw": ("lamb=3.0,gamma=0.2", {"lamb": 3.0, "gamma": 0.2}),
    "stable_adamw": ("decouple_lr=true,max_lr=0.01", {"decouple_lr": True, "max_lr": 0.01}),
}
PARITY = [(n, None, {}) for n in OPTIMIZER_NAMES if n not in NOT_INSTALLABLE and not OPTIMIZERS[n].layerwise]
PARITY += [(n, text, parsed) for n, (text, parsed) in WITH_OPTIM_ARGS.items()]


@pytest.mark.parametrize(("name", "optim_args", "parsed"), PARITY)
def test_class_and_arguments_match_hf(
    name: str, optim_args: str | None, parsed: dict[str, Any], tmp_path: Path
) -> None:
    spec = OPTIMIZERS[name]
    weight_decay = 0.0 if spec.fused_backward else 0.01
    settings: dict[str, Any] = {"warmup_steps": 3}
    if spec.low_rank:
        settings["optim_target_modules"] = ["hidden"]
    hf_cls, hf_kwargs, hf_model = hf_choice(
        name, tmp_path, optim_args, learning_rate=0.02, adam_beta1=0.8, adam_beta2=0.99, adam_epsilon=1e-6,
        weight_decay=weight_decay, **settings,
    )  # fmt: skip
    cls, params, kwargs, model = ours(name, parsed, weight_decay, **settings)
    assert cls is hf_cls
    hf_params = hf_kwargs.pop("params", None)
    hf_kwargs.pop("model", None)
    assert kwargs == hf_kwargs
    if spec.low_rank:  # the same weights projected, with the same projection settings
        assert projected_groups(params, model) == projected_groups(hf_params, hf_model) != []
    if spec.fused_backward:
        assert params is model  # LOMO takes the model itself


# -- Trainer.get_optimizer_cls_and_kwargs: HF's static method -----------------------------------------------
#: (name, optim_args) for the static method; one of each resolver family, HF-read optim_args on some
CLS_AND_KWARGS = [
    ("adamw_torch", None), ("adamw_torch_fused", None), ("sgd", "momentum=0.9,nesterov=true"), ("adafactor", None),
    ("adamw_8bit", None), ("paged_lion_32bit", None), ("ademamix", "beta3=0.99,t_alpha=100"),
    ("adamw_torch_4bit", None), ("schedule_free_adamw", None), ("schedule_free_sgd", "r=0.5"), ("grokadamw", None),
    ("stable_adamw", None), ("galore_adamw", "rank=8,scale=0.5"), ("apollo_adamw", None), ("lomo", None),
]  # fmt: skip


def static_settings(name: str) -> dict[str, Any]:
    spec = OPTIMIZERS[name]
    settings: dict[str, Any] = {
        "learning_rate": 0.02, "adam_beta1": 0.8, "adam_beta2": 0.99, "adam_epsilon": 1e-6, "warmup_steps": 3,
        "weight_decay": 0.0 if spec.fused_backward else 0.01, "use_cpu": True, "report_to": "none",
    }  # fmt: skip
    if spec.low_rank:
        settings["optim_target_modules"] = ["hidden"]
    return settings


@pytest.mark.parametrize(("name", "optim_args"), CLS_AND_KWARGS, ids=[n for n, _ in CLS_AND_KWARGS])
def test_get_optimizer_cls_and_kwargs_returns_what_hf_returns(
    name: str, optim_args: str | None, tmp_path: Path
) -> None:
    from transformers import Trainer as HFTrainer
    from transformers import TrainingArguments as HFArguments

    settings = {"optim": name, "optim_args": optim_args, **static_settings(name)}
    model = Net()
    hf_cls, hf_kwargs = HFTrainer.get_optimizer_cls_and_kwargs(HFArguments(str(tmp_path / "hf"), **settings), model)
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(TrainingArguments(str(tmp_path / "ours"), **settings), model)
    assert cls is hf_cls
    assert sorted(kwargs) == sorted(hf_kwargs)
    params, hf_params = kwargs.pop("params", None), hf_kwargs.pop("params", None)
    assert kwargs == hf_kwargs  # values, "model" (LOMO) included: the same model object
    if OPTIMIZERS[name].low_rank:  # the same weights projected with the same settings
        assert projected_groups(params, model) == projected_groups(hf_params, model) != []
    else:
        assert params is None  # the parameters are not part of the kwargs (HF)


def test_get_optimizer_cls_and_kwargs_follows_hfs_calling_convention(tmp_path: Path) -> None:
    # HF's create_optimizer: take "params" / "model" out of the kwargs if there, then cls(params, **kwargs);
    # that builds what create_optimizer builds
    for name in ("sgd", "galore_adamw", "lomo", "galore_adamw_layerwise"):
        model = Net()
        settings = static_settings(name)
        args = TrainingArguments(str(tmp_path), optim=name, **settings)
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        groups = parameter_groups(model, args.weight_decay)
        first = kwargs.pop("params", None) or kwargs.pop("model", None) or groups
        built = cls(first, **kwargs)
        expected = create_optimizer(
            Net(), name, args.learning_rate, args.weight_decay, args.adam_beta1, args.adam_beta2, args.adam_epsilon,
            optim_target_modules=args.optim_target_modules,
        )  # fmt: skip
        assert type(built) is type(expected), name
        assert isinstance(built, LayerwiseOptimizer) == OPTIMIZERS[name].layerwise
        drop = ("params", "warmup_steps")
        assert [{k: v for k, v in g.items() if k not in drop} for g in built.param_groups] == [
            {k: v for k, v in g.items() if k not in drop} for g in expected.param_groups
        ], name
        if isinstance(built, LayerwiseOptimizer):
            built.remove_hooks()
            expected.remove_hooks()  # type: ignore[attr-defined]


def test_get_optimizer_cls_and_kwargs_without_a_model(tmp_path: Path) -> None:
    args = TrainingArguments(str(tmp_path), optim="adamw_torch", learning_rate=0.1)
    assert Trainer.get_optimizer_cls_and_kwargs(args) == (
        torch.optim.AdamW,
        {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8},
    )
    galore = TrainingArguments(str(tmp_path), optim="galore_adamw", optim_target_modules=["hidden"])
    with pytest.raises(ConfigError, match="optim='galore_adamw' needs the model"):
        Trainer.get_optimizer_cls_and_kwargs(galore)


# -- refused before a run ---------------------------------------------------------------------------------
def test_an_unknown_name_fails_when_the_arguments_are_built(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown optimizer 'adamw_troch'; did you mean 'adamw_torch'"):
        TrainingArguments(str(tmp_path), optim="adamw_troch")
    with pytest.raises(ConfigError, match="known optimizers: adamw_torch, adamw_torch_fused, "):
        TrainingArguments(str(tmp_path), optim="adam")


PACKAGED = [n for n, s in OPTIMIZERS.items() if s.module != "torch"]


@pytest.mark.parametrize("name", PACKAGED)
def test_a_missing_package_says_what_to_install(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = OPTIMIZERS[name]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda module, *a: None if module == spec.module else real(module))
    with pytest.raises(ConfigError, match=rf"optim='{name}' needs the package {spec.pip}: {spec.how_to_install()}"):
        arguments(name, tmp_path)


def test_names_whose_package_cannot_be_installed_here_fail_with_the_install_hint(tmp_path: Path) -> None:
    expected = {"adamw_torch_xla": "pip install torch-xla", "adamw_torch_npu_fused": "pip install torch-npu"}
    expected["adamw_anyprecision"] = "build it from https://github.com/pytorch/torchdistx"
    for name, hint in expected.items():
        assert importlib.util.find_spec(OPTIMIZERS[name].module) is None
        with pytest.raises(ConfigError, match=f"optim='{name}' needs the package .*: {hint}"):
            TrainingArguments(str(tmp_path), optim=name)


@pytest.mark.parametrize("name", NEEDS_CUDA)
def test_cuda_only_names_are_refused_without_a_gpu(name: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"optim='{name}' needs a CUDA GPU"):
        arguments(name, tmp_path)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        create_optimizer(Net(), name, optim_target_modules="all-linear")


def test_optim_target_modules(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'galore_adamw' needs optim_target_modules"):
        TrainingArguments(str(tmp_path), optim="galore_adamw")
    with pytest.raises(ConfigError, match="only read by the GaLore and APOLLO optimizers"):
        TrainingArguments(str(tmp_path), optim="adamw_torch", optim_target_modules=["hidden"])
    with pytest.raises(ConfigError, match=r"optim_target_modules must be None, a str or a list of str, got 3"):
        TrainingArguments(str(tmp_path), optim="apollo_adamw", optim_target_modules=3)
    with pytest.raises(ConfigError, match=r"optim_target_modules=\['attn'\] selects no nn.Linear"):
        create_optimizer(Net(), "galore_adamw", optim_target_modules=["attn"])

    def projected(targets: str | list[str]) -> list[str]:
        model = Net()
        optimizer = create_optimizer(model, "galore_adamw", optim_target_modules=targets)
        names = {id(p): n for n, p in model.named_parameters()}
        return sorted(names[id(p)] for g in optimizer.param_groups if "rank" in g for p in g["params"])

    assert projected("all-linear") == ["hidden.weight", "out.weight"]
    assert projected(r"hid.*") == ["hidden.weight"]  # a string is a regex (HF)
    assert projected(["out"]) == ["out.weight"]


def test_settings_the_in_backward_optimizers_cannot_honour(tmp_path: Path) -> None:
    for name in ("lomo", "galore_adamw_layerwise"):
        with pytest.raises(ConfigError, match="cannot accumulate gradients: set gradient_accumulation_steps=1"):
            arguments(name, tmp_path, gradient_accumulation_steps=2)
        with pytest.raises(ConfigError, match="use bf16=True instead of fp16"):
            arguments(name, tmp_path, fp16=True)
    with pytest.raises(ConfigError, match=r"cannot take weight_decay=0\.1 .* LOMO would decay biases and norms too"):
        arguments("lomo", tmp_path, weight_decay=0.1)


# -- the optimizers that need the loop's help --------------------------------------------------------------
def test_schedule_free_trains_in_train_mode_and_evaluates_the_averaged_weights(tmp_path: Path) -> None:
    trainer = trainer_for("schedule_free_adamw", tmp_path, eval_strategy="steps", eval_steps=2, max_steps=3)
    after_steps: list[tuple[torch.Tensor, torch.Tensor]] = []  # each step's train-mode weights y and z
    seen_in_eval: list[torch.Tensor] = []

    def keep_train_weights(event: Any) -> None:
        weight = trainer.model.hidden.weight
        after_steps.append((weight.detach().clone(), event.engine.optimizer.state[weight]["z"].clone()))

    trainer.on(Event.STEP_END, keep_train_weights)
    trainer.model.register_forward_pre_hook(
        lambda module, inputs: None if module.training else seen_in_eval.append(module.hidden.weight.detach().clone())
    )
    trainer.train()  # schedule-free's step raises outside train mode: steps 1-3 all ran in it

    optimizer: Any = trainer.optimizer
    beta1 = optimizer.param_groups[0]["betas"][0]

    def averaged(y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:  # schedule-free: y = (1 - beta1) z + beta1 x
        return (y - (1 - beta1) * z) / beta1

    assert trainer.state.global_step == 3 and len(after_steps) == 3
    assert trainer.state.event_counts["EVAL_START"] == len(seen_in_eval) == 2  # after steps 2 and 3
    # each evaluation saw the averaged weights, not the ones training steps from
    for evaluated, (y, z) in zip(seen_in_eval, after_steps[1:]):
        torch.testing.assert_close(evaluated, averaged(y, z))
        assert not torch.allclose(evaluated, y)
    # training ends on the averaged weights (the model save_model writes)
    assert optimizer.param_groups[0]["train_mode"] is False
    torch.testing.assert_close(trainer.model.hidden.weight.detach(), averaged(*after_steps[2]))


def test_schedule_free_without_its_plugin_cannot_step(tmp_path: Path) -> None:
    trainer = trainer_for("schedule_free_sgd", tmp_path)
    trainer.pop_plugin(ScheduleFreeModes)
    with pytest.raises(Exception, match="not in train mode"):
        trainer.train()


def test_schedule_free_warmup_comes_from_the_arguments(tmp_path: Path) -> None:
    trainer = trainer_for("schedule_free_sgd", tmp_path, max_steps=4, warmup_ratio=0.5)
    assert trainer.create_optimizer().param_groups[0]["warmup_steps"] == 2


def test_lomo_clips_with_its_own_norm_pass(tmp_path: Path) -> None:
    moved = {}
    for label, optim_args in (("free", None), ("clipped", "clip_grad_norm=0.001")):
        trainer = trainer_for("lomo", tmp_path / label, optim_args=optim_args, max_steps=1)
        before = trainer.model.hidden.weight.detach().clone()
        trainer.train()
        moved[label] = float((trainer.model.hidden.weight.detach() - before).norm())
        assert not any("grad_norm" in h for h in trainer.state.log_history)  # no gradients left to clip or log
    assert 0 < moved["clipped"] < moved["free"] / 10


def test_layerwise_steps_every_parameter_in_backward_on_the_schedule(tmp_path: Path) -> None:
    trainer = trainer_for("apollo_adamw_layerwise", tmp_path, lr_scheduler_type="linear", max_steps=4)
    trainer.train()
    optimizer = trainer.optimizer
    assert isinstance(optimizer, LayerwiseOptimizer)
    assert len(optimizer.optimizers) == len(list(trainer.model.parameters()))
    assert all(p.grad is None for p in trainer.model.parameters())
    inner_lrs = {g["lr"] for opt in optimizer.optimizers.values() for g in opt.param_groups}
    assert inner_lrs == {0.0}  # the linear schedule reached its end on every inner optimizer


def test_bitsandbytes_keeps_embeddings_in_32_bits() -> None:
    model = Net(vocab=128)  # 8192 embedding weights: 8-bit unless overridden
    optimizer = create_optimizer(model, "adamw_8bit", lr=0.01)
    model(torch.randint(0, 128, (8, 4)), labels=torch.randn(8))["loss"].backward()
    optimizer.step()
    assert optimizer.state[model.emb.weight]["state1"].dtype == torch.float32
    assert optimizer.state[model.hidden.weight]["state1"].dtype == torch.uint8


RESUMED = ["adamw_torch_8bit", "galore_adamw", "apollo_adamw_layerwise", "grokadamw", "schedule_free_adamw"]


@pytest.mark.parametrize("name", RESUMED)
def test_a_resumed_run_equals_the_uninterrupted_one(name: str, tmp_path: Path) -> None:
    # these keep state that is not a plain tensor: torchao tensor subclasses, GaLore / APOLLO projector
    # objects, layer-wise inner optimizers, GrokAdamW's per-group dict, schedule-free's mode
    settings = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "eval_strategy": "steps", "eval_steps": 2}
    full = trainer_for(name, tmp_path, **settings)
    full.train()
    resumed = trainer_for(name, tmp_path, **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    for (param_name, a), b in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), param_name


def test_a_checkpoint_cannot_name_an_arbitrary_class_for_optimizer_state() -> None:
    model = Net()
    optimizer = create_optimizer(model, "galore_adamw", optim_target_modules=["hidden"], optim_args="rank=4")
    model(torch.randint(0, 10, (8, 4)), labels=torch.randn(8))["loss"].backward()
    optimizer.step()
    state = optimizer.state_dict()
    projector = next(s["projector"] for s in state["state"].values() if "projector" in s)
    assert projector["__state_object__"] == "galore_torch.galore_projector.GaLoreProjector"  # plain values only
    projector["__state_object__"] = "subprocess.Popen"
    with pytest.raises(ValueError, match=r"'subprocess\.Popen', which is not one trainbus rebuilds"):
        optimizer.load_state_dict(state)
