"""A model's weights in checkpoints and model folders: save and load them, and the final model folder.

``save_weights`` / ``load_weights`` write and check a model's safetensors file; ``save_model`` /
``load_model_weights`` are the final model (``save_pretrained`` for HF models, else safetensors +
JSON). ``io.py`` re-exports them; the file writers they use are io's, looked up when called.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import safetensors.torch as st
import torch

from trainbus.engine import ConfigError

from .safety import plain_name


def save_weights(model: torch.nn.Module, path: Path) -> dict[str, Any]:
    """Write the model's state dict to safetensors (tied weights once, as HF does); returns its manifest entry."""
    from . import io as cio  # at call time: io.py re-exports this module's functions

    st.save_model(model, str(path), metadata={"format": "pt"}, force_contiguous=True)  # see write_tensors
    return cio._written(path)


def load_weights(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str, may_lack: Iterable[str] = ()
) -> None:
    """Copy ``state`` into ``model``; keys missing only because they are tied to a loaded one are fine.

    ``may_lack`` names keys a checkpoint leaves out on purpose (a verified frozen base's parameters).
    Raises ConfigError naming ``where`` on unexpected or missing keys or shape mismatches.
    """
    own = model.state_dict(keep_vars=True)  # names and storages: no detached copies needed
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ConfigError(f"{where} has weights the model lacks: {unexpected[:10]}")
    if len(state) < len(own):  # some not loaded: each must be tied to a loaded one, or may be lacking
        may_lack = set(may_lack)
        loaded_ptrs = {(own[k].device, own[k].data_ptr()) for k in state if own[k].data_ptr() != 0}
        missing = [
            k
            for k in own
            if k not in state and k not in may_lack and (own[k].device, own[k].data_ptr()) not in loaded_ptrs
        ]
        if missing:
            raise ConfigError(f"{where} lacks weights of the model: {missing[:10]}")
    misfits = [k for k, t in state.items() if own[k].shape != t.shape]
    if misfits:  # refused before anything is copied (load_state_dict copies the fitting ones, then raises)
        shapes = [(k, tuple(state[k].shape), tuple(own[k].shape)) for k in misfits[:5]]
        raise ConfigError(f"{where} does not fit the model: (name, saved shape, model shape) {shapes}")
    try:
        model.load_state_dict(dict(state), strict=False)
    except RuntimeError as exc:
        raise ConfigError(f"{where} does not fit the model: {exc}") from exc


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
    from . import io as cio  # at call time: io.py re-exports this module's functions

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
        save_weights(model, root / "model.safetensors")
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


def load_model_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Load weights saved by ``save_model`` or a checkpoint (safetensors only, also HF shards)."""
    from . import io as cio  # at call time: io.py re-exports this module's functions

    root = Path(directory)
    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if single.is_file() or single.is_symlink():  # a link is refused by read_tensors, not skipped
        load_weights(model, cio.read_tensors(single), str(single))
        return
    if index.is_file() or index.is_symlink():
        document = cio.read_json(index)
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index} has no 'weight_map' object")
        state: dict[str, torch.Tensor] = {}
        for shard in sorted({plain_name(name, index) for name in weight_map.values()}):  # no path out of root
            state.update(cio.read_tensors(root / shard))
        load_weights(model, state, str(index))
        return
    seen = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    raise ConfigError(f"no model.safetensors or model.safetensors.index.json in {root}; found: {seen or 'nothing'}")
