"""Plugins that prepare the model: gradient checkpointing and torch.compile (both opt-in)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Plugin
from trainbus.engine.errors import ConfigTypeError

if TYPE_CHECKING:
    from trainbus.engine import Engine


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)  # DDP / accelerate wrappers hold the model in .module


class GradientCheckpointing(Plugin):
    """Recompute activations in backward instead of storing them (HF ``gradient_checkpointing``).

    Calls the model's ``activation_checkpointing_enable`` (transformers 5) or
    ``gradient_checkpointing_enable`` (4.x); detaching the plugin disables it again.

    Args:
        gradient_checkpointing_kwargs: passed to ``torch.utils.checkpoint`` (e.g. ``{"use_reentrant": False}``).

    Example:
        >>> from trainbus.engine import Engine
        >>> from transformers import BertConfig, BertModel
        >>> model = BertModel(BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        ...                              intermediate_size=8, vocab_size=20))
        >>> engine = Engine(model, plugins=[GradientCheckpointing()])
        >>> any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
        True
    """

    def __init__(self, gradient_checkpointing_kwargs: Mapping[str, Any] | None = None) -> None:
        if gradient_checkpointing_kwargs is not None and not isinstance(gradient_checkpointing_kwargs, Mapping):
            raise ConfigTypeError(
                "gradient_checkpointing_kwargs must be a dict of torch.utils.checkpoint arguments (e.g. "
                f"{{'use_reentrant': False}}) or None, got {gradient_checkpointing_kwargs!r} "
                f"({type(gradient_checkpointing_kwargs).__name__})"
            )
        self.kwargs = dict(gradient_checkpointing_kwargs or {})

    def attach(self, engine: Engine) -> None:
        model = _unwrap(engine.model)
        # transformers 5 renamed it (the old name warns); 4.x has only gradient_checkpointing_enable
        new_api = getattr(model, "activation_checkpointing_enable", None)
        old_api = getattr(model, "gradient_checkpointing_enable", None)
        if callable(new_api):
            new_api(activation_checkpointing_kwargs=self.kwargs or None)
        elif callable(old_api):
            old_api(gradient_checkpointing_kwargs=self.kwargs or None)
        else:
            raise ConfigError(
                f"gradient checkpointing needs a model with gradient_checkpointing_enable() (Hugging Face models); "
                f"{type(model).__name__} has none: wrap its blocks in torch.utils.checkpoint.checkpoint instead"
            )
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False  # the KV cache is incompatible with checkpointing (HF warns and does this)

    def detach(self, engine: Engine) -> None:
        model = _unwrap(engine.model)
        for name in ("activation_checkpointing_disable", "gradient_checkpointing_disable"):
            disable = getattr(model, name, None)
            if callable(disable):
                disable()
                break
        super().detach(engine)


#: torch.compile's modes in torch 2.13; another mode is looked up in torch's own list
KNOWN_COMPILE_MODES = frozenset({"default", "lite", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"})


class TorchCompile(Plugin):
    """Compile the model with ``torch.compile`` in place (``nn.Module.compile``), opt-in.

    In place, so ``engine.model`` stays the same object and its ``state_dict`` keys do not get the
    ``_orig_mod.`` prefix a compiled wrapper would add: checkpoints stay loadable without it.

    Args:
        **compile_kwargs: passed to ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ``fullgraph``...).

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(2, 1)
        >>> engine = Engine(model, plugins=[TorchCompile(backend="eager")])
        >>> model(torch.ones(1, 2)).shape
        torch.Size([1, 1])
    """

    def __init__(self, **compile_kwargs: Any) -> None:
        check_compile_kwargs(compile_kwargs)
        self.compile_kwargs = compile_kwargs

    def attach(self, engine: Engine) -> None:
        engine.model.compile(**self.compile_kwargs)

    def detach(self, engine: Engine) -> None:
        # undo nn.Module.compile: it only stores the compiled call in this attribute
        engine.model._compiled_call_impl = None
        super().detach(engine)


def check_compile_kwargs(kwargs: Mapping[str, Any]) -> None:
    """torch.compile's keywords (it checked them only when the model was compiled): names, flags, backend, mode."""
    import inspect

    known = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    unknown = sorted(set(kwargs) - set(known))
    if unknown:
        raise ConfigTypeError(f"TorchCompile got {unknown[0]!r}, which torch.compile does not take; it takes {known}")
    for flag in ("fullgraph", "disable"):
        if flag in kwargs and not isinstance(kwargs[flag], bool):
            raise ConfigTypeError(f"{flag} must be True or False, got {kwargs[flag]!r}")
    if kwargs.get("dynamic") is not None and not isinstance(kwargs["dynamic"], bool):
        raise ConfigTypeError(f"dynamic must be True, False or None, got {kwargs['dynamic']!r}")
    backend = kwargs.get("backend")
    if backend is not None and not (isinstance(backend, str) and backend) and not callable(backend):
        raise ConfigTypeError(
            f"backend must be a backend's name (e.g. 'inductor', 'eager') or a callable, got {backend!r}"
        )
    if kwargs.get("options") is not None and not isinstance(kwargs["options"], Mapping):
        raise ConfigTypeError(f"options must be a dict of inductor options or None, got {kwargs['options']!r}")
    check_compile_mode(kwargs.get("mode"))


def check_compile_mode(mode: Any, name: str = "mode") -> None:
    """None or one of torch.compile's modes (torch lists them; it checked them only when the model was compiled)."""
    if mode is None or mode in KNOWN_COMPILE_MODES:
        return
    from torch._inductor import list_mode_options  # seconds to import: only for a mode not known here

    modes = list(list_mode_options())
    if mode not in modes:
        raise ConfigError(f"{name} must be one of torch.compile's modes {modes} or None, got {mode!r}")
