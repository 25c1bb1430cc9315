"""Checkpoint files without pickle: tensors in safetensors, everything else in strict JSON.

A nested state is written as a bundle, ``stem.json`` + ``stem.safetensors``: ``codec.py`` splits it
into a JSON structure and its tensors, and restores the same Python values without ever running
code from a file (K7). Every file of a checkpoint is listed with its size and hash in
``manifest.json``, written last: a directory without a valid manifest is not a checkpoint (K3).

Speed (``benchmarks/checkpoint_speed.py``): a file is hashed once, as it is written (JSON from the
bytes in hand, safetensors from the page cache through a memory map, no copy), with xxh3_128
(tens of GB/s; sha256 runs at 1.5), and once as a load reads it (``verified.py``, which reads
the manifest and checks every file against it: JSON from the bytes it parses, safetensors in place
just before loading it). The hash guards against torn,
truncated and bit-flipped files, not against tampering: whoever can rewrite a file can rewrite the
unsigned manifest too. Writers do not fsync one by one: ``sync_files`` fsyncs every file and the
directory at once, just before the directory is renamed into place, so the file system writes them
in parallel and commits its journal once.
"""

from __future__ import annotations

import errno
import hashlib
import inspect
import json
import mmap
import os
import stat
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import safetensors
import safetensors.torch as st
import torch
import xxhash

from trainbus.engine import ConfigError

from . import codec, tensor_reader
from .launch import torchelastic_run as torchelastic_run  # re-exported: the launch a manifest records (launch.py)
from .rng import rng_state as rng_state  # re-exported: a checkpoint's RNG states (rng.py)
from .rng import set_rng_state as set_rng_state
from .safety import MAX_JSON_BYTES, DamagedCheckpoint, damaged, parse_bounded_json, plain_name
from .weights import load_weights as load_weights  # re-exported: fitting a saved state into a model (weights.py)
from .weights import state_to_save

MANIFEST = "manifest.json"
FORMAT = "trainbus-checkpoint"
VERSION = 2  # 2: files hashed with xxh3_128 (version 1: sha256, still read)
READABLE_VERSIONS = (1, 2)
HASH = "xxh3_128"


class _Hasher(Protocol):
    def hexdigest(self) -> str: ...


#: the hashes a manifest entry may name (its key), the one new checkpoints use first
HASHES: dict[str, Callable[..., _Hasher]] = {HASH: xxhash.xxh3_128, "sha256": hashlib.sha256}
_SYNC_THREADS = 16
_READ_MAX = 64 << 10  # bytes: a file up to this size is hashed from a copy, not a memory map (digest_file)
_POOL: ThreadPoolExecutor | None = None  # see io_pool


# -- files ----------------------------------------------------------------------------------------
# A writer returns the file's manifest entry, ``{"size": bytes, HASH: hexdigest}``, and leaves the
# file unsynced: ``sync_files`` makes a whole directory durable at once before it is published.
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


def sync_files(directory: Path, names: Iterable[str]) -> None:
    """fsync the named files of ``directory`` and the directory itself, all at once.

    Concurrent fsyncs let the file system write the files in parallel and commit its journal once
    for all of them, where one after the other commits it once per file (measured on ext4: the
    crash-test MLP's checkpoint, 10 files, saved in 1.1-1.3x the time of one safetensors file + one
    fsync, against 1.2-3x with the fsyncs in turn). Every fsync has finished when this returns or
    raises its first error.
    """
    paths = [directory / name for name in names] + [directory]
    pending = [io_pool().submit(fsync_path, path) for path in paths]
    futures.wait(pending)  # all of them, even after a failure: none may still run when the caller cleans up
    for future in pending:
        future.result()


def io_pool() -> ThreadPoolExecutor:
    """The threads that run a save's fsyncs and a load's hashes, kept for the next one (starting them cost 1 ms
    each on a busy machine). Both wait in the kernel or in xxhash, which releases the GIL on large inputs."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=_SYNC_THREADS, thread_name_prefix="trainbus-io")
    return _POOL


def _forget_pool() -> None:
    global _POOL
    _POOL = None  # a forked child has none of the parent's threads


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_pool)


def digest_file(path: Path, algorithm: str = HASH) -> str:
    """The hex digest of a file, hashed in place through a read-only memory map (no copy into Python)."""
    fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    try:
        return digest_fd(fd, os.fstat(fd).st_size, algorithm)
    finally:
        os.close(fd)


def digest_fd(fd: int, size: int, algorithm: str) -> str:
    """A small file is read, not mapped: mapping and unmapping it cost more than copying it (5-64 KB: 1.7-2x)."""
    if size <= _READ_MAX:  # mmap also refuses an empty file
        return HASHES[algorithm](read_fd(fd, size)).hexdigest()
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as view:
        return HASHES[algorithm](view).hexdigest()


def read_fd(fd: int, size: int) -> bytes:
    """``size`` bytes from ``fd``, fewer if the file ends first (one read(2) below 2 GB)."""
    parts: list[bytes] = []
    while size > 0 and (part := os.read(fd, size)):
        parts.append(part)
        size -= len(part)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def file_entry(path: Path) -> dict[str, Any]:
    """The manifest entry of a file: its size and its hash."""
    return {"size": path.stat().st_size, HASH: digest_file(path)}


def _written(path: Path) -> dict[str, Any]:
    """The manifest entry of a tensor file just written, and the start of its writeback to disk.

    The file is still in the page cache, so hashing it is a pass over memory, not a read from disk.
    That is cheaper than serialising the tensors into bytes to hash them before writing
    (``safetensors.torch.save``): it allocates and fills a second copy of the data, which made the
    save of the crash-test MLP 3x slower than ``save_file`` (measured).
    ``POSIX_FADV_DONTNEED`` makes Linux start writing the dirty pages now, while the next files
    are serialised, so the fsync before the rename finds most of the work done (measured: the
    crash-test MLP's save 1.1-1.3x of one file + one fsync, 1.6x without); it is a hint, the fsync
    is what guarantees the data is on disk. Pages already clean leave the page cache: a checkpoint
    is rarely read back soon, and the data a run reads stays cached instead.
    """
    entry = file_entry(path)
    if hasattr(os, "posix_fadvise"):  # not on macOS / Windows
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return entry


def write_json(path: Path, value: Any, *, indent: int | None = 1) -> dict[str, Any]:
    """Write strict JSON (NaN is an error: the codec tags non-finite floats); returns its manifest entry.

    ``indent=None`` writes compact JSON with the json module's C encoder; any indent uses its pure
    Python one, 5x slower (measured on an RNG state).
    """
    separators = (",", ":") if indent is None else None
    return write_text(path, json.dumps(value, indent=indent, separators=separators, sort_keys=True, allow_nan=False))


def write_text(path: Path, text: str) -> dict[str, Any]:
    """Write a UTF-8 text file, hashing the bytes in hand; returns its manifest entry."""
    data = text.encode("utf-8")
    with open(path, "wb") as f:
        f.write(data)
    return {"size": len(data), HASH: HASHES[HASH](data).hexdigest()}


def write_tensors(path: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Write tensors to a safetensors file; returns its manifest entry."""
    # {"format": "pt"}: transformers 4's from_pretrained refuses a safetensors file without it
    st.save_file(_for_safetensors(tensors), str(path), metadata={"format": "pt"})
    return _written(path)


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


def read_json(path: Path, *, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file of at most ``limit`` bytes; a missing, oversized or corrupt file raises
    DamagedCheckpoint (a ConfigError) naming it (``safety.parse_bounded_json``)."""
    return parse_bounded_json(read_file(path, limit=limit), path, limit=limit)


def parse_json(data: bytes, path: Path) -> Any:
    return parse_bounded_json(data, path)


# A load opens each file once, with os.open: open() adds an ioctl, two lseeks and an fstat to every
# file it reads (9 system calls for a small file instead of 4; a load of the crash-test MLP's
# checkpoint made 140 system calls, 95 now), each a few microseconds, tens after a large copy.
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # a FIFO opens without waiting for a writer, and is refused
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a symlink is refused, not followed out of the checkpoint


def open_regular(file: Path) -> tuple[int, int] | None:
    """A read-only descriptor and the size of a regular file; None when there is none (missing, a
    directory, a FIFO, a device). A symlink raises DamagedCheckpoint. The caller closes the descriptor."""
    try:
        fd = os.open(file, os.O_RDONLY | _NONBLOCK | _NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP or os.path.islink(file):
            raise DamagedCheckpoint(f"checkpoint file {file} is a symlink; trainbus follows no link") from exc
        raise
    try:
        info = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        return None
    return fd, info.st_size


def read_file(file: Path, *, limit: int | None = None) -> bytes:
    """A regular file's bytes; ConfigError naming it when it is missing, unreadable or over ``limit`` bytes."""
    try:
        opened = open_regular(file)
        if opened is None:
            raise DamagedCheckpoint(f"checkpoint file {file} is missing (or not a regular file)")
        fd, size = opened
        try:
            if limit is not None and size > limit:
                raise DamagedCheckpoint(f"checkpoint file {file} has {size} bytes, more than the {limit} it may")
            return read_fd(fd, size)
        finally:
            os.close(fd)
    except OSError as exc:
        raise ConfigError(f"checkpoint file {file} cannot be read: {exc}") from exc


#: safetensors >= 0.8 reads a small file with pread(2) into tensors of their own (where tensor_reader cannot)
_PREAD, _PREAD_MAX = "backend" in inspect.signature(st.load_file).parameters, 1 << 20


def read_tensors(
    path: Path, *, owned: bool = False, size: int | None = None, fd: int | None = None, hasher: Any = None
) -> dict[str, torch.Tensor]:
    """Load a safetensors file on the CPU; a missing or corrupt file raises ConfigError naming it.

    By default the tensors are views of the file, memory-mapped: what is copied elsewhere (weights
    into a model) is read only once. ``owned`` gives each tensor memory of its own and keeps no
    mapping of the file, for state that lives on and is updated in place (an optimizer's): views
    would keep a checkpoint that rotation deletes allocated on disk for the rest of the run. They are
    read in one pass straight into it (``tensor_reader``; 2.4x faster than mapping and cloning 390 MB),
    from ``fd`` (at the start of the file of ``size`` bytes) feeding ``hasher`` if given."""
    try:
        if owned and tensor_reader.SUPPORTED:
            return _read_owned(path, fd, size, hasher)
        if os.path.islink(path):  # safetensors opens by name: a link would be followed
            raise DamagedCheckpoint(f"checkpoint file {path} is a symlink; trainbus follows no link")
        if owned and _PREAD and (path.stat().st_size if size is None else size) <= _PREAD_MAX:
            return st.load_file(str(path), device="cpu", backend="pread")
        tensors = st.load_file(str(path), device="cpu")
    except FileNotFoundError as exc:
        raise DamagedCheckpoint(f"checkpoint file {path} is missing") from exc
    except DamagedCheckpoint:
        raise
    except (OSError, safetensors.SafetensorError, ValueError, RuntimeError) as exc:
        raise DamagedCheckpoint(f"checkpoint file {path} is not a valid safetensors file: {exc}") from exc
    except Exception as exc:  # whatever else reading it raised: damage, not a crash
        raise damaged(path, exc) from exc
    return {key: tensor.clone() for key, tensor in tensors.items()} if owned else tensors


def _read_owned(path: Path, fd: int | None, size: int | None, hasher: Any) -> dict[str, torch.Tensor]:
    opened = (fd, size) if fd is not None and size is not None else open_regular(path)  # a link: damage
    if opened is None:
        raise DamagedCheckpoint(f"checkpoint file {path} is missing (or not a regular file)")
    try:
        return tensor_reader.read_owned(*opened, path, hasher, io_pool())
    finally:
        if opened[0] != fd:  # opened here
            os.close(opened[0])


def write_bundle(directory: Path, stem: str, value: Any) -> dict[str, dict[str, Any]]:
    """Write ``value`` as ``stem.json`` + ``stem.safetensors``; returns their manifest entries by file name."""
    return write_split_bundle(directory, stem, *codec.split_tensors(value, stem))


def write_split_bundle(
    directory: Path, stem: str, structure: Any, tensors: Mapping[str, torch.Tensor]
) -> dict[str, dict[str, Any]]:
    """``write_bundle`` of a value split earlier (``codec.split_tensors``: a structure of its own, and its tensors)."""
    return {
        f"{stem}.safetensors": write_tensors(directory / f"{stem}.safetensors", tensors),
        f"{stem}.json": write_json(directory / f"{stem}.json", {"format": FORMAT, "data": structure}, indent=None),
    }


def read_bundle(directory: Path, stem: str) -> Any:
    """Read what ``write_bundle`` wrote, unchecked (``verified.CheckedFiles.bundle`` checks it against a manifest)."""
    path = directory / f"{stem}.json"
    return join_bundle(read_json(path), read_tensors(directory / f"{stem}.safetensors", owned=True), path)


def join_bundle(doc: Any, tensors: Mapping[str, torch.Tensor], path: Path) -> Any:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or "data" not in doc:
        raise ConfigError(f"checkpoint file {path} is not a {FORMAT} file (no 'format'/'data' keys)")
    return codec.join_tensors(doc["data"], tensors, str(path))


# -- manifest -------------------------------------------------------------------------------------
def write_manifest(
    directory: Path,
    files: Iterable[str],
    info: Mapping[str, Any],
    *,
    entries: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Write ``manifest.json`` listing ``files`` with size and hash; call it after every other file.

    ``entries`` holds what the writers returned for the files they wrote, so those are not read
    again; any other file is hashed from disk. Returns the manifest's own entry; like every writer's
    file it is not synced here (``sync_files``).
    """
    entries = entries or {}
    listed = {name: dict(entries[name]) if name in entries else file_entry(directory / name) for name in files}
    launch = {"torchelastic_run": run} if (run := torchelastic_run()) is not None else {}
    return write_json(directory / MANIFEST, {"format": FORMAT, "version": VERSION, **info, **launch, "files": listed})


# -- model weights --------------------------------------------------------------------------------
def save_weights(model: torch.nn.Module, path: Path) -> dict[str, Any]:
    """Write the model's state dict to safetensors (tied weights once, under the name transformers keeps:
    ``weights.state_to_save``); returns its manifest entry."""
    return write_tensors(path, state_to_save(model))


def load_model_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Load weights saved by ``save_model`` or a checkpoint (safetensors only, also HF shards)."""
    root = Path(directory)
    single = root / "model.safetensors"
    if (root / MANIFEST).is_file():  # a checkpoint: the weights its resume reads (weights_name.py)
        from .weights_name import weights_file

        single = root / weights_file(read_json(root / MANIFEST), root / MANIFEST)
    index = root / "model.safetensors.index.json"
    if single.is_file() or single.is_symlink():  # a link is refused by read_tensors, not skipped
        load_weights(model, read_tensors(single), str(single))
        return
    if index.is_file() or index.is_symlink():
        document = read_json(index)
        weight_map = document.get("weight_map") if isinstance(document, dict) else None
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index} has no 'weight_map' object")
        state: dict[str, torch.Tensor] = {}
        for shard in sorted({plain_name(name, index) for name in weight_map.values()}):  # no path out of root
            state.update(read_tensors(root / shard))
        load_weights(model, state, str(index))
        return
    seen = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    raise ConfigError(f"no model.safetensors or model.safetensors.index.json in {root}; found: {seen or 'nothing'}")
