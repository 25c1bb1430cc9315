"""A safetensors file read in one pass: its bytes land in the tensors' own memory, hashed chunk by chunk.

``safetensors.torch.load_file`` maps a file and gives views of the mapping; a checkpoint's optimizer
state must own its memory (rotation deletes the file later), so the load used to clone every tensor
out of the mapping and hash the file in a second pass over the same bytes. Here the header is
parsed and checked as safetensors checks it (``_layout``), one tensor of each declared dtype and
shape is allocated, and the file is read sequentially with ``readv(2)`` straight into them, chunks
of at most ``CHUNK`` bytes (many small tensors in one call); each chunk is hashed right after it is
read, while it is still in the CPU's cache. The hash fed in file order is the hash of the whole
file, so the manifest's digests (xxh3_128, or sha256 of format version 1) are unchanged.

Writing stays with safetensors (``io.write_tensors``); tests check this reader against
``safetensors.torch.load_file`` over dtypes and shapes (0-d, empty, bf16).
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import sys
from concurrent.futures import Executor
from pathlib import Path
from typing import Any, Protocol

import torch

from .safety import MAX_SAFETENSORS_HEADER, DamagedCheckpoint

#: bytes per readv(2) call and per hash update: a chunk is still in the L2/L3 cache when it is hashed
CHUNK = 1 << 20
_IOV_MAX = 512  # buffers per readv call (Linux allows 1024)
#: bytes from which a file is hashed on a pool thread, not between reads (a handoff costs tens of microseconds)
PARALLEL_MIN = 8 << 20

# a writable memoryview of a tensor's bytes, without numpy (the tensor must outlive it: read_into_fresh keeps it)
_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_memory.restype = ctypes.py_object
_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200

#: safetensors' dtype names (``safetensors.torch._TYPES``) for the dtypes this torch has
DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, attribute in (
        ("F64", "float64"),
        ("F32", "float32"),
        ("F16", "float16"),
        ("BF16", "bfloat16"),
        ("I64", "int64"),
        ("I32", "int32"),
        ("I16", "int16"),
        ("I8", "int8"),
        ("U8", "uint8"),
        ("BOOL", "bool"),
        ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E4M3FNUZ", "float8_e4m3fnuz"),
        ("F8_E5M2", "float8_e5m2"),
        ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ("C64", "complex64"),
        ("U64", "uint64"),
        ("U32", "uint32"),
        ("U16", "uint16"),
    )
    if isinstance(dtype := getattr(torch, attribute, None), torch.dtype)
}
#: the byte order of safetensors files; elsewhere ``io.read_tensors`` (safetensors' own swap) is used
SUPPORTED = sys.byteorder == "little"


class Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...


class Entry:
    """One tensor as the header declares it: name, dtype, shape and its [start, end) in the data."""

    __slots__ = ("dtype", "end", "name", "shape", "start")

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], start: int, end: int) -> None:
        self.name, self.dtype, self.shape, self.start, self.end = name, dtype, shape, start, end


def read_header(fd: int, size: int, path: Path, hasher: Hasher | None) -> tuple[list[Entry], int]:
    """The file's tensors in file order and the length of its data; the 8-byte prefix and the header
    are read from the start of ``fd`` (which must be there) and hashed."""
    if size < 8:
        raise _invalid(path, f"it has {size} bytes")
    prefix = _read_exactly(fd, 8, path)
    length = int.from_bytes(prefix, "little")
    if length > min(MAX_SAFETENSORS_HEADER, size - 8):
        raise _invalid(path, f"its header says {length} bytes, in a {size}-byte file")
    header = _read_exactly(fd, length, path)
    if hasher is not None:
        hasher.update(prefix)
        hasher.update(header)
    return _layout(header, path, size - 8 - length), size - 8 - length


def _layout(header: bytes, path: Path, data_size: int) -> list[Entry]:
    """The header's entries, checked as safetensors checks them: known dtypes, sizes that match the shapes,
    offsets that cover the data exactly, in order, without gaps or overlaps."""
    try:
        document = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _invalid(path, f"its header is not JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise _invalid(path, "its header is not a JSON object")
    entries = []
    for name, info in document.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise _invalid(path, "its __metadata__ is not a map of strings")
            continue
        entries.append(_entry(name, info, path))
    entries.sort(key=lambda e: (e.start, e.end))
    position = 0
    for entry in entries:
        if entry.start != position:
            raise _invalid(path, f"tensor {entry.name!r} starts at byte {entry.start}, not {position}")
        position = entry.end
    if position != data_size:
        raise _invalid(path, f"its tensors hold {position} bytes, its data {data_size}")
    return entries


def _entry(name: str, info: Any, path: Path) -> Entry:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise _invalid(path, f"tensor {name!r} is declared as {str(info)[:200]}")
    dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise _invalid(path, f"tensor {name!r} has dtype {info['dtype']!r}; known: {sorted(DTYPES)}")
    shape, offsets = info["shape"], info["data_offsets"]
    if not _naturals(shape) or not _naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise _invalid(path, f"tensor {name!r} has shape {shape!r} and offsets {offsets!r}")
    numel = 1
    for dimension in shape:
        numel *= dimension
    if numel * dtype.itemsize != offsets[1] - offsets[0]:
        raise _invalid(path, f"tensor {name!r} of shape {shape} and dtype {info['dtype']} spans {offsets}")
    return Entry(name, dtype, tuple(shape), offsets[0], offsets[1])


def _naturals(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def read_owned(
    fd: int, size: int, path: Path, hasher: Hasher | None, pool: Executor | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file open at the start of ``fd`` (``size`` bytes), in memory of its own;
    every byte read is fed to ``hasher`` (on a thread of ``pool`` for a large file). DamagedCheckpoint when
    the file is not a valid safetensors file."""
    entries, _ = read_header(fd, size, path, hasher)
    return read_into_fresh(fd, entries, path, hasher, pool if size >= PARALLEL_MIN else None)


def read_into_fresh(
    fd: int, entries: list[Entry], path: Path, hasher: Hasher | None, pool: Executor | None = None
) -> dict[str, torch.Tensor]:
    """Each entry's tensor in memory of its own, read from ``fd`` (positioned at the data) and hashed."""
    tensors: dict[str, torch.Tensor] = {}
    pieces: list[memoryview] = []
    for entry in entries:
        tensor = torch.empty(entry.shape, dtype=entry.dtype)
        tensors[entry.name] = tensor
        nbytes = entry.end - entry.start
        if nbytes:
            whole = _memory(tensor.data_ptr(), nbytes, _PYBUF_WRITE)
            pieces.extend(whole[at : at + CHUNK] for at in range(0, nbytes, CHUNK))
    read_pieces(fd, pieces, path, hasher, pool)
    return tensors


def read_pieces(
    fd: int, pieces: list[memoryview], path: Path, hasher: Hasher | None, pool: Executor | None = None
) -> None:
    """Fill ``pieces`` in order from ``fd``, up to ``CHUNK`` bytes per readv call, hashing each call's bytes:
    right after the call, or with a ``pool``, on one of its threads while the next call reads (in order)."""
    hashing = _Hashing(hasher, pool) if hasher is not None and pool is not None else None
    index = 0
    try:
        while index < len(pieces):
            group: list[memoryview] = []
            total = 0
            while index < len(pieces) and len(group) < _IOV_MAX and (not group or total + len(pieces[index]) <= CHUNK):
                group.append(pieces[index])
                total += len(pieces[index])
                index += 1
            _readv_all(fd, group, total, path)
            if hashing is not None:
                hashing.queue.put(group)
            elif hasher is not None:
                for piece in group:
                    hasher.update(piece)
    finally:
        if hashing is not None:
            hashing.finish()  # no thread reads the tensors' memory after this returns


class _Hashing:
    """A hasher fed in order on a pool thread: the chunk just read is hashed (xxhash releases the GIL, the
    chunk is still in the shared cache) while the kernel copies the next, where a second core is free."""

    def __init__(self, hasher: Hasher, pool: Executor) -> None:
        self.queue: queue.SimpleQueue[list[memoryview] | None] = queue.SimpleQueue()
        self.done = pool.submit(self._run, hasher)

    def _run(self, hasher: Hasher) -> None:
        while (group := self.queue.get()) is not None:
            for piece in group:
                hasher.update(piece)

    def finish(self) -> None:
        self.queue.put(None)
        self.done.result()


def _readv_all(fd: int, group: list[memoryview], total: int, path: Path) -> None:
    got = os.readv(fd, group)
    while got < total:  # a short read: go on after the bytes that came
        if got == 0:
            raise _invalid(path, "it ended before its tensors' data (truncated while read)")
        total -= got
        rest: list[memoryview] = []
        for piece in group:
            if got >= len(piece):
                got -= len(piece)
            else:
                rest.append(piece[got:])
                got = 0
        group = rest
        got = os.readv(fd, group)


def _read_exactly(fd: int, count: int, path: Path) -> bytes:
    data = bytearray(count)
    if count:
        _readv_all(fd, [memoryview(data)], count, path)
    return bytes(data)


def _invalid(path: Path, why: str) -> DamagedCheckpoint:
    return DamagedCheckpoint(f"checkpoint file {path} is not a valid safetensors file: {why}")
