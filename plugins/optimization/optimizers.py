"""Optimizers by Hugging Face name, weight-decay parameter groups, parameter counts.

``create_optimizer(model, "adamw_torch", lr=...)`` builds what ``TrainingArguments(optim=...)`` builds
in HF: two parameter groups (with and without weight decay, biases and normalisation layers never
decay), the class and keyword arguments HF picks for the name (every name of HF's ``OptimizerNames``:
the table is ``optimizer_names.OPTIMIZERS``), extra keyword arguments from ``optim_args``. A user's
own optimizer is a ``torch.optim.Optimizer`` subclass or any ``factory(param_groups, **kwargs)``.
``optimizer_cls_and_kwargs(args, model)`` is HF's ``Trainer.get_optimizer_cls_and_kwargs``: the class
and keyword arguments alone.

``OptimizerSetup`` creates the optimizer when it is attached, so an engine composed of plugins needs
no optimizer argument. The optimizers that need the loop's help have their plugins in
``optimizer_modes`` (schedule-free's train / eval modes, LOMO's fused backward); the layer-wise
optimizer and the state a checkpoint can hold are in ``optimizer_state``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Plugin
from trainbus.engine.errors import ConfigImportError, ConfigNotImplementedError, ConfigTypeError

from .optimizer_checks import check_optimizer_hyperparameters
from .optimizer_names import OPTIMIZER_NAMES, OptimizerRequest, check_optim
from .optimizer_state import LayerwiseOptimizer, keep_state_plain

if TYPE_CHECKING:
    from trainbus.engine import Engine


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


def parameter_groups(
    model: torch.nn.Module, weight_decay: float, decay_names: Iterable[str] | None = None
) -> list[dict[str, Any]]:
    """Two groups of the trainable parameters: decayed ones with ``weight_decay`` first, the rest with 0.

    Both groups are there even when one is empty (a model without biases), as in HF's ``create_optimizer``:
    ``get_optimizer_group()``, ``get_learning_rates()`` and the optimizer's state dict list two groups
    under either. With no trainable parameter at all there are no groups (the optimizer's own error).
    """
    decay = set(get_decay_parameter_names(model) if decay_names is None else decay_names)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        return []
    return [
        {"params": [p for n, p in named if n in decay], "weight_decay": weight_decay},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]


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
    if not isinstance(optim_args, str):
        raise ConfigTypeError(
            f"optim_args must be a 'key=value,key=value' string, a dict or None, got {optim_args!r} "
            f"({type(optim_args).__name__})"
        )
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


def _tensors_on_cuda(groups: list[dict[str, Any]]) -> bool:
    return all(p.device.type == "cuda" for g in groups for p in g["params"])


def _processes() -> int:
    distributed = torch.distributed
    return distributed.get_world_size() if distributed.is_available() and distributed.is_initialized() else 1


def create_optimizer(
    model: torch.nn.Module,
    name: str | OptimizerFactory | None = None,
    lr: float = 5e-5,
    weight_decay: float = 0.0,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_epsilon: float = 1e-8,
    optim_args: str | Mapping[str, Any] | None = None,
    *,
    optim_target_modules: str | list[str] | None = None,
    warmup_steps: int = 0,
) -> torch.optim.Optimizer:
    """Build an optimizer over ``model``'s trainable parameters, grouped for weight decay.

    Args:
        model: the model; parameters with ``requires_grad=False`` are left out.
        name: one of ``OPTIMIZER_NAMES`` (HF's ``optim`` names); an optimizer class or
            ``factory(param_groups, **kwargs)`` for a user's own optimizer; None for
            ``default_optimizer_name(model)``. A name whose package is missing raises ConfigError
            saying what to install; the package is imported only here.
        lr: learning rate. weight_decay: for the decayed group (see ``get_decay_parameter_names``).
        adam_beta1, adam_beta2, adam_epsilon: for the names that take them (as in HF).
        optim_args: extra keyword arguments, as HF's ``"key=value,..."`` string or a dict; the keys
            HF reads for a name (``rank`` for GaLore, ``beta3`` for AdEMAMix, ...) keep HF's meaning.
        optim_target_modules: for GaLore / APOLLO: the ``nn.Linear`` modules to project (names, a
            regex or ``"all-linear"``).
        warmup_steps: for the schedule-free optimizers' own warmup.

    Example:
        >>> import torch
        >>> opt = create_optimizer(torch.nn.Linear(2, 1), "sgd", lr=0.1, weight_decay=0.01,
        ...                        optim_args="momentum=0.9")
        >>> [(g["weight_decay"], g["momentum"]) for g in opt.param_groups]
        [(0.01, 0.9), (0.0, 0.9)]
    """
    _check_hyperparameters(model, lr, weight_decay, adam_beta1, adam_beta2, adam_epsilon)
    groups = parameter_groups(model, weight_decay)
    if not groups:
        raise ConfigError("the model has no trainable parameters (all have requires_grad=False)")
    extra = parse_optim_args(optim_args)
    if name is None:
        name = default_optimizer_name(model)
    if not isinstance(name, str):
        if not callable(name):
            known = ", ".join(OPTIMIZER_NAMES)
            raise ConfigError(f"optimizer must be a name ({known}) or a class/factory, got {name!r}")
        return _instantiate(getattr(name, "__name__", repr(name)), name, groups, {"lr": lr, **extra})
    request = OptimizerRequest(
        name, model, groups, lr, weight_decay, (adam_beta1, adam_beta2), adam_epsilon, extra,
        optim_target_modules, warmup_steps,
    )  # fmt: skip
    return _build_named(request)


def _check_hyperparameters(
    model: Any, lr: float, weight_decay: float, adam_beta1: float, adam_beta2: float, adam_epsilon: float
) -> None:
    """A ConfigError for a model that is not a module or a hyperparameter out of its range."""
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


def _build_named(request: OptimizerRequest) -> torch.optim.Optimizer:
    """The optimizer an ``optim`` name stands for, checked first (package, device, processes)."""
    name, groups = request.name, request.groups
    spec = check_optim(
        name, target_modules=request.target_modules, weight_decay=request.weight_decay,
        has_cuda=_tensors_on_cuda(groups),
    )  # fmt: skip
    if spec.steps_in_backward and _processes() > 1:
        raise ConfigNotImplementedError(  # transformers: NotImplementedError("Layer-wise ... does not support DDP")
            f"optim={name!r} updates the parameters inside backward, which DDP does not support"
        )
    try:
        cls, params, kwargs = spec.resolve(request)
    except ImportError as exc:  # the package is there but one it imports is not
        missing = exc.name or str(exc)
        raise ConfigImportError(f"optim={name!r} needs the package {missing}: pip install {missing}") from exc
    if spec.layerwise:
        return _instantiate(name, partial(LayerwiseOptimizer, cls), params, kwargs)
    optimizer = _instantiate(name, cls, params, kwargs)
    keep_state_plain(optimizer)
    return optimizer


def _instantiate(label: str, factory: Any, params: Any, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    try:
        optimizer: torch.optim.Optimizer = factory(params, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"optimizer {label!r} rejected its arguments {sorted(kwargs)}: {exc}") from exc
    return optimizer


def optimizer_cls_and_kwargs(args: Any, model: torch.nn.Module | None = None) -> tuple[Any, dict[str, Any]]:
    """The optimizer class and keyword arguments for ``args.optim``: HF's ``Trainer.get_optimizer_cls_and_kwargs``.

    ``args`` is a ``TrainingArguments`` (trainbus's or HF's: ``optim``, ``optim_args``, ``learning_rate``,
    ``adam_beta1`` / ``adam_beta2`` / ``adam_epsilon``, ``weight_decay``, ``warmup_steps``,
    ``optim_target_modules`` are read). The keyword arguments are those ``create_optimizer`` passes,
    which are HF's (same defaults, same ``optim_args`` keys). As in HF they hold no parameters, except
    where the optimizer's first argument is not the model's parameter groups: GaLore / APOLLO get
    ``params`` (the groups split into plain and projected weights, so ``model`` is required), LOMO gets
    ``model``. HF's calling convention therefore works: pop ``params`` / ``model`` if present, then
    ``cls(params, **kwargs)``. The layer-wise names return ``partial(LayerwiseOptimizer, inner_class)``,
    which that call builds (HF returns a dummy optimizer and has already hooked the model).
    ``warmup_steps`` (schedule-free) is ``args.warmup_steps`` as it stands, as in HF.

    Example:
        >>> from types import SimpleNamespace
        >>> args = SimpleNamespace(optim="sgd", optim_args="momentum=0.9", learning_rate=0.1, weight_decay=0.0,
        ...                        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, warmup_steps=0,
        ...                        optim_target_modules=None)
        >>> cls, kwargs = optimizer_cls_and_kwargs(args)
        >>> cls.__name__, kwargs
        ('SGD', {'lr': 0.1, 'momentum': 0.9})
    """
    name = str(getattr(args.optim, "value", args.optim))  # HF's arguments hold an OptimizerNames member
    spec = check_optim(name, target_modules=args.optim_target_modules)
    needs_model = spec.low_rank or spec.fused_backward
    if needs_model and model is None:
        raise ConfigError(f"optim={name!r} needs the model: call get_optimizer_cls_and_kwargs(args, model)")
    # only the names whose kwargs carry it see the model: bitsandbytes' resolver would register its
    # embedding overrides, which HF (and create_optimizer) do when building the optimizer, not here
    seen = model if needs_model and model is not None else torch.nn.Module()
    groups = parameter_groups(seen, args.weight_decay)
    request = OptimizerRequest(
        name, seen, groups, args.learning_rate, args.weight_decay, (args.adam_beta1, args.adam_beta2),
        args.adam_epsilon, parse_optim_args(args.optim_args), args.optim_target_modules, args.warmup_steps,
    )  # fmt: skip
    try:
        cls, params, kwargs = spec.resolve(request)
    except ImportError as exc:
        missing = exc.name or str(exc)
        raise ConfigImportError(f"optim={name!r} needs the package {missing}: pip install {missing}") from exc
    if spec.fused_backward:
        kwargs["model"] = params
    elif spec.low_rank:
        kwargs["params"] = params
    return (partial(LayerwiseOptimizer, cls) if spec.layerwise else cls), kwargs


class OptimizerSetup(Plugin):
    """Creates ``engine.optimizer`` from a name when attached (unless the engine already has one).

    A schedule-free name also needs ``ScheduleFreeModes``, a LOMO name ``FusedBackward`` (the
    ``Trainer`` adds both itself).

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
        optim_target_modules: str | list[str] | None = None,
        replace: bool = False,
    ) -> None:
        if name is not None and not isinstance(name, str) and not callable(name):
            raise ConfigTypeError(
                f"OptimizerSetup: name must be an optimizer name (e.g. 'adamw_torch'), a callable that makes the "
                f"optimizer from the parameters, or None; got {name!r} ({type(name).__name__})"
            )
        values = {"lr": lr, "weight_decay": weight_decay, "adam_beta1": adam_beta1, "adam_beta2": adam_beta2}
        check_optimizer_hyperparameters({**values, "adam_epsilon": adam_epsilon}, owner="OptimizerSetup")
        if isinstance(name, str):
            check_optim(name, target_modules=optim_target_modules, weight_decay=weight_decay)
        self.optimizer_name = name
        self.kwargs: dict[str, Any] = {
            "lr": lr,
            "weight_decay": weight_decay,
            "adam_beta1": adam_beta1,
            "adam_beta2": adam_beta2,
            "adam_epsilon": adam_epsilon,
            "optim_args": parse_optim_args(optim_args),
            "optim_target_modules": optim_target_modules,
        }
        self.replace = replace

    def attach(self, engine: Engine) -> None:
        if engine.optimizer is None or self.replace:
            engine.optimizer = create_optimizer(engine.model, self.optimizer_name, **self.kwargs)
