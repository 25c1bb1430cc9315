"""``save_model``: the final model folder users load (K6): ``save_pretrained`` for HF models, else safetensors + JSON.

``io.load_model_weights`` reads it back.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from . import io as cio


def save_model(
    model: torch.nn.Module,
    output_dir: str | Path,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    model_class: type | None = None,
) -> Path:
    """Save a model users can load (K6): ``save_pretrained`` for HF models, else safetensors + JSON.

    A plain module gets ``model.safetensors`` and ``trainbus_model.json`` (its class and
    parameter count); load it with ``load_model_weights(model, output_dir)``. ``state_dict`` gives
    the tensors when the model's own are shards (a gathered FSDP / ZeRO model), ``model_class`` the
    class to record when the model's type is a wrapper's.
    """
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    save_pretrained = getattr(model, "save_pretrained", None)
    if callable(save_pretrained):
        kwargs: dict[str, Any] = (
            {"safe_serialization": True}
            if "safe_serialization" in inspect.signature(save_pretrained).parameters
            else {}
        )
        if state_dict is not None:
            kwargs["state_dict"] = state_dict
        save_pretrained(str(root), **kwargs)
        return root
    if state_dict is None:
        cio.save_weights(model, root / "model.safetensors")
    else:
        cio.write_tensors(root / "model.safetensors", state_dict)
    kind = model_class or type(model)
    cio.write_json(
        root / "trainbus_model.json",
        {
            "format": "trainbus-model",
            "class": f"{kind.__module__}.{kind.__qualname__}",
            "weights": "model.safetensors",
            "num_parameters": sum(p.numel() for p in model.parameters()),
        },
    )
    cio.sync_files(root, ["model.safetensors", "trainbus_model.json"])
    return root
