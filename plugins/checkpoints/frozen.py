"""What a checkpoint of a partly frozen model holds: the weights that train, and a fingerprint of the rest.

A model with frozen parameters (a peft / LoRA model's base, a frozen encoder) changes only where
``requires_grad`` is set. Its checkpoints store the trainable parameters and every buffer, plus a
fingerprint (sha256 over the names, dtypes, shapes and bytes of the frozen parameters), so a
checkpoint of a large base is as small as its adapter and its optimizer state, and a resume onto
another base fails before training instead of silently mixing weights.

The fingerprint is computed once per run and cached per model while the frozen tensors are
unchanged (their storage and torch's version counter), so saving costs no pass over the base.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import torch

from trainbus.engine import ConfigError

_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, dict[str, Any]]] = weakref.WeakKeyDictionary()


def frozen_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters with ``requires_grad=False`` by name (tied ones once); empty when all train or none do."""
    named = dict(model.named_parameters())
    frozen = {name: p for name, p in named.items() if not p.requires_grad}
    if len(frozen) == len(named):
        return {}  # nothing trains (an evaluation-only save): keep whole-model checkpoints
    return frozen


def base_fingerprint(model: torch.nn.Module) -> dict[str, Any] | None:
    """sha256 over the frozen parameters (names, dtypes, shapes, bytes), or None when nothing is frozen."""
    frozen = frozen_parameters(model)
    if not frozen:
        return None
    key = tuple((name, t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for name, t in sorted(frozen.items()))
    cached = _CACHE.get(model)
    if cached is not None and cached[0] == key:
        return dict(cached[1])
    digest = hashlib.sha256()
    elements = 0
    for name, tensor in sorted(frozen.items()):
        data = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{data.dtype}|{tuple(data.shape)}|".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().data)  # the tensor's own bytes, not a copy
        elements += data.numel()
    fingerprint = {"algorithm": "sha256", "parameters": len(frozen), "elements": elements, "digest": digest.hexdigest()}
    _CACHE[model] = (key, fingerprint)
    return dict(fingerprint)


def frozen_state_keys(model: torch.nn.Module) -> set[str]:
    """The ``state_dict`` keys of frozen parameters, tied names included (an LM head tied to a frozen embedding)."""
    frozen = {(t.device, t.data_ptr()) for t in frozen_parameters(model).values()}
    return {k for k, v in model.state_dict(keep_vars=True).items() if (v.device, v.data_ptr()) in frozen}


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` without the frozen parameters: what a checkpoint of it stores."""
    skip = frozen_state_keys(model)
    return {k: v for k, v in model.state_dict().items() if k not in skip}


def check_base(model: torch.nn.Module, recorded: dict[str, Any] | None, where: str) -> set[str]:
    """The frozen parameter names a checkpoint may lack, after checking its recorded base fingerprint."""
    if recorded is None:
        return set()
    current = base_fingerprint(model)
    if current is None:
        raise ConfigError(
            f"{where} holds only the trainable weights of a model with a frozen base ({recorded['parameters']} frozen "
            "parameters), but this model freezes none: build it the same way (e.g. the same peft config) to resume"
        )
    if current["digest"] != recorded.get("digest"):
        raise ConfigError(
            f"{where} was trained on another frozen base: its fingerprint is {recorded.get('digest', '?')[:16]}... "
            f"({recorded.get('parameters')} tensors, {recorded.get('elements')} values), this model's is "
            f"{current['digest'][:16]}... ({current['parameters']} tensors, {current['elements']} values); load the "
            "same base weights before resuming"
        )
    return frozen_state_keys(model)


__all__ = ["base_fingerprint", "check_base", "frozen_parameters", "frozen_state_keys", "trainable_state_dict"]
