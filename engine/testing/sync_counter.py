"""Counting host syncs (part of the testing kit, re-exported by ``trainbus.engine.testing``).

A host sync is a device-to-host read, a pageable host-to-device copy or an explicit synchronize;
reading a CPU tensor is none. ``on_device=everything_but(batches)`` is the CPU proxy of a GPU run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def on_accelerator(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor`` syncs the host: it lives on an accelerator (not the CPU)."""
    return tensor.device.type != "cpu"


def everything_but(host: Any) -> Callable[[torch.Tensor], bool]:
    """The CPU proxy of a GPU run: every tensor counts as a device tensor except those in ``host``.

    ``host`` is what the data loader yields (nested batches): on a GPU those stay on the host until
    ``to_device`` moves them, so reading them costs nothing, while everything computed from the model,
    the loss or the parameters lives on the device. Tensors are matched by their storage.
    """
    storages: set[int] = set()

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            storages.add(value.untyped_storage().data_ptr())
        elif isinstance(value, dict):
            for item in value.values():
                collect(item)
        elif isinstance(value, list | tuple):
            for item in value:
                collect(item)

    collect(host)
    return lambda tensor: tensor.untyped_storage().data_ptr() not in storages


class SyncCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts host syncs: reads of a device tensor's value into Python, and device-to-host copies.

    A host sync is a device-to-host read (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``,
    ``.numpy()``, ``.cpu()`` of a GPU tensor), a host-to-device copy from pageable memory, or an
    explicit synchronize: the host waits for the device. Reading a CPU tensor's value is not a sync,
    so by default only tensors on an accelerator count (``on_accelerator``): the aten ops behind
    ``.item()`` / ``float`` / ``bool`` (``_local_scalar_dense``, ``is_nonzero``), ``Tensor.tolist``
    and ``Tensor.numpy`` (patched while the counter is active), and copies from such a tensor to the
    CPU or from unpinned CPU memory to it.

    On a machine without an accelerator nothing would count; ``on_device`` says which tensors stand
    for device tensors instead (the CPU proxy): ``everything_but(batches)`` treats all but the data
    loader's batches as if they lived on a GPU, ``lambda t: True`` counts every read.

    Example:
        >>> import torch
        >>> with count_syncs(on_device=lambda t: True) as counter:
        ...     _ = float(torch.ones(()) * 2)
        >>> counter.count
        1
        >>> with count_syncs() as counter:  # a CPU tensor: reading it is no sync
        ...     _ = float(torch.ones(()) * 2)
        >>> counter.count
        0
    """

    READ_OPS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item")
    COPY_OPS = ("aten._to_copy", "aten.copy_")

    def __init__(self, on_device: Callable[[torch.Tensor], bool] | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0
        self.on_device = on_device or on_accelerator
        self._patched: dict[str, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name.startswith(self.READ_OPS):
            if isinstance(args[0], torch.Tensor) and self.on_device(args[0]):
                self.count += 1
        elif name.startswith(self.COPY_OPS) and self._syncing_copy(name, args, kwargs or {}):
            self.count += 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _syncing_copy(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
        """A real device-to-host copy, or a host-to-device copy from pageable memory."""
        if name.startswith("aten.copy_"):
            target, source = args[0], args[1]
            to = target.device
        else:
            source = args[0]
            to = kwargs.get("device") or source.device
        if not isinstance(source, torch.Tensor):
            return False
        to = torch.device(to)
        if source.device.type != "cpu" and to.type == "cpu":
            return True
        return source.device.type == "cpu" and to.type != "cpu" and not source.is_pinned()

    def __enter__(self) -> SyncCounter:
        for name in ("tolist", "numpy"):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original

            def counted(tensor: torch.Tensor, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if self.on_device(tensor):
                    self.count += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)  # type: ignore[no-untyped-call]
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        self._patched.clear()


@contextmanager
def count_syncs(on_device: Callable[[torch.Tensor], bool] | None = None) -> Iterator[SyncCounter]:
    """``with count_syncs() as counter: ...`` then ``counter.count`` (see ``SyncCounter``)."""
    counter = SyncCounter(on_device)
    with counter:
        yield counter
