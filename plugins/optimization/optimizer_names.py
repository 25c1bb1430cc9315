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
import sys
from dataclasses import dataclass

from trainbus.engine import ConfigError
from trainbus.engine.errors import ConfigImportError, ConfigTypeError, suggest

from .optimizer_resolvers import OptimizerRequest as OptimizerRequest  # re-exported: callers build requests
from .optimizer_resolvers import (
    Resolver,
    _adafactor,
    _adamw_npu,
    _adamw_xla,
    _anyprecision,
    _apollo,
    _bitsandbytes,
    _galore,
    _grokadamw,
    _lomo,
    _schedule_free,
    _stable_adamw,
    _torch,
    _torchao,
)


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


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported: one already in ``sys.modules`` is (a test may put a stand-in there, which
    has no ``__spec__``), one set to None there is not (Python refuses that import); else ``find_spec`` finds it."""
    if module in sys.modules and sys.modules[module] is None:
        return False
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # in sys.modules without a __spec__: a stand-in, importable
        return True


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
    if spec.module != "torch" and not _installed(spec.module):
        raise ConfigImportError(f"optim={name!r} needs the package {spec.pip}: {spec.how_to_install()}")
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
        if not valid:  # a TypeError, as in transformers
            raise ConfigTypeError(
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
