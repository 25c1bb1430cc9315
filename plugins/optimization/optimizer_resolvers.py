"""How each ``optim`` name is built: the resolvers behind ``optimizer_names.OPTIMIZERS``.

A resolver reads an ``OptimizerRequest`` (the model, its weight-decay groups, the hyperparameters,
the parsed ``optim_args``) and returns ``(class, params, kwargs)`` with the keyword arguments HF's
``Trainer.get_optimizer_cls_and_kwargs`` passes. Third-party modules are imported only when a
resolver runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainbus.engine import ConfigError
from trainbus.engine.errors import ConfigImportError


@dataclass
class OptimizerRequest:
    """What a resolver reads: the model, its weight-decay groups, the hyperparameters."""

    name: str
    model: torch.nn.Module
    groups: list[dict[str, Any]]
    lr: float
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    #: parsed ``optim_args``; a resolver pops the keys it reads and passes the rest to the class
    optim_args: dict[str, Any] = field(default_factory=dict)
    target_modules: str | list[str] | None = None
    warmup_steps: int = 0

    @property
    def adam(self) -> dict[str, Any]:
        return {"betas": self.betas, "eps": self.eps}


#: ``(optimizer class, its first argument: param groups or, for LOMO, the model, keyword arguments)``
Resolved = tuple[Any, Any, dict[str, Any]]
Resolver = Callable[[OptimizerRequest], Resolved]


def _call(cls: Any, req: OptimizerRequest, **kwargs: Any) -> Resolved:
    return cls, req.groups, {"lr": req.lr, **kwargs, **req.optim_args}


# -- torch and transformers --------------------------------------------------------------------------
def _torch(class_name: str, *, adam: bool = False, **fixed: Any) -> Resolver:
    def resolve(req: OptimizerRequest) -> Resolved:
        return _call(getattr(torch.optim, class_name), req, **(req.adam if adam else {}), **fixed)

    return resolve


def _adafactor(req: OptimizerRequest) -> Resolved:
    from transformers.optimization import Adafactor

    return _call(Adafactor, req, scale_parameter=False, relative_step=False)


def _adamw_xla(req: OptimizerRequest) -> Resolved:
    from torch_xla.amp.syncfree import AdamW

    return _call(AdamW, req, **req.adam)


def _adamw_npu(req: OptimizerRequest) -> Resolved:
    from torch_npu.optim import NpuFusedAdamW

    return _call(NpuFusedAdamW, req, **req.adam)


def _anyprecision(req: OptimizerRequest) -> Resolved:
    from torchdistx.optimizers import AnyPrecisionAdamW

    args = req.optim_args
    dtypes = {"momentum_dtype": "float32", "variance_dtype": "float32", "compensation_buffer_dtype": "bfloat16"}
    kwargs: dict[str, Any] = {"use_kahan_summation": bool(args.pop("use_kahan_summation", False))}
    for key, default in dtypes.items():
        kwargs[key] = getattr(torch, str(args.pop(key, default)))
    return _call(AnyPrecisionAdamW, req, **req.adam, **kwargs)


def _torchao(bits: int) -> Resolver:
    def resolve(req: OptimizerRequest) -> Resolved:
        try:
            from torchao.optim import AdamW4bit, AdamW8bit
        except ImportError:  # torchao < 0.11 kept them in the prototype namespace
            from torchao.prototype.low_bit_optim import AdamW4bit, AdamW8bit

        args = req.optim_args
        rounding = bool(args.pop("bf16_stochastic_round", False))
        return _call(
            AdamW4bit if bits == 4 else AdamW8bit,
            req,
            block_size=args.pop("block_size", 256),
            bf16_stochastic_round=rounding,
            **req.adam,
        )

    return resolve


# -- bitsandbytes ------------------------------------------------------------------------------------
def _bitsandbytes(kind: str, bits: int, paged: bool = False) -> Resolver:
    def resolve(req: OptimizerRequest) -> Resolved:
        # the submodule by its full name, as transformers imports it. When it cannot be imported the error is
        # an ImportError and a ValueError: transformers raises the one or the other, depending on the release
        try:
            optim = importlib.import_module("bitsandbytes.optim")
        except ImportError as exc:
            raise ConfigImportError(
                f"optim {kind!r} ({bits}-bit) needs bitsandbytes.optim, which cannot be imported: {exc}"
            ) from exc

        args = req.optim_args
        cls: Any
        kwargs: dict[str, Any]
        if kind == "adamw":
            cls, kwargs = optim.AdamW, dict(req.adam)
        elif kind == "lion":
            cls, kwargs = optim.Lion, {"betas": req.betas}
        elif kind == "rmsprop":
            cls, kwargs = optim.RMSprop, {}
        else:
            cls = optim.AdEMAMix
            b1, b2 = req.betas
            kwargs = {
                "betas": (float(args.pop("beta1", b1)), float(args.pop("beta2", b2)), float(args.pop("beta3", 0.9999))),
                "alpha": float(args.pop("alpha", 5.0)),
                "eps": float(args.pop("eps", req.eps)),
            }
            for key in ("t_alpha", "t_beta3"):
                if key in args:
                    kwargs[key] = int(args.pop(key))
        kwargs["optim_bits"] = bits
        if kind != "rmsprop":
            kwargs["is_paged"] = paged
        if bits == 8:
            _embeddings_in_32bit(req.model)
        return _call(cls, req, **kwargs)

    return resolve


def _embeddings_in_32bit(model: torch.nn.Module) -> None:
    # as HF: 8-bit state for embeddings hurts stability, so bitsandbytes keeps theirs in 32 bits
    # (read when the optimizer first steps, so registering before it is built is the same)
    from bitsandbytes.optim import GlobalOptimManager

    manager = GlobalOptimManager.get_instance()
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})


# -- low-rank projections: GaLore, APOLLO ------------------------------------------------------------
def target_weight_names(model: torch.nn.Module, targets: str | list[str], name: str) -> set[str]:
    """Names of the ``nn.Linear`` weights ``optim_target_modules`` selects (HF's rules, 'all-linear' too)."""
    from transformers.trainer_utils import check_target_module_exists

    all_linear = isinstance(targets, str) and targets.replace("_", "-") == "all-linear"
    found = {
        f"{module_name}.weight"
        for module_name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and (all_linear or check_target_module_exists(targets, module_name))
    }
    if not found:
        raise ConfigError(f"optim={name!r}: optim_target_modules={targets!r} selects no nn.Linear module of the model")
    return found


def _low_rank_groups(req: OptimizerRequest, projection: dict[str, Any]) -> list[dict[str, Any]]:
    assert req.target_modules is not None  # check_optim requires it
    names = target_weight_names(req.model, req.target_modules, req.name)
    targets = {id(p) for n, p in req.model.named_parameters() if n in names}
    groups = []
    for group in req.groups:  # each weight-decay group splits into plain and projected parameters
        plain = [p for p in group["params"] if id(p) not in targets]
        projected = [p for p in group["params"] if id(p) in targets]
        if plain:
            groups.append({**group, "params": plain})
        if projected:
            groups.append({**group, "params": projected, **projection})
    return groups


def _galore(kind: str) -> Resolver:
    def resolve(req: OptimizerRequest) -> Resolved:
        import galore_torch

        args = req.optim_args
        projection = {
            "rank": int(args.pop("rank", 128)),
            "update_proj_gap": int(args.pop("update_proj_gap", 200)),
            "scale": float(args.pop("scale", 0.25)),
            "proj_type": str(args.pop("proj_type", "std")),
        }
        classes = {
            "adamw": galore_torch.GaLoreAdamW,
            "adamw_8bit": galore_torch.GaLoreAdamW8bit,
            "adafactor": galore_torch.GaLoreAdafactor,
        }
        extra = {"scale_parameter": False, "relative_step": False} if kind == "adafactor" else {}
        return classes[kind], _low_rank_groups(req, projection), {"lr": req.lr, **extra, **args}

    return resolve


def _apollo(req: OptimizerRequest) -> Resolved:
    from apollo_torch import APOLLOAdamW

    args = req.optim_args
    projection = {
        "rank": int(args.pop("rank", 128)),
        "proj": str(args.pop("proj", "random")),
        "scale_type": str(args.pop("scale_type", "channel")),
        "update_proj_gap": int(args.pop("update_proj_gap", 200)),
        "scale": float(args.pop("scale", 1.0)),
        "proj_type": str(args.pop("proj_type", "std")),
        **req.adam,  # HF gives the Adam arguments to the projected group only
    }
    return APOLLOAdamW, _low_rank_groups(req, projection), {"lr": req.lr, **args}


# -- the rest --------------------------------------------------------------------------------------
def _lomo(adaptive: bool) -> Resolver:
    def resolve(req: OptimizerRequest) -> Resolved:
        from lomo_optim import AdaLomo, Lomo

        return (AdaLomo if adaptive else Lomo), req.model, {"lr": req.lr, **req.optim_args}

    return resolve


def _grokadamw(req: OptimizerRequest) -> Resolved:
    from grokadamw import GrokAdamW

    defaults = {"alpha_init": 0.98, "lamb": 2.0, "gamma": 0.1, "grokking_signal_decay_rate": 0.1}
    return _call(GrokAdamW, req, **defaults, gradient_clipping=1.0)


def _schedule_free(kind: str) -> Resolver:
    def resolve(req: OptimizerRequest) -> Resolved:
        import schedulefree

        kwargs: dict[str, Any] = dict(req.adam) if kind != "sgd" else {}
        kwargs["weight_decay"] = req.weight_decay
        if kind != "radam":  # RAdam warms up by itself
            kwargs["warmup_steps"] = req.warmup_steps
        kwargs.update(weight_lr_power=2.0, r=0.0)
        if kind == "radam" and not hasattr(schedulefree, "RAdamScheduleFree"):
            raise ConfigError("optim='schedule_free_radam' needs schedulefree>=1.4.0: pip install -U schedulefree")
        classes = {"radam": "RAdamScheduleFree", "adamw": "AdamWScheduleFree", "sgd": "SGDScheduleFree"}
        return _call(getattr(schedulefree, classes[kind]), req, **kwargs)

    return resolve


def _stable_adamw(req: OptimizerRequest) -> Resolved:
    from optimi import StableAdamW

    defaults = {"decouple_lr": False, "max_lr": None, "kahan_sum": None}
    return _call(StableAdamW, req, **req.adam, weight_decay=req.weight_decay, **defaults)
