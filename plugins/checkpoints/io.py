"""Checkpoint files without pickle: tensors in safetensors, everything else in strict JSON.

A nested state (an optimizer's ``state_dict()``, the plugins' states, the RNG states) is split
into a JSON structure and a flat ``{key: tensor}`` dict: each tensor is replaced in the JSON by
``{"__tensor__": key}``. Tuples, dicts with non-string keys, non-finite floats, numpy arrays and
torch dtypes are written as small tagged objects, so loading restores the same Python values
without ever running code from a file (K7). Every file of a checkpoint is listed with its size
and sha256 in ``manifest.json``, written last: a directory without a valid manifest is not a
checkpoint (K3).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import random
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch as st
import torch

from trainbus.engine import ConfigError

try:  # numpy is optional for the codec; torch works without it
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every supported torch
    np = None  # type: ignore[assignment]

MANIFEST = "manifest.json"
FORMAT = "trainbus-checkpoint"
VERSION = 1

_TENSOR, _TUPLE, _DICT, _FLOAT, _NDARRAY, _DTYPE = (
    "__tensor__",
    "__tuple__",
    "__dict__",
    "__float__",
    "__ndarray__",
    "__dtype__",
)
_MARKERS = frozenset({_TENSOR, _TUPLE, _DICT, _FLOAT, _NDARRAY, _DTYPE})
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_ALLOWED = "tensors, numbers, strings, None, lists, tuples, dicts, numpy arrays and torch dtypes"


# -- codec: nested values <-> (JSON, tensors) -----------------------------------------------------
def split_tensors(value: Any, root: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """Return ``(json_value, tensors)``: the value with each tensor replaced by a reference.

    Raises ConfigError naming the path of a value that is neither JSON nor a tensor.
    """
    tensors: dict[str, torch.Tensor] = {}
    return _encode(value, root, tensors), tensors


def join_tensors(value: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    """Inverse of ``split_tensors``; ``where`` names the file in error messages."""
    return _decode(value, tensors, where)


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        key = path or "."
        while key in tensors:  # distinct paths cannot collide, but a key may contain '/'
            key += "'"
        tensors[key] = value
        return {_TENSOR: key}
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {_FLOAT: "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not _MARKERS.intersection(value):
            return {k: _encode(v, f"{path}/{k}", tensors) for k, v in value.items()}
        # int keys (optimizer state), or keys that look like our tags: keep them as pairs
        return {_DICT: [[_encode(k, f"{path}/#{i}", tensors), _encode(v, f"{path}/{k}", tensors)]
                        for i, (k, v) in enumerate(value.items())]}  # fmt: skip
    if isinstance(value, list):
        return [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).removeprefix("torch.")}
    if np is not None and isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise ConfigError(
                f"cannot checkpoint a numpy array of dtype {array.dtype} at {path!r}; allowed: {_ALLOWED}"
            )
        data = [_encode(v, path, tensors) for v in array.ravel().tolist()]
        return {_NDARRAY: {"dtype": array.dtype.str, "shape": list(array.shape), "data": data}}
    raise ConfigError(
        f"cannot checkpoint a value of type {type(value).__name__} at {path!r}: only {_ALLOWED} are saved (no pickle)"
    )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, where) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == _TENSOR:
            if inner not in tensors:
                raise ConfigError(f"{where}: refers to tensor {inner!r}, which its .safetensors file lacks")
            return tensors[inner]
        if tag == _TUPLE:
            return tuple(_decode(v, tensors, where) for v in inner)
        if tag == _DICT:
            return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in inner}
        if tag == _FLOAT:
            return _NONFINITE[inner]
        if tag == _DTYPE:
            dtype = getattr(torch, inner, None)
            if not isinstance(dtype, torch.dtype):
                raise ConfigError(f"{where}: unknown torch dtype {inner!r}")
            return dtype
        if tag == _NDARRAY:
            if np is None:  # pragma: no cover
                raise ConfigError(f"{where}: holds a numpy array but numpy is not installed")
            data = [_decode(v, tensors, where) for v in inner["data"]]
            array = np.array(data, dtype=np.dtype(inner["dtype"])).reshape(inner["shape"])
            return array[()] if array.ndim == 0 else array
    return {k: _decode(v, tensors, where) for k, v in value.items()}


# -- files ----------------------------------------------------------------------------------------
def fsync_path(path: Path) -> None:
    """Flush a file (or a directory entry list) to disk, so a rename after it is durable."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) if path.is_dir() else os.O_RDONLY
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories; the data files are synced
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def write_json(path: Path, value: Any) -> None:
    """Write strict JSON (NaN is an error: the codec tags non-finite floats) and fsync it."""
    write_text(path, json.dumps(value, indent=1, sort_keys=True, allow_nan=False))


def write_text(path: Path, text: str) -> None:
    """Write a text file and fsync it."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write tensors to a safetensors file and fsync it."""
    st.save_file(_for_safetensors(tensors), str(path))
    fsync_path(path)


def _for_safetensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous tensors that each own their whole storage, as safetensors requires.

    Only views and tensors sharing storage with an earlier one are copied: optimizer states
    are large, and most of their tensors can be written as they are.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, tensor in tensors.items():
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        whole = t.is_contiguous() and t.data_ptr() == ptr and t.numel() * t.element_size() == storage.nbytes()
        if not whole or (ptr != 0 and ptr in seen):
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(t.untyped_storage().data_ptr())
        out[key] = t
    return out


def read_json(path: Path) -> Any:
    """Parse a JSON file; a missing or corrupt file raises ConfigError naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ConfigError(f"checkpoint file {path} is missing") from exc
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"checkpoint file {path} is not valid JSON: {exc}") from exc


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Load a safetensors file on the CPU; a missing or corrupt file raises ConfigError naming it."""
    try:
        return st.load_file(str(path), device="cpu")
    except FileNotFoundError as exc:
        raise ConfigError(f"checkpoint file {path} is missing") from exc
    except (OSError, safetensors.SafetensorError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"checkpoint file {path} is not a valid safetensors file: {exc}") from exc


def write_bundle(directory: Path, stem: str, value: Any) -> list[str]:
    """Write ``value`` as ``stem.json`` + ``stem.safetensors``; returns the file names."""
    structure, tensors = split_tensors(value, stem)
    write_tensors(directory / f"{stem}.safetensors", tensors)
    write_json(directory / f"{stem}.json", {"format": FORMAT, "data": structure})
    return [f"{stem}.safetensors", f"{stem}.json"]


def read_bundle(directory: Path, stem: str) -> Any:
    """Read what ``write_bundle`` wrote."""
    path = directory / f"{stem}.json"
    doc = read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "data" not in doc:
        raise ConfigError(f"checkpoint file {path} is not a {FORMAT} file (no 'format'/'data' keys)")
    return join_tensors(doc["data"], read_tensors(directory / f"{stem}.safetensors"), str(path))


# -- manifest -------------------------------------------------------------------------------------
def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path, files: Iterable[str], info: Mapping[str, Any]) -> None:
    """Write ``manifest.json`` listing ``files`` with size and sha256; call it after every other file."""
    entries = {
        name: {"size": (directory / name).stat().st_size, "sha256": sha256_of(directory / name)} for name in files
    }
    write_json(directory / MANIFEST, {"format": FORMAT, "version": VERSION, **info, "files": entries})


def read_manifest(directory: Path, *, verify: bool = True) -> dict[str, Any]:
    """The manifest of a complete checkpoint; with ``verify`` every listed file's size and sha256.

    Raises ConfigError naming the file that is missing, truncated or altered.
    """
    path = directory / MANIFEST
    manifest = read_json(path)
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        raise ConfigError(f"{path} is not a {FORMAT} manifest")
    if manifest.get("version") != VERSION:
        raise ConfigError(f"{path} has format version {manifest.get('version')!r}; this trainbus reads {VERSION}")
    if verify:
        for name, entry in manifest["files"].items():
            file = directory / name
            if not file.is_file():
                raise ConfigError(f"checkpoint file {file} listed in {path} is missing")
            size = file.stat().st_size
            if size != entry.get("size"):
                raise ConfigError(f"checkpoint file {file} has {size} bytes, the manifest says {entry.get('size')}")
            if sha256_of(file) != entry.get("sha256"):
                raise ConfigError(f"checkpoint file {file} does not match its sha256 in {path} (corrupt or altered)")
    return manifest


def is_complete(directory: Path) -> bool:
    """Cheap completeness test (a readable manifest); ``read_manifest`` verifies the contents."""
    try:
        read_manifest(directory, verify=False)
    except ConfigError:
        return False
    return True


# -- model weights --------------------------------------------------------------------------------
def save_weights(model: torch.nn.Module, path: Path) -> None:
    """Write the model's state dict to safetensors; tied weights are stored once (as HF does)."""
    st.save_model(model, str(path), force_contiguous=True)
    fsync_path(path)


def load_weights(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str, may_lack: Iterable[str] = ()
) -> None:
    """Copy ``state`` into ``model``; keys missing only because they are tied to a loaded one are fine.

    ``may_lack`` names keys a checkpoint leaves out on purpose (a verified frozen base's parameters).
    Raises ConfigError naming ``where`` on unexpected or missing keys or shape mismatches.
    """
    may_lack = set(may_lack)
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ConfigError(f"{where} has weights the model lacks: {unexpected[:10]}")
    loaded_ptrs = {(own[k].device, own[k].data_ptr()) for k in state if own[k].data_ptr() != 0}
    missing = [
        k for k in own if k not in state and k not in may_lack and (own[k].device, own[k].data_ptr()) not in loaded_ptrs
    ]
    if missing:
        raise ConfigError(f"{where} lacks weights of the model: {missing[:10]}")
    try:
        model.load_state_dict(dict(state), strict=False)
    except RuntimeError as exc:
        raise ConfigError(f"{where} does not fit the model: {exc}") from exc


# -- RNG ------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """The states of Python's ``random``, numpy's global generator, torch CPU and CUDA generators."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` returned (CUDA states only when CUDA is available)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda"]))
        else:
            warnings.warn("the checkpoint holds CUDA RNG states but CUDA is not available; not restored", stacklevel=2)


# -- final model ----------------------------------------------------------------------------------
def save_model(model: torch.nn.Module, output_dir: str | Path) -> Path:
    """Save a model users can load (K6): ``save_pretrained`` for HF models, else safetensors + JSON.

    A plain module gets ``model.safetensors`` and ``trainbus_model.json`` (its class and
    parameter count); load it with ``load_model_weights(model, output_dir)``.
    """
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    save_pretrained = getattr(model, "save_pretrained", None)
    if callable(save_pretrained):
        kwargs = (
            {"safe_serialization": True}
            if "safe_serialization" in inspect.signature(save_pretrained).parameters
            else {}
        )
        save_pretrained(str(root), **kwargs)
        return root
    save_weights(model, root / "model.safetensors")
    kind = type(model)
    write_json(
        root / "trainbus_model.json",
        {
            "format": "trainbus-model",
            "class": f"{kind.__module__}.{kind.__qualname__}",
            "weights": "model.safetensors",
            "num_parameters": sum(p.numel() for p in model.parameters()),
        },
    )
    return root


def load_model_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Load weights saved by ``save_model`` or a checkpoint (safetensors only, also HF shards)."""
    root = Path(directory)
    single = root / "model.safetensors"
    index = root / "model.safetensors.index.json"
    if single.is_file():
        load_weights(model, read_tensors(single), str(single))
        return
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index} has no 'weight_map' object")
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(weight_map.values())):
            state.update(read_tensors(root / shard))
        load_weights(model, state, str(index))
        return
    seen = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    raise ConfigError(f"no model.safetensors or model.safetensors.index.json in {root}; found: {seen or 'nothing'}")
