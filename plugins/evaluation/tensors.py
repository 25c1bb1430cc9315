"""Tensor plumbing for evaluation: nested structures, -100 padding, gathering across processes.

Predictions arrive per batch as a tensor or a nested tuple / list / dict of tensors whose
dimensions after the first may differ between batches (sequence lengths). These helpers pad
them with ``padding_index`` (-100, the value HF losses ignore) and concatenate along the batch
dimension; under ``torch.distributed`` they gather through accelerate and drop the samples a
``DistributedSampler`` repeated to make the shards equal.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainbus.engine import ConfigError

from ..distributed.processes import world_size

Nested = Any  # a tensor / array, or a tuple, list or dict of Nested


def nested_map(fn: Callable[[Any], Any], data: Nested) -> Nested:
    """Apply ``fn`` to every leaf (tensor / array / scalar) of a nested tuple / list / dict."""
    if isinstance(data, Mapping):
        return type(data)({k: nested_map(fn, v) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(nested_map(fn, v) for v in data))
    if isinstance(data, list | tuple):
        return type(data)(nested_map(fn, v) for v in data)
    return fn(data)


def _zip_map(fn: Callable[[list[Any]], Any], items: Sequence[Nested]) -> Nested:
    """Apply ``fn`` to the list of corresponding leaves of structurally equal nested items."""
    first = items[0]
    if isinstance(first, Mapping):
        return type(first)({k: _zip_map(fn, [item[k] for item in items]) for k in first})  # type: ignore[call-arg]
    if isinstance(first, list | tuple):
        lengths = {len(item) for item in items}
        if len(lengths) != 1:
            raise ValueError(f"cannot concatenate nested outputs of different lengths {sorted(lengths)}")
        parts = [_zip_map(fn, [item[i] for item in items]) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    return fn(list(items))


def pad_concat(tensors: Sequence[torch.Tensor], padding_index: int = -100) -> torch.Tensor:
    """Concatenate along dim 0, padding every later dimension to the largest size with ``padding_index``.

    0-dim tensors count as one sample. All tensors must have the same number of dimensions.
    """
    tensors = [t.reshape(1) if t.dim() == 0 else t for t in tensors]
    ndims = {t.dim() for t in tensors}
    if len(ndims) != 1:
        raise ValueError(f"cannot concatenate predictions with different numbers of dimensions {sorted(ndims)}")
    trailing = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    if all(list(t.shape[1:]) == trailing for t in tensors):
        return torch.cat(tensors, dim=0)
    out = tensors[0].new_full((sum(t.shape[0] for t in tensors), *trailing), padding_index)
    row = 0
    for t in tensors:
        index = (slice(row, row + t.shape[0]), *(slice(0, s) for s in t.shape[1:]))
        out[index] = t
        row += t.shape[0]
    return out


def nested_pad_concat(chunks: Sequence[Nested], padding_index: int = -100) -> Nested:
    """``pad_concat`` over a list of structurally equal nested outputs (one per batch)."""
    if not chunks:
        return None
    return _zip_map(lambda leaves: pad_concat(leaves, padding_index), chunks)


def nested_concat(a: Nested, b: Nested, padding_index: int = -100) -> Nested:
    """HF's ``nested_concat``: concatenate two nested outputs, padding ragged dimensions.

    ``None`` on either side returns the other; numpy arrays are accepted and stay numpy.
    """
    if a is None:
        return b
    if b is None:
        return a

    def cat(leaves: list[Any]) -> Any:
        if isinstance(leaves[0], np.ndarray):
            joined = pad_concat([torch.from_numpy(np.ascontiguousarray(x)) for x in leaves], padding_index)
            return joined.numpy()
        return pad_concat(leaves, padding_index)

    return _zip_map(cat, [a, b])


def to_numpy(data: Nested) -> Nested:
    """Leaves to numpy on the host; bf16 / fp16 become float32 (numpy has no bfloat16)."""

    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            x = x.detach()
            if x.dtype in (torch.bfloat16, torch.float16):
                x = x.float()
            return x.cpu().numpy()
        return x

    return nested_map(convert, data)


def to_host(data: Nested) -> Nested:
    """Leaves to CPU tensors (what ``eval_accumulation_steps`` does every n batches)."""
    return nested_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, data)


def select_rows(data: Nested, index: torch.Tensor | slice) -> Nested:
    """Rows ``index`` of every leaf (tensors and numpy arrays)."""

    def pick(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return x[index.numpy() if isinstance(index, torch.Tensor) else index]
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x[index.to(x.device) if isinstance(index, torch.Tensor) else index]
        return x

    return nested_map(pick, data)


# -- distributed ---------------------------------------------------------------------------------
def gather_padded(data: Nested, padding_index: int = -100) -> Nested:
    """Gather a nested batch output from every process (rank-major), padding every dim to the longest first.

    Uses accelerate's ``pad_across_processes`` and ``gather``, which need accelerate's
    ``PartialState`` to see the same processes as ``torch.distributed``.
    """
    from accelerate import PartialState
    from accelerate.utils import gather, pad_across_processes

    if PartialState().num_processes != world_size():
        raise ConfigError(
            f"torch.distributed has {world_size()} processes but accelerate's PartialState sees "
            f"{PartialState().num_processes}: launch with `accelerate launch` / torchrun, or create "
            "accelerate.PartialState(cpu=True) on CPU, so evaluation can gather predictions"
        )

    def pad_all_dims(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        x = x.reshape(1) if x.dim() == 0 else x.contiguous()
        for dim in range(x.dim()):  # dim 0 too: processes may have trimmed padding samples
            x = pad_across_processes(x, dim=dim, pad_index=padding_index)
        return x

    return gather(nested_map(pad_all_dims, data))


@dataclass(frozen=True)
class ShardLayout:
    """Where each process's samples sit in a ``DistributedSampler``'s padded order.

    The sampler pads the (possibly shuffled) index list to ``num_replicas * ceil(n / num_replicas)``
    by repeating its head, then gives process ``r`` the positions ``r, r + R, r + 2R, ...``. So the
    local sample ``p`` of process ``r`` is global position ``p * R + r``, and positions ``>= n`` are
    the repeated padding: dropping them and sorting by position gives the single-process order.
    """

    num_replicas: int
    rank: int
    dataset_size: int

    @classmethod
    def of(cls, dataloader: Any) -> ShardLayout | None:
        """The layout of a DataLoader whose sampler is a DistributedSampler-like one, else None."""
        if world_size() <= 1:
            return None
        sampler = getattr(dataloader, "sampler", None)
        replicas, rank = getattr(sampler, "num_replicas", None), getattr(sampler, "rank", None)
        dataset = getattr(dataloader, "dataset", None)
        if not isinstance(replicas, int) or not isinstance(rank, int) or dataset is None:
            return None
        try:
            size = len(dataset)
        except TypeError:
            return None
        return cls(replicas, rank, size)

    def real_count(self, offset: int, batch_size: int, rank: int | None = None) -> int:
        """How many of the local samples ``offset .. offset + batch_size - 1`` of ``rank`` are not padding.

        Real samples come first (padding only ends the shard), so they are the batch's first rows.
        """
        rank = self.rank if rank is None else rank
        limit = math.ceil((self.dataset_size - rank) / self.num_replicas)  # local positions < limit are real
        return max(0, min(batch_size, limit - offset))

    def gathered_positions(self, offset: int, batch_size: int) -> torch.Tensor:
        """Global positions of the rows of a batch gathered rank-major after trimming and dim-0 padding.

        Every process trimmed its batch (same offset and size on all of them) to its real rows and
        the gather padded them to the longest; padding rows get position ``dataset_size`` (dropped).
        """
        counts = [self.real_count(offset, batch_size, r) for r in range(self.num_replicas)]
        longest = max(counts)
        rows = []
        for rank, count in enumerate(counts):
            real = (torch.arange(offset, offset + count, dtype=torch.long) * self.num_replicas) + rank
            rows.append(torch.cat([real, torch.full((longest - count,), self.dataset_size, dtype=torch.long)]))
        return torch.cat(rows)
