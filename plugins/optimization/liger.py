"""Liger Kernel's Triton kernels patched into a transformers model (HF ``use_liger_kernel``).

liger-kernel runs on CUDA GPUs through Triton; both are checked when the plugin (or
``TrainingArguments(use_liger_kernel=True)``) is made, so a run that cannot use the kernels fails
before it starts instead of training without them.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Plugin

if TYPE_CHECKING:
    from trainbus.engine import Engine


def check_liger_kernel(config: Any = None) -> None:
    """Raise ``ConfigError`` unless liger-kernel and a CUDA GPU are present and ``config`` is a dict of options."""
    if config is not None and (not isinstance(config, Mapping) or not all(isinstance(k, str) for k in config)):
        raise ConfigError(
            "liger_kernel_config must be None or a dict of liger-kernel options (e.g. {'rope': True, "
            f"'cross_entropy': False}}), got {config!r:.80}"
        )
    missing = []
    if importlib.util.find_spec("liger_kernel") is None:
        missing.append("the liger-kernel package is not installed (pip install liger-kernel)")
    if not torch.cuda.is_available():
        missing.append("this machine has no CUDA GPU")
    if missing:
        raise ConfigError(
            f"use_liger_kernel=True needs liger-kernel and a CUDA GPU, but {' and '.join(missing)}; "
            "set use_liger_kernel=False"
        )


class LigerKernel(Plugin):
    """Patch a transformers model with liger-kernel's fused kernels when attached (HF ``use_liger_kernel``).

    Calls ``liger_kernel.transformers._apply_liger_kernel_to_instance`` as transformers' own
    integration does: it picks ``apply_liger_kernel_to_<model_type>`` (Llama, Mistral, Gemma, Qwen...)
    for the model. A peft model is patched through its base model.

    Args:
        config: keyword options of the kernels (``rope``, ``swiglu``, ``cross_entropy``,
            ``fused_linear_cross_entropy``, ``rms_norm``); None for liger-kernel's defaults.
    """

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        check_liger_kernel(config)
        self.config = dict(config or {})

    def attach(self, engine: Engine) -> None:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
        from transformers import PreTrainedModel

        model = engine.model
        get_base_model = getattr(model, "get_base_model", None)
        base = get_base_model() if callable(get_base_model) else model
        if not isinstance(base, PreTrainedModel):
            raise ConfigError(
                f"use_liger_kernel patches transformers models (PreTrainedModel); got {type(base).__name__}"
            )
        _apply_liger_kernel_to_instance(model=base, **self.config)


__all__ = ["LigerKernel", "check_liger_kernel"]
