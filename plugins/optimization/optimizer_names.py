"""Every optimizer name of HF's ``TrainingArguments.optim``, mapped to the class that implements it.

``OPTIMIZERS[name]`` is an ``OptimizerSpec``: the module that ships the class (imported only when the
optimizer is built, so naming one costs nothing), what to install, the device it needs, and
``resolve(request) -> (class, params, kwargs)`` with the keyword arguments HF's
``Trainer.get_optimizer_cls_and_kwargs`` passes: the same defaults, the same ``optim_args`` keys.
``check_optim`` validates a choice without importing anything (``importlib.util.find_spec``), so
``TrainingArguments`` rejects an unknown name or a missing package before a run starts.

Where trainbus differs from HF, on purpose:

- every optimizer gets trainbus's weight-decay groups (biases and norms never decay), GaLore and
  APOLLO included (HF builds their groups without ``weight_decay``);
- ``optim_args`` keys a name does not read go to the class as keyword arguments (HF drops them
  for most names), so a misspelt key fails instead of being ignored;
- ``galore_adafactor_layerwise`` gets ``relative_step=False`` like ``galore_adafactor`` (HF's
  layer-wise one fails: its Adafactor refuses a manual learning rate with relative steps);
- LOMO with ``weight_decay > 0`` is refused (LOMO would decay biases and norms too; its own
  ``optim_args="weight_decay=..."`` opts in), as are fp16 and gradient accumulation for the
  optimizers that update inside backward (LOMO, the layer-wise ones): fp16's loss scale would reach
  the update unscaled, and there is no accumulated gradient to step on.

bitsandbytes 0.50 runs its optimizers (8-bit, paged, 32-bit) on CPU as well. Two need a CUDA GPU,
and say so before a run starts: ``galore_adamw_8bit*`` (GaLore's 8-bit step calls
``torch.cuda.synchronize``) and ``adalomo`` (AdaLomo creates its state with ``.cuda()``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trainbus.engine import ConfigError
from trainbus.engine.errors import suggest


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


@dataclass(frozen=True)
class OptimizerSpec:
    """How one ``optim`` name is built, and what it needs."""

    resolve: Resolver
    module: str = "torch"  # top-level module checked with find_spec
    pip: str = ""  # the package that provides ``module``
    install: str = ""  # how to get it, when not ``pip install <pip>``
    device: str | None = None  # a device the optimizer cannot run without
    low_rank: bool = False  # GaLore / APOLLO: projects the weights of optim_target_modules
    layerwise: bool = False  # one optimizer per parameter, stepped inside backward
    fused_backward: bool = False  # LOMO: updates the parameters inside backward

    @property
    def steps_in_backward(self) -> bool:
        """Whether parameters change during backward (no gradients are left for clipping or a step)."""
        return self.layerwise or self.fused_backward

    def how_to_install(self) -> str:
        return self.install or f"pip install {self.pip}"


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
        from bitsandbytes import optim

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


BITSANDBYTES_NAMES = (
    "adamw_bnb_8bit", "adamw_8bit", "paged_adamw_32bit", "paged_adamw_8bit",
    "ademamix", "ademamix_8bit", "paged_ademamix_32bit", "paged_ademamix_8bit",
    "lion_8bit", "lion_32bit", "paged_lion_32bit", "paged_lion_8bit",
    "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit",
)  # fmt: skip
GALORE_NAMES = (
    "galore_adamw", "galore_adamw_8bit", "galore_adafactor",
    "galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "galore_adafactor_layerwise",
)  # fmt: skip


def _bnb_spec(name: str) -> OptimizerSpec:
    kind = next(k for k in ("ademamix", "adamw", "lion", "rmsprop") if k in name)
    bits = 8 if "8bit" in name else 32
    return OptimizerSpec(_bitsandbytes(kind, bits, paged="paged" in name), "bitsandbytes", "bitsandbytes")


def _galore_spec(name: str) -> OptimizerSpec:
    kind = name.removeprefix("galore_").removesuffix("_layerwise")
    return OptimizerSpec(
        _galore(kind),
        "galore_torch",
        "galore-torch",
        device="cuda" if "8bit" in kind else None,
        low_rank=True,
        layerwise=name.endswith("_layerwise"),
    )


#: HF ``OptimizerNames`` (transformers 5) -> how trainbus builds it
OPTIMIZERS: dict[str, OptimizerSpec] = {
    "adamw_torch": OptimizerSpec(_torch("AdamW", adam=True)),
    "adamw_torch_fused": OptimizerSpec(_torch("AdamW", adam=True, fused=True)),
    "adamw_torch_xla": OptimizerSpec(_adamw_xla, "torch_xla", "torch-xla", device="xla"),
    "adamw_torch_npu_fused": OptimizerSpec(_adamw_npu, "torch_npu", "torch-npu", device="npu"),
    "adamw_anyprecision": OptimizerSpec(
        _anyprecision, "torchdistx", "torchdistx", install="build it from https://github.com/pytorch/torchdistx"
    ),
    "adamw_torch_4bit": OptimizerSpec(_torchao(4), "torchao", "torchao"),
    "adamw_torch_8bit": OptimizerSpec(_torchao(8), "torchao", "torchao"),
    "adafactor": OptimizerSpec(_adafactor, "transformers", "transformers"),
    "sgd": OptimizerSpec(_torch("SGD")),
    "adagrad": OptimizerSpec(_torch("Adagrad")),
    "rmsprop": OptimizerSpec(_torch("RMSprop")),
    **{name: _bnb_spec(name) for name in BITSANDBYTES_NAMES},
    **{name: _galore_spec(name) for name in GALORE_NAMES},
    "apollo_adamw": OptimizerSpec(_apollo, "apollo_torch", "apollo-torch", low_rank=True),
    "apollo_adamw_layerwise": OptimizerSpec(_apollo, "apollo_torch", "apollo-torch", low_rank=True, layerwise=True),
    "lomo": OptimizerSpec(_lomo(False), "lomo_optim", "lomo-optim", fused_backward=True),
    "adalomo": OptimizerSpec(_lomo(True), "lomo_optim", "lomo-optim", device="cuda", fused_backward=True),
    "grokadamw": OptimizerSpec(_grokadamw, "grokadamw", "grokadamw"),
    "schedule_free_radam": OptimizerSpec(_schedule_free("radam"), "schedulefree", "schedulefree"),
    "schedule_free_adamw": OptimizerSpec(_schedule_free("adamw"), "schedulefree", "schedulefree"),
    "schedule_free_sgd": OptimizerSpec(_schedule_free("sgd"), "schedulefree", "schedulefree"),
    "stable_adamw": OptimizerSpec(_stable_adamw, "optimi", "torch-optimi"),
}

#: the names ``create_optimizer`` and ``TrainingArguments.optim`` accept
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZERS)


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec of ``name``; an unknown name raises ConfigError with the closest names."""
    spec = OPTIMIZERS.get(name)
    if spec is None:
        known = ", ".join(OPTIMIZER_NAMES)
        raise ConfigError(f"unknown optimizer {name!r}{suggest(name, OPTIMIZER_NAMES)}; known optimizers: {known}")
    return spec


def check_optim(
    name: str,
    *,
    target_modules: str | list[str] | None = None,
    gradient_accumulation_steps: int = 1,
    fp16: bool = False,
    weight_decay: float = 0.0,
    has_cuda: bool | None = None,
) -> OptimizerSpec:
    """Validate an optimizer choice without importing its package; returns its spec.

    Raises ConfigError for an unknown name, a missing package (with what to install), a missing
    or stray ``optim_target_modules``, and settings the optimizer cannot honour. ``has_cuda=False``
    rejects optimizers that need a CUDA GPU; None skips that check.
    """
    spec = optimizer_spec(name)
    if spec.module != "torch" and importlib.util.find_spec(spec.module) is None:
        raise ConfigError(f"optim={name!r} needs the package {spec.pip}: {spec.how_to_install()}")
    if spec.device == "cuda" and has_cuda is False:
        raise ConfigError(f"optim={name!r} needs a CUDA GPU ({spec.pip} runs it on torch.cuda); this run has none")
    if spec.low_rank:
        if target_modules is None:
            raise ConfigError(
                f"optim={name!r} needs optim_target_modules, the layers it projects: module names, a regex, "
                "or 'all-linear'"
            )
        valid = isinstance(target_modules, str) or (
            isinstance(target_modules, list) and all(isinstance(t, str) for t in target_modules)
        )
        if not valid:
            raise ConfigError(
                "optim_target_modules must be a string (a regex or 'all-linear') or a list of strings, "
                f"got {target_modules!r}"
            )
    elif target_modules is not None:
        raise ConfigError(
            f"optim_target_modules={target_modules!r} is only read by the GaLore and APOLLO optimizers "
            f"(galore_*, apollo_*), not by optim={name!r}; leave it None"
        )
    if spec.steps_in_backward:
        if gradient_accumulation_steps != 1:
            raise ConfigError(
                f"optim={name!r} updates the parameters inside backward, so it cannot accumulate gradients: "
                f"set gradient_accumulation_steps=1 (got {gradient_accumulation_steps})"
            )
        if fp16:
            raise ConfigError(
                f"optim={name!r} updates the parameters inside backward, before fp16's loss scale could be "
                "removed: use bf16=True instead of fp16"
            )
    if spec.fused_backward and weight_decay:
        raise ConfigError(
            f"optim={name!r} cannot take weight_decay={weight_decay!r} from TrainingArguments: LOMO would decay "
            "biases and norms too. Set weight_decay=0, and optim_args='weight_decay=...' to decay every parameter"
        )
    return spec
