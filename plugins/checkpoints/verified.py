"""Reading a checkpoint against its manifest: every listed file's size and hash, checked as it is read.

``io.py`` writes the files and the manifest; this module reads them back verified. ``read_manifest``
checks a whole checkpoint, ``verify_listed`` the files one rank reads, and ``CheckedFiles`` checks
each file as a load reads it (a JSON file from the bytes it parses, a safetensors file in place
while it is loaded), so every file is opened and hashed once.

Each file is read once. A file whose tensors must own their memory (the optimizer's moments, the
plugins' and RNG states) is read in one pass by ``tensor_reader``: ``readv`` straight into fresh
tensors, each 1 MB chunk hashed while it is still in cache, so no mapping, no clone and no second
pass over the bytes. The model's weights are copied into the parameters only when everything has
been checked, so they are loaded as views of the mapped file (read once, by the copy) and hashed on
a pool thread meanwhile (xxhash releases the GIL). Reading them straight into the parameters would
change the model before a damaged file is known to be damaged; reading them into fresh tensors and
swapping those in costs fresh pages, 2.6x the mapped, hashed copy on the 51M-parameter MLP (measured).
``CheckedFiles.finish`` (or ``settle``) checks every digest, in read order, before anything is applied
(``benchmarks/checkpoint_speed.py``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

import torch

from . import codec, tensor_reader
from . import io as cio
from .safety import (
    MAX_JSON_BYTES,
    MAX_MANIFEST_BYTES,
    DamagedCheckpoint,
    check_safetensors_header,
    damaged,
    plain_name,
    real_directory,
)


def read_manifest(directory: Path, *, verify: bool = True) -> dict[str, Any]:
    """The manifest of a complete checkpoint; with ``verify`` every listed file's size and hash.

    Raises DamagedCheckpoint (a ConfigError) naming the file that is missing, truncated, altered,
    out of bounds or not a plain name inside ``directory`` (``safety.py``), whatever went wrong.
    """
    path = directory / cio.MANIFEST
    try:
        real_directory(directory)
        manifest = cio.read_json(path, limit=MAX_MANIFEST_BYTES)
        if (
            not isinstance(manifest, dict)
            or manifest.get("format") != cio.FORMAT
            or not isinstance(manifest.get("files"), dict)
        ):
            raise DamagedCheckpoint(f"{path} is not a {cio.FORMAT} manifest")
        version = manifest.get("version")
        if isinstance(version, bool) or version not in cio.READABLE_VERSIONS:
            raise DamagedCheckpoint(
                f"{path} has format version {version!r}; this trainbus reads {list(cio.READABLE_VERSIONS)}"
            )
        for name, entry in manifest["files"].items():
            plain_name(name, path)
            if not isinstance(entry, dict):
                raise DamagedCheckpoint(f"{path} lists {name} with {entry!r}, not a size and a hash")
        if verify:
            for name, entry in manifest["files"].items():
                verify_file(directory / name, entry, path)
    except Exception as exc:  # a manifest is data from disk: whatever it makes fail is damage
        raise damaged(path, exc) from exc
    return manifest  # type: ignore[no-any-return]


def verify_listed(directory: Path, manifest: Mapping[str, Any], names: Iterable[str]) -> None:
    """Check the named files of ``directory`` against its manifest, which must list them.

    A rank of a sharded run checks the files it reads this way, not the whole checkpoint.
    """
    for name in names:
        entry = manifest["files"].get(name)
        if entry is None:
            raise DamagedCheckpoint(f"checkpoint file {directory / name} is not listed in {directory / cio.MANIFEST}")
        verify_file(directory / name, entry, directory / cio.MANIFEST)


def verify_file(file: Path, entry: Any, manifest: Path) -> None:
    """Check a file against its manifest entry (size, then the hash the entry names), hashing it in place."""
    _check_hash(file, *_open_checked(file, entry, manifest).digest(), entry, manifest)


class _Opened:
    """A listed file opened, its size and (a safetensors file) header bounds checked; ``digest`` hashes and closes."""

    def __init__(self, fd: int, size: int, algorithm: str) -> None:
        self.fd, self.size, self.algorithm = fd, size, algorithm

    def digest(self) -> tuple[str, str]:
        """(hex digest, algorithm); the descriptor is closed, whatever happens."""
        try:
            return cio.digest_fd(self.fd, self.size, self.algorithm), self.algorithm
        finally:
            os.close(self.fd)


def _open_checked(file: Path, entry: Any, manifest: Path) -> _Opened:
    algorithm = _hash_named_by(entry, file, manifest)
    fd, size = _open_listed(file, manifest)
    try:
        _check_size(file, size, entry)
        if file.suffix == ".safetensors":  # as written, or a manifest rewritten with it: bounded before parsing
            try:
                check_safetensors_header(fd, size, file)
            except DamagedCheckpoint:  # a flipped bit in the header is named as one, like anywhere else
                _check_hash(file, cio.digest_fd(fd, size, algorithm), algorithm, entry, manifest)
                raise
    except BaseException:
        os.close(fd)
        raise
    return _Opened(fd, size, algorithm)


def read_checked(file: Path, entry: Any, manifest: Path, *, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of a file, checked against its manifest entry: read once, hashed in hand (a JSON file)."""
    algorithm = _hash_named_by(entry, file, manifest)
    fd, size = _open_listed(file, manifest)
    try:
        _check_size(file, size, entry)
        if size > limit:
            raise DamagedCheckpoint(f"checkpoint file {file} has {size} bytes, more than the {limit} it may")
        data = cio.read_fd(fd, size)
    finally:
        os.close(fd)
    _check_size(file, len(data), entry)  # shrunk while read
    _check_hash(file, cio.HASHES[algorithm](data).hexdigest(), algorithm, entry, manifest)
    return data


def _open_listed(file: Path, manifest: Path) -> tuple[int, int]:
    try:
        opened = cio.open_regular(file)
    except OSError as exc:
        raise DamagedCheckpoint(f"checkpoint file {file} listed in {manifest} cannot be read: {exc}") from exc
    if opened is None:
        raise DamagedCheckpoint(f"checkpoint file {file} listed in {manifest} is missing (or not a regular file)")
    return opened


def _hash_named_by(entry: Any, file: Path, manifest: Path) -> str:
    algorithm = next((name for name in cio.HASHES if isinstance(entry, dict) and name in entry), None)
    if algorithm is None:
        raise DamagedCheckpoint(
            f"{manifest} lists {file.name} without a size and a hash of {sorted(cio.HASHES)}: {entry!r}"
        )
    return algorithm


def _check_size(file: Path, size: int, entry: Mapping[str, Any]) -> None:
    if size != entry.get("size"):
        raise DamagedCheckpoint(f"checkpoint file {file} has {size} bytes, the manifest says {entry.get('size')}")


def _check_hash(file: Path, digest: str, algorithm: str, entry: Mapping[str, Any], manifest: Path) -> None:
    if digest != entry[algorithm]:
        raise DamagedCheckpoint(
            f"checkpoint file {file} does not match its {algorithm} in {manifest} (corrupt or altered)"
        )


class CheckedFiles:
    """The files of one checkpoint as a load reads them, each checked against the manifest once.

    A JSON file is hashed from the bytes read to parse it. A safetensors file is opened (no link, a
    regular file) and its size and header bounds checked at once; owned tensors are hashed as they are
    read into (``_read_hashing``), mapped ones on a pool thread while the load reads on. Read
    everything, then ``finish`` (every digest, and the listed files no read touched; ``settle``: only
    the digests of the files read), and the whole checkpoint is verified before any of it is
    applied; ``close`` waits for the hashes still running after a failure. A file the manifest does
    not list is refused. With ``verify=False`` (the caller has just verified the checkpoint) files
    are read unchecked.
    """

    def __init__(self, directory: Path, manifest: Mapping[str, Any], *, verify: bool = True) -> None:
        self.directory = directory
        self.manifest_path = directory / cio.MANIFEST
        self.files: Mapping[str, Any] = manifest["files"]
        self.verify = verify
        self.seen: set[str] = set()
        self.pending: list[tuple[Path, futures.Future[tuple[str, str]]]] = []  # hashes running, in read order

    def _path(self, name: str) -> Path:
        """The file's path; checks that the manifest lists it and marks it read."""
        path = self.directory / plain_name(name, self.manifest_path)
        if self.verify and name not in self.files:
            raise DamagedCheckpoint(f"checkpoint file {path} is not listed in {self.manifest_path}")
        self.seen.add(name)
        return path

    def read_bytes(self, name: str) -> bytes:
        path = self._path(name)
        return read_checked(path, self.files[name], self.manifest_path) if self.verify else cio.read_file(path)

    def tensors(self, name: str, *, owned: bool = False, load: bool = True) -> dict[str, torch.Tensor]:
        """A safetensors file's tensors (``read_tensors``), hashed meanwhile; ``load=False``: only checked.

        The file's size and header are checked before it is parsed; its hash is checked by ``finish``.
        """
        path = self._path(name)
        if not self.verify:
            return cio.read_tensors(path, owned=owned) if load else {}
        opened = _open_checked(path, self.files[name], self.manifest_path)
        if owned and load and tensor_reader.SUPPORTED:
            return self._read_hashing(path, opened)
        hashed = cio.io_pool().submit(opened.digest)  # closes the descriptor
        self.pending.append((path, hashed))
        try:
            return cio.read_tensors(path, owned=owned, size=opened.size) if load else {}
        except Exception:  # a file safetensors cannot parse: named as altered when its hash says so
            _check_hash(path, *hashed.result(), self.files[name], self.manifest_path)
            raise

    def _read_hashing(self, path: Path, opened: _Opened) -> dict[str, torch.Tensor]:
        """Tensors of memory of their own, each chunk hashed as it is read into them (one pass over the file).

        The digest is checked with the pending ones (``settle``), in read order, before anything is applied.
        """
        entry = self.files[path.name]
        hasher = cio.HASHES[opened.algorithm]()
        try:
            tensors = cio.read_tensors(path, owned=True, size=opened.size, fd=opened.fd, hasher=hasher)
        except Exception:  # a file that cannot be parsed: named as altered when its hash says so
            os.lseek(opened.fd, 0, os.SEEK_SET)  # digest_fd reads a small file from where the descriptor is
            _check_hash(path, cio.digest_fd(opened.fd, opened.size, opened.algorithm), opened.algorithm, entry,
                        self.manifest_path)  # fmt: skip
            raise
        finally:
            os.close(opened.fd)
        hashed: futures.Future[tuple[str, str]] = futures.Future()
        hashed.set_result((hasher.hexdigest(), opened.algorithm))
        self.pending.append((path, hashed))
        return tensors

    def bundle(self, stem: str) -> Any:
        """What ``write_bundle`` wrote as ``stem``; its tensors are loaded only if its JSON refers to one."""
        data = self.read_bytes(f"{stem}.json")
        referred = codec.TENSOR_KEY in data  # the plugins' states often hold none
        tensors = self.tensors(f"{stem}.safetensors", owned=True, load=referred)
        path = self.directory / f"{stem}.json"
        return cio.join_bundle(cio.parse_json(data, path), tensors, path)

    def finish(self) -> None:
        """Check every file read and the listed files no read touched (with ``verify=False``: nothing)."""
        if self.verify:
            for name in sorted(set(self.files) - self.seen):
                path = self.directory / name
                try:
                    future = cio.io_pool().submit(_open_checked(path, self.files[name], self.manifest_path).digest)
                except Exception as exc:  # reported after the files read before it, as if checked in turn
                    future = futures.Future()
                    future.set_exception(exc)
                self.pending.append((path, future))
        self.settle()

    def settle(self) -> None:
        """Wait for the hashes of the files read so far; DamagedCheckpoint for the first (in read order) that
        does not match."""
        pending, self.pending = self.pending, []
        futures.wait([future for _, future in pending])
        for path, future in pending:
            _check_hash(path, *future.result(), self.files[path.name], self.manifest_path)

    def close(self) -> None:
        """Wait for any hash still running (after a failure: none may still read the files when this returns)."""
        pending, self.pending = self.pending, []
        futures.wait([future for _, future in pending])


def is_complete(directory: Path) -> bool:
    """Cheap completeness test (a readable manifest); ``read_manifest`` verifies the contents."""
    try:
        read_manifest(directory, verify=False)
    except Exception:  # read_manifest raises DamagedCheckpoint; nothing else may break a listing
        return False
    return True
