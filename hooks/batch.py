"""Moving batches to a device and reading their parts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def to_device(batch: Any, device: torch.device | None) -> Any:
    """Move every tensor in a nested dict / list / tuple batch to ``device``.

    Non-blocking copies are safe here: the next use of the tensor is on the same stream.
    """
    if device is None:
        return batch
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if type(batch) is tuple or type(batch) is list:  # the common case first: no ABC checks
        return type(batch)([to_device(v, device) for v in batch])
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device) for k, v in batch.items()}
        return moved if type(batch) is dict else type(batch)(moved)  # type: ignore[call-arg]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def get_labels(batch: Any, label_names: tuple[str, ...] = ("labels",)) -> Any:
    """The labels of a batch: ``batch[name]`` for dict batches, the last element of a tuple/list.

    Returns None when the batch carries no labels; with several label names, a tuple.
    """
    if type(batch) is tuple or type(batch) is list:
        return batch[-1] if len(batch) >= 2 else None
    if isinstance(batch, Mapping):
        found = [batch[name] for name in label_names if name in batch]
        if not found:
            return None
        return found[0] if len(found) == 1 else tuple(found)
    if isinstance(batch, list | tuple) and len(batch) >= 2:
        return batch[-1]
    return None


def batch_size_of(batch: Any) -> int:
    """Number of samples in a batch: the first dimension of its first tensor (0 when none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        for value in batch.values():
            n = batch_size_of(value)
            if n:
                return n
        return 0
    if isinstance(batch, list | tuple):
        for value in batch:
            n = batch_size_of(value)
            if n:
                return n
    return 0
