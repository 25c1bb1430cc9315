"""The codec of checkpoint files: a nested value <-> a strict JSON structure + a flat ``{key: tensor}`` dict.

A nested state (an optimizer's ``state_dict()``, the plugins' states, the RNG states) is split
into a JSON structure and a flat ``{key: tensor}`` dict: each tensor is replaced in the JSON by
``{"__tensor__": key}``. Tuples, dicts with non-string keys, non-finite floats, numpy arrays and
torch dtypes are written as small tagged objects, so loading restores the same Python values
without ever running code from a file (K7). ``io.py`` writes the two halves to disk.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from trainbus.engine import ConfigError

try:  # numpy is optional for the codec; torch works without it
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every supported torch
    np = None  # type: ignore[assignment]

__all__ = ["TENSOR_KEY", "join_tensors", "split_tensors"]

_TENSOR, _TUPLE, _DICT, _FLOAT, _NDARRAY, _DTYPE = (
    "__tensor__",
    "__tuple__",
    "__dict__",
    "__float__",
    "__ndarray__",
    "__dtype__",
)
_MARKERS = frozenset({_TENSOR, _TUPLE, _DICT, _FLOAT, _NDARRAY, _DTYPE})
#: in the JSON text of every structure that refers to a tensor (json.dumps escapes none of its characters)
TENSOR_KEY = f'"{_TENSOR}"'.encode()
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
_ALLOWED = "tensors, numbers, strings, None, lists, tuples, dicts, numpy arrays and torch dtypes"
#: values that are JSON as they are: a sequence of only these is copied whole, not walked item by item
#: (an RNG state holds about 1,250 ints; walking them was most of the time a save spent in Python)
_PLAIN = frozenset({int, str, bool, type(None)})
_NESTED = frozenset({dict, list})  # what json.loads builds that _decode has to look into


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
    if isinstance(value, list | tuple):
        if _PLAIN.issuperset(map(type, value)):  # checked in C, not item by item in Python
            items = list(value)
        else:
            items = [_encode(v, f"{path}/{i}", tensors) for i, v in enumerate(value)]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, torch.dtype):
        return {_DTYPE: str(value).removeprefix("torch.")}
    if np is not None and isinstance(value, np.ndarray | np.generic):
        array = np.asarray(value)
        if array.dtype.kind not in "biuf":
            raise ConfigError(
                f"cannot checkpoint a numpy array of dtype {array.dtype} at {path!r}; allowed: {_ALLOWED}"
            )
        data = array.ravel().tolist()
        if array.dtype.kind == "f":  # non-finite values need their tags
            data = [_encode(v, path, tensors) for v in data]
        return {_NDARRAY: {"dtype": array.dtype.str, "shape": list(array.shape), "data": data}}
    raise ConfigError(
        f"cannot checkpoint a value of type {type(value).__name__} at {path!r}: only {_ALLOWED} are saved (no pickle)"
    )


def _decode(value: Any, tensors: Mapping[str, torch.Tensor], where: str) -> Any:
    if isinstance(value, list):
        return _decode_items(value, tensors, where)
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == _TENSOR:
            if inner not in tensors:
                raise ConfigError(f"{where}: refers to tensor {inner!r}, which its .safetensors file lacks")
            return tensors[inner]
        if tag == _TUPLE:
            return tuple(_decode_items(inner, tensors, where))
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
            data = _decode_items(inner["data"], tensors, where)
            array = np.array(data, dtype=np.dtype(inner["dtype"])).reshape(inner["shape"])
            return array[()] if array.ndim == 0 else array
    return {k: _decode(v, tensors, where) if type(v) in _NESTED else v for k, v in value.items()}


def _decode_items(values: list[Any], tensors: Mapping[str, torch.Tensor], where: str) -> list[Any]:
    if _NESTED.isdisjoint(map(type, values)):
        return list(values)  # nothing to decode inside: checked and copied in C
    return [_decode(v, tensors, where) for v in values]
