"""Optimizers by Hugging Face name, weight-decay parameter groups, parameter counts.

``create_optimizer(model, "adamw_torch", lr=...)`` builds what ``TrainingArguments(optim=...)`` builds
in HF: two parameter groups (with and without weight decay, biases and normalisation layers never
decay), Adam betas/epsilon from the arguments, extra keyword arguments from ``optim_args``. A user's
own optimizer is a ``torch.optim.Optimizer`` subclass or any ``factory(param_groups, **kwargs)``.

The ``OptimizerSetup`` plugin creates the optimizer when it is attached, so an engine composed of
plugins needs no optimizer argument.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Plugin
from trainbus.engine.errors import suggest

if TYPE_CHECKING:
    from trainbus.engine import Engine

#: the optimizer names ``create_optimizer`` knows, as ``TrainingArguments.optim`` spells them
OPTIMIZER_NAMES: tuple[str, ...] = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "adafactor", "rmsprop")

#: layers whose parameters never get weight decay (HF forbids LayerNorm by type; we add torch's other norms)
NORM_LAYER_TYPES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.LayerNorm,
    torch.nn.RMSNorm,
    torch.nn.GroupNorm,
    torch.nn.LocalResponseNorm,
    torch.nn.modules.batchnorm._NormBase,  # BatchNorm*d, SyncBatchNorm, InstanceNorm*d
)

#: parameter-name patterns that never get weight decay (the same as HF ``Trainer.get_decay_parameter_names``)
NO_DECAY_NAME_PATTERNS: tuple[str, ...] = (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")

OptimizerFactory = Callable[..., torch.optim.Optimizer]


def _parameter_names(
    module: torch.nn.Module, forbidden_types: tuple[type[torch.nn.Module], ...], patterns: list[re.Pattern[str]]
) -> list[str]:
    # recursive like HF's get_parameter_names: a forbidden layer hides every parameter below it
    names: list[str] = []
    for child_name, child in module.named_children():
        if isinstance(child, forbidden_types):
            continue
        for sub in _parameter_names(child, forbidden_types, patterns):
            full = f"{child_name}.{sub}"
            if not any(p.search(full.lower()) for p in patterns):
                names.append(full)
    names += [k for k in module._parameters if not any(p.search(k.lower()) for p in patterns)]
    return names


def get_decay_parameter_names(model: torch.nn.Module) -> list[str]:
    """Names of the parameters that get weight decay: all but biases and normalisation layers.

    Same rules as HF ``Trainer.get_decay_parameter_names`` (names containing ``bias``, ``layernorm``,
    ``rmsnorm``, ``norm`` as a path component or ``_norm``; parameters of ``nn.LayerNorm``), and
    parameters of torch's other normalisation layers (RMSNorm, GroupNorm, BatchNorm, InstanceNorm).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
        >>> get_decay_parameter_names(model)
        ['0.weight']
    """
    patterns = [re.compile(p) for p in NO_DECAY_NAME_PATTERNS]
    return _parameter_names(model, NORM_LAYER_TYPES, patterns)


def count_parameters(model: torch.nn.Module, trainable_only: bool = False) -> int:
    """Number of parameters (shared ones counted once), optionally only those with ``requires_grad``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def count_trainable_parameters(model: torch.nn.Module) -> int:
    """Number of parameters with ``requires_grad`` (HF logs it as "Number of trainable parameters")."""
    return count_parameters(model, trainable_only=True)


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups of the trainable parameters: decayed ones with ``weight_decay``, the rest with 0.

    Empty groups are left out (torch optimizers accept them, but they clutter state dicts).
    """
    decay = set(get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _parse_value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_optim_args(optim_args: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """``"momentum=0.9,nesterov=true"`` (HF's ``optim_args`` string) or a dict -> keyword arguments."""
    if optim_args is None or optim_args == "":
        return {}
    if isinstance(optim_args, Mapping):
        return dict(optim_args)
    parsed: dict[str, Any] = {}
    for item in optim_args.replace(" ", "").split(","):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"optim_args must look like 'key=value,key=value', got {optim_args!r}")
        parsed[key] = _parse_value(value)
    return parsed


def fused_adamw_supported(model: torch.nn.Module) -> bool:
    """Whether torch's fused AdamW kernels support every trainable parameter's device and dtype."""
    from torch.optim import optimizer as torch_optimizer

    # private, but it is the list torch itself checks before accepting fused=True
    devices = set(torch_optimizer._get_fused_kernels_supported_devices())  # type: ignore[attr-defined]
    return all(
        p.device.type in devices
        and p.is_floating_point()
        and p.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
        for p in model.parameters()
        if p.requires_grad
    )


def default_optimizer_name(model: torch.nn.Module) -> str:
    """``adamw_torch_fused`` where the fused kernels support the model, else ``adamw_torch``."""
    return "adamw_torch_fused" if fused_adamw_supported(model) else "adamw_torch"


def _optimizer_class(name: str, adam_kwargs: dict[str, Any]) -> tuple[OptimizerFactory, dict[str, Any]]:
    if name == "adamw_torch":
        return torch.optim.AdamW, dict(adam_kwargs)
    if name == "adamw_torch_fused":
        return torch.optim.AdamW, {**adam_kwargs, "fused": True}
    if name == "sgd":
        return torch.optim.SGD, {}
    if name == "adagrad":
        return torch.optim.Adagrad, {}
    if name == "adafactor":
        return torch.optim.Adafactor, {}
    if name == "rmsprop":
        return torch.optim.RMSprop, {}
    raise ConfigError(
        f"unknown optimizer {name!r}{suggest(name, OPTIMIZER_NAMES)}; known optimizers: {', '.join(OPTIMIZER_NAMES)}"
    )


def create_optimizer(
    model: torch.nn.Module,
    name: str | OptimizerFactory | None = None,
    lr: float = 5e-5,
    weight_decay: float = 0.0,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_epsilon: float = 1e-8,
    optim_args: str | Mapping[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """Build an optimizer over ``model``'s trainable parameters, grouped for weight decay.

    Args:
        model: the model; parameters with ``requires_grad=False`` are left out.
        name: one of ``OPTIMIZER_NAMES``; an optimizer class or ``factory(param_groups, **kwargs)``
            for a user's own optimizer; None for ``default_optimizer_name(model)``.
        lr: learning rate. weight_decay: for the decayed group (see ``get_decay_parameter_names``).
        adam_beta1, adam_beta2, adam_epsilon: for the AdamW names only.
        optim_args: extra keyword arguments, as HF's ``"key=value,..."`` string or a dict.

    Example:
        >>> import torch
        >>> opt = create_optimizer(torch.nn.Linear(2, 1), "sgd", lr=0.1, weight_decay=0.01,
        ...                        optim_args="momentum=0.9")
        >>> [(g["weight_decay"], g["momentum"]) for g in opt.param_groups]
        [(0.01, 0.9), (0.0, 0.9)]
    """
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not (lr >= 0):
        raise ConfigError(f"lr must be >= 0, got {lr!r}")
    if not (weight_decay >= 0):
        raise ConfigError(f"weight_decay must be >= 0, got {weight_decay!r}")
    for label, beta in (("adam_beta1", adam_beta1), ("adam_beta2", adam_beta2)):
        if not 0 <= beta < 1:
            raise ConfigError(f"{label} must be in [0, 1), got {beta!r}")
    if not (adam_epsilon >= 0):
        raise ConfigError(f"adam_epsilon must be >= 0, got {adam_epsilon!r}")
    groups = parameter_groups(model, weight_decay)
    if not groups:
        raise ConfigError("the model has no trainable parameters (all have requires_grad=False)")
    extra = parse_optim_args(optim_args)
    if name is None:
        name = default_optimizer_name(model)
    if isinstance(name, str):
        factory, kwargs = _optimizer_class(name, {"betas": (adam_beta1, adam_beta2), "eps": adam_epsilon})
    elif callable(name):
        factory, kwargs = name, {}
    else:
        raise ConfigError(f"optimizer must be a name ({', '.join(OPTIMIZER_NAMES)}) or a class/factory, got {name!r}")
    kwargs.update(extra)
    try:
        return factory(groups, lr=lr, **kwargs)
    except TypeError as exc:
        label = name if isinstance(name, str) else getattr(name, "__name__", repr(name))
        raise ConfigError(f"optimizer {label!r} rejected its arguments {sorted(kwargs)}: {exc}") from exc


class OptimizerSetup(Plugin):
    """Creates ``engine.optimizer`` from a name when attached (unless the engine already has one).

    Args:
        name: see ``create_optimizer``; the other arguments are passed to it.
        replace: build a new optimizer even when the engine was given one.

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> engine = Engine(torch.nn.Linear(2, 1), plugins=[OptimizerSetup("sgd", lr=0.1)])
        >>> type(engine.optimizer).__name__
        'SGD'
    """

    def __init__(
        self,
        name: str | OptimizerFactory | None = None,
        *,
        lr: float = 5e-5,
        weight_decay: float = 0.0,
        adam_beta1: float = 0.9,
        adam_beta2: float = 0.999,
        adam_epsilon: float = 1e-8,
        optim_args: str | Mapping[str, Any] | None = None,
        replace: bool = False,
    ) -> None:
        if isinstance(name, str) and name not in OPTIMIZER_NAMES:
            _optimizer_class(name, {})  # raises the error listing the names
        self.optimizer_name = name
        self.kwargs: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "adam_beta1": adam_beta1,
            "adam_beta2": adam_beta2,
            "adam_epsilon": adam_epsilon,
            "optim_args": parse_optim_args(optim_args),
        }
        self.replace = replace

    def attach(self, engine: Engine) -> None:
        if engine.optimizer is None or self.replace:
            engine.optimizer = create_optimizer(engine.model, self.optimizer_name, **self.kwargs)
