"""Host copies of a checkpoint's tensors, taken on the training thread for a background write.

An asynchronous save (``Checkpointing(save_async=True)``) must not write tensors that training goes on
updating in place, so the step that saves copies them first: into host buffers kept between saves
(allocated once, at the first save, and again only when a tensor's shape or dtype changes), page-locked
(pinned) for tensors on a GPU, where the copy is enqueued on the current stream without waiting
(``non_blocking``): the step goes on while the device copies, and the writer thread waits for the
copies to land (``HostBuffers.ready``) before it writes. Later kernels of the stream run after the copies,
so the buffers hold the values of the saving step. On the CPU the copy is a memcpy.

Each buffer is a contiguous tensor that owns its whole storage, which ``io._for_safetensors`` then
writes as it is (no second copy). The buffers are reused only once the write that read them has
finished: the Checkpointing plugin allows one write in flight, and the next save waits for it first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["HostBuffers"]


class HostBuffers:
    """Reusable host memory for the tensors of one checkpoint, by key."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._events: list[Any] = []  # one CUDA event per device copied from, recorded after its copies

    @property
    def nbytes(self) -> int:
        """The bytes the buffers hold (host memory kept between saves)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def take(self, prefix: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of ``tensors`` (same keys), into the buffers kept under ``prefix/key``."""
        out: dict[str, torch.Tensor] = {}
        devices: set[torch.device] = set()
        for key, tensor in tensors.items():
            source = tensor.detach()
            out[key] = self._copy(f"{prefix}/{key}", source)
            if source.device.type == "cuda":
                devices.add(source.device)
        for device in devices:  # the writer waits on these before reading the buffers
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._events.append(event)
        return out

    def _copy(self, key: str, source: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            pinned = source.device.type == "cuda"  # page-locked: the device copies into it asynchronously
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pinned)
            self._buffers[key] = buffer
        buffer.copy_(source, non_blocking=source.device.type == "cuda")
        return buffer

    def reserve(self, plan: list[tuple[str, torch.Size, torch.dtype, bool]]) -> None:
        """Allocate and touch the buffers a save will use (``planned``), so that the first save only copies: run in a
        thread while training goes on (allocation and page faults release the GIL), done before that save."""
        for key, shape, dtype, pinned in plan:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.shape != shape or buffer.dtype != dtype:
                buffer = torch.empty(shape, dtype=dtype, device="cpu", pin_memory=pinned)
                buffer.zero_()  # the pages are faulted in here, not in the saving step's copy
                self._buffers[key] = buffer

    @staticmethod
    def planned(prefix: str, tensors: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Size, torch.dtype, bool]]:
        """The buffers ``take(prefix, tensors)`` would use: keys, shapes, dtypes, pinned (no tensor kept)."""
        return [(f"{prefix}/{key}", t.shape, t.dtype, t.device.type == "cuda") for key, t in tensors.items()]

    def ready(self) -> None:
        """Wait until every copy enqueued since the last call has landed (the writer thread calls it)."""
        events, self._events = self._events, []
        for event in events:
            event.synchronize()

    def clear(self) -> None:
        """Release the host memory (the end of a run: the next run allocates again at its first save)."""
        self._buffers.clear()
        self._events.clear()
