"""What a checkpoint of an adapter model holds: the weights that train, a fingerprint of the frozen base, peft's folder.

An adapter model (a peft / LoRA model, or a transformers model with a peft adapter loaded) changes
only its adapters. Its checkpoints store every adapter (the inactive ones too) and every buffer, plus
a fingerprint (sha256 over the names, dtypes, shapes and bytes of the frozen base's parameters), so a
checkpoint of a large base is as small as its adapter and its optimizer state, and a resume onto
another base fails before training instead of silently mixing weights. Any other model with frozen
parameters (wav2vec2 with its feature encoder frozen) is saved whole, as transformers saves it:
its checkpoint is a model folder ``from_pretrained`` loads with no missing key.

Next to them an adapter checkpoint is the folder transformers' Trainer writes with the model's own
``save_pretrained``: ``adapter_config.json``, ``adapter_model.safetensors`` and peft's ``README.md``
(each adapter not named ``default`` in a folder of its name, which the manifest, naming plain files
only, does not list), loaded by ``PeftModel.from_pretrained(base, checkpoint)``; and no
``config.json``, with which ``AutoModel...from_pretrained(checkpoint)`` would build the base model
and find none of its weights (random weights, only a load report saying so). The resume reads
``model.safetensors``, by the model's own names.

The fingerprint is computed once per run and cached per model while the frozen tensors are
unchanged (their storage and torch's version counter), so saving costs no pass over the base.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
import weakref
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import ConfigError

#: files of a full model folder that an adapter checkpoint must not hold (they would load a random base)
BASE_MODEL_FILES = frozenset({"config.json", "generation_config.json"})
_CACHE: weakref.WeakKeyDictionary[torch.nn.Module, tuple[Any, dict[str, Any]]] = weakref.WeakKeyDictionary()


def frozen_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base: parameters with ``requires_grad=False`` by name (tied ones once), an adapter's own
    excepted; empty when all train or none do.

    peft freezes the adapters not active (``set_adapter``): they are trained in turn (``AdapterSwitch``),
    so they are saved, and the base fingerprint does not depend on which one is active. peft keys
    every adapter's tensors by the adapter's name (``lora_A.<name>.weight``, ``modules_to_save.<name>``).
    """
    named = dict(model.named_parameters())
    frozen = {name: p for name, p in named.items() if not p.requires_grad}
    if len(frozen) == len(named):
        return {}  # nothing trains (an evaluation-only save): keep whole-model checkpoints
    adapter = adapter_model(model)
    adapters = set(getattr(adapter, "peft_config", None) or ()) if adapter is not None else set()
    return {name: p for name, p in frozen.items() if not adapters.intersection(name.split("."))}


def adapter_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The peft model under DDP / compile wrappers (or a transformers model with a peft adapter loaded), else None.

    These are the models transformers' Trainer saves adapter-only (``save_pretrained`` writes the
    adapters); peft is not imported for a model that cannot be one of its.
    """
    for _ in range(8):  # through DDP's .module and torch.compile's ._orig_mod
        inner = getattr(model, "module", None)
        inner = inner if isinstance(inner, torch.nn.Module) else getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            break
        model = inner
    peft = sys.modules.get("peft")
    kinds = tuple(k for k in (getattr(peft, "PeftModel", None), getattr(peft, "PeftMixedModel", None)) if k)
    if (kinds and isinstance(model, kinds)) or getattr(model, "_hf_peft_config_loaded", False) is True:
        return model
    return None


def write_adapter_folder(model: torch.nn.Module, directory: Path) -> None:
    """The adapter model's own ``save_pretrained`` into ``directory`` (peft's folder), as safetensors."""
    save = getattr(model, "save_pretrained", None)
    if not callable(save):
        raise ConfigError(f"{type(model).__name__} has no save_pretrained: an adapter checkpoint cannot be written")
    kwargs: dict[str, Any] = {}
    if "safe_serialization" in inspect.signature(save).parameters:
        kwargs["safe_serialization"] = True  # no pickle (peft's default too)
    save(str(directory), **kwargs)


def checkpoint_fingerprint(model: torch.nn.Module) -> dict[str, Any] | None:
    """The frozen base's fingerprint when a checkpoint of ``model`` stores only what trains (an adapter model
    with frozen parameters), else None: the checkpoint holds every weight."""
    return base_fingerprint(model) if adapter_model(model) is not None else None


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


__all__ = [
    "BASE_MODEL_FILES",
    "adapter_model",
    "base_fingerprint",
    "check_base",
    "checkpoint_fingerprint",
    "frozen_parameters",
    "frozen_state_keys",
    "trainable_state_dict",
    "write_adapter_folder",
]
