"""A verified resume reads each owned tensor file in one pass (#29 item 2), and weights of another dtype are refused.

* ``tensor_reader`` reads what safetensors wrote exactly as ``safetensors.torch.load_file`` does (every
  dtype, 0-d and empty tensors, bf16), hashing the whole file on the way; what safetensors refuses it
  refuses as damage;
* a verified load reads the optimizer's file once, with read calls straight into the tensors' memory
  (no mapping, no second hash pass), and still applies nothing when any file fails its hash;
* weights whose header declares another dtype than the model's (int32 over float32 bytes) are refused,
  naming them, before anything is applied (#29 "Why" item 7).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path
from typing import Any, ClassVar

import pytest
import safetensors.torch as st
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as hs

from trainbus.engine import ConfigError, Engine
from trainbus.plugins.checkpoints import io as cio
from trainbus.plugins.checkpoints import tensor_reader
from trainbus.plugins.checkpoints.checkpoint import load_checkpoint, save_checkpoint
from trainbus.plugins.checkpoints.safety import DamagedCheckpoint

pytestmark = pytest.mark.skipif(not tensor_reader.SUPPORTED, reason="safetensors' byte order is little-endian")


def make_engine(seed: int = 0) -> Engine:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    data = [(torch.randn(4, 6), torch.randn(4, 2)) for _ in range(2)]
    return Engine(
        model, torch.optim.AdamW(model.parameters(), lr=0.01), train_data=data, max_steps=2, loss_fn=torch.nn.MSELoss()
    )


def read_fresh(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    """The file's tensors through the one-pass reader, and the xxh3_128 it fed."""
    hasher = xxhash.xxh3_128()
    tensors = cio.read_tensors(path, owned=True, hasher=hasher)
    return tensors, hasher.hexdigest()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN and float8 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().view(-1).view(torch.uint8).tolist()) == bytes(
        b.contiguous().view(-1).view(torch.uint8).tolist()
    )


# -- the reader against safetensors ---------------------------------------------------------------
SHAPES = hs.lists(hs.integers(0, 4), min_size=0, max_size=3)  # [] is 0-d; a 0 anywhere is empty


@hs.composite
def tensor_dicts(draw: Any) -> dict[str, torch.Tensor]:
    names = draw(hs.lists(hs.text("abc./_0", min_size=1, max_size=6), min_size=0, max_size=6, unique=True))
    out = {}
    for name in names:
        dtype = draw(hs.sampled_from(sorted(tensor_reader.DTYPES.values(), key=str)))
        shape = draw(SHAPES)
        numel = 1
        for dimension in shape:
            numel *= dimension
        raw = draw(hs.binary(min_size=numel * dtype.itemsize, max_size=numel * dtype.itemsize))
        out[name] = (
            torch.frombuffer(bytearray(raw) or bytearray(1), dtype=torch.uint8)[: len(raw)].view(dtype).reshape(shape)
        )
    return out


@given(tensors=tensor_dicts(), chunk=hs.sampled_from([1, 7, 64, 1 << 20]), pooled=hs.booleans())
def test_the_reader_reads_what_safetensors_wrote_as_safetensors_does(
    tmp_path_factory: pytest.TempPathFactory, tensors: dict[str, torch.Tensor], chunk: int, pooled: bool
) -> None:
    path = tmp_path_factory.mktemp("st") / "t.safetensors"
    st.save_file(tensors, str(path), metadata={"format": "pt"})
    expected = st.load_file(str(path))
    old = tensor_reader.CHUNK, tensor_reader.PARALLEL_MIN
    tensor_reader.CHUNK = chunk  # many chunks per tensor, many tensors per chunk
    tensor_reader.PARALLEL_MIN = 0 if pooled else 1 << 62  # hashed on a pool thread, or between reads
    try:
        loaded, digest = read_fresh(path)
    finally:
        tensor_reader.CHUNK, tensor_reader.PARALLEL_MIN = old
    assert loaded.keys() == expected.keys()
    assert all(same(loaded[k], expected[k]) for k in expected)
    assert digest == xxhash.xxh3_128(path.read_bytes()).hexdigest()  # every byte hashed, in order
    pointers = [t.untyped_storage().data_ptr() for t in loaded.values() if t.numel()]
    assert len(set(pointers)) == len(pointers)  # memory of their own, one storage each


def test_bf16_zero_d_and_empty_tensors_are_read_exactly(tmp_path: Path) -> None:
    tensors = {
        "bf16": torch.tensor([1.5, -2.25, float("nan")], dtype=torch.bfloat16),
        "scalar": torch.tensor(3.0),
        "empty": torch.empty(0, 5),
        "step": torch.tensor(7, dtype=torch.int64),
    }
    st.save_file(tensors, str(tmp_path / "t.safetensors"))
    loaded, _ = read_fresh(tmp_path / "t.safetensors")
    assert all(same(loaded[k], tensors[k]) for k in tensors)
    loaded["scalar"].add_(1)  # writable
    assert loaded["scalar"].item() == 4.0


@pytest.mark.parametrize("pooled", [False, True])
def test_reads_returned_short_are_continued(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pooled: bool) -> None:
    monkeypatch.setattr(tensor_reader, "PARALLEL_MIN", 0 if pooled else 1 << 62)
    tensors = {f"t{i}": torch.arange(i * 10, dtype=torch.float32) for i in range(6)}
    st.save_file(tensors, str(tmp_path / "t.safetensors"))
    real = os.readv

    def short(fd: int, buffers: list[memoryview]) -> int:
        return real(fd, [memoryview(buffers[0])[:13]])  # at most 13 bytes a call

    monkeypatch.setattr(os, "readv", short)
    loaded, digest = read_fresh(tmp_path / "t.safetensors")
    assert all(same(loaded[k], tensors[k]) for k in tensors)
    assert digest == xxhash.xxh3_128((tmp_path / "t.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("pooled", [False, True])
def test_a_file_that_ends_while_read_is_damage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pooled: bool) -> None:
    monkeypatch.setattr(tensor_reader, "PARALLEL_MIN", 0 if pooled else 1 << 62)
    st.save_file({"a": torch.ones(100)}, str(tmp_path / "t.safetensors"))
    real = os.readv
    monkeypatch.setattr(os, "readv", lambda fd, buffers: real(fd, buffers) if len(buffers[0]) < 100 else 0)
    with pytest.raises(DamagedCheckpoint, match=r"t\.safetensors is not a valid safetensors file: it ended"):
        read_fresh(tmp_path / "t.safetensors")


def _header_file(path: Path, header: Any, data: bytes) -> Path:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
HOSTILE_HEADERS = {
    "a gap before a tensor": ({"a": {**F32, "data_offsets": [4, 12]}}, 12),
    "overlapping tensors": ({"a": F32, "b": {**F32, "data_offsets": [4, 12]}}, 12),
    "bytes after the last tensor": ({"a": F32}, 12),
    "a size that is not the shape's": ({"a": {**F32, "shape": [3]}}, 8),
    "an unknown dtype": ({"a": {**F32, "dtype": "Q7"}}, 8),
    "a negative dimension": ({"a": {**F32, "shape": [-2]}}, 8),
    "offsets past the data": ({"a": {**F32, "data_offsets": [0, 16]}}, 8),
    "offsets backwards": ({"a": {**F32, "data_offsets": [8, 0]}}, 8),
    "a header that is a list": ([1, 2], 0),
    "a huge empty dimension": ({"a": {"dtype": "F32", "shape": [0, 2**62, 2**62], "data_offsets": [0, 0]}}, 0),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_HEADERS))
def test_what_safetensors_refuses_the_reader_refuses_as_damage(tmp_path: Path, case: str) -> None:
    header, size = HOSTILE_HEADERS[case]
    path = _header_file(tmp_path / "t.safetensors", header, bytes(size))
    if case != "a huge empty dimension":  # safetensors accepts it; torch cannot allocate it
        with pytest.raises(Exception):  # noqa: B017 - safetensors' own error types vary by release
            st.load_file(str(path))
    with pytest.raises(DamagedCheckpoint, match=r"t\.safetensors is not a valid safetensors file"):
        read_fresh(path)


# -- the verified load ----------------------------------------------------------------------------
@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Engine, Path]:
    engine = make_engine()
    engine.fit()
    return engine, save_checkpoint(engine, tmp_path / "out")


def test_a_verified_load_reads_the_optimizer_file_once_straight_into_its_tensors(
    checkpoint: tuple[Engine, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    saved, directory = checkpoint
    optimizer_file = directory / "optimizer.safetensors"
    read_into: dict[int, int] = {}  # bytes read by inode
    mapped: list[int] = []
    real_readv, real_read, real_mmap, real_load = os.readv, os.read, mmap.mmap, st.load_file

    def count(fd: int, got: int) -> None:
        inode = os.fstat(fd).st_ino  # descriptors are reused from file to file, inodes are not
        read_into[inode] = read_into.get(inode, 0) + got

    def readv(fd: int, buffers: list[memoryview]) -> int:
        got = real_readv(fd, buffers)
        count(fd, got)
        return got

    def read(fd: int, size: int) -> bytes:
        data = real_read(fd, size)
        count(fd, len(data))
        return data

    def mapping(fd: int, *args: Any, **kwargs: Any) -> Any:
        mapped.append(os.fstat(fd).st_ino)
        return real_mmap(fd, *args, **kwargs)

    def load_file(name: str, *args: Any, **kwargs: Any) -> Any:
        mapped.append(os.stat(name).st_ino)
        return real_load(name, *args, **kwargs)

    monkeypatch.setattr(os, "readv", readv)
    monkeypatch.setattr(os, "read", read)  # what a hash of a small file reads
    monkeypatch.setattr(mmap, "mmap", mapping)
    monkeypatch.setattr(st, "load_file", load_file)
    fresh = make_engine(seed=1)
    load_checkpoint(fresh, directory)
    assert optimizer_file.stat().st_ino not in mapped  # neither mapped to hash it nor loaded by safetensors
    assert read_into[optimizer_file.stat().st_ino] == optimizer_file.stat().st_size  # every byte read once, hashed
    assert fresh.optimizer is not None and saved.optimizer is not None
    for mine, theirs in zip(fresh.optimizer.state.values(), saved.optimizer.state.values(), strict=True):
        assert all(torch.equal(mine[key], value) for key, value in theirs.items())


def _rewrite_as(path: Path, name: str, dtype: str) -> None:
    """Declare one tensor of a safetensors file with another dtype of the same size, its bytes unchanged."""
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header[name]["dtype"] = dtype
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    text += b" " * (length - len(text))  # the same length: the data stays where it was
    path.write_bytes(data[:8] + text + data[8 + length :])


def _rehash(directory: Path) -> None:
    """What a hostile writer does after altering a file: a manifest that vouches for it."""
    manifest = json.loads((directory / cio.MANIFEST).read_text())
    for name in manifest["files"]:
        manifest["files"][name] = cio.file_entry(directory / name)
    (directory / cio.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("dtype", ["I32", "U32"])
def test_weights_declared_with_another_dtype_are_refused_before_anything_is_applied(
    checkpoint: tuple[Engine, Path], dtype: str
) -> None:
    _, directory = checkpoint
    _rewrite_as(directory / "model.safetensors", "0.weight", dtype)
    _rehash(directory)
    fresh = make_engine(seed=1)
    before = {name: tensor.clone() for name, tensor in fresh.model.state_dict().items()}
    declared = {"I32": "int32", "U32": "uint32"}[dtype]
    with pytest.raises(ConfigError, match=rf"0\.weight', '{declared}', 'float32'"):
        load_checkpoint(fresh, directory)
    assert all(torch.equal(before[name], tensor) for name, tensor in fresh.model.state_dict().items())


def test_bf16_weights_declared_as_float16_are_refused(tmp_path: Path) -> None:
    engine = make_engine()
    engine.model.to(torch.bfloat16)
    engine.optimizer = torch.optim.AdamW(engine.model.parameters(), lr=0.01)
    directory = save_checkpoint(engine, tmp_path / "out")
    _rewrite_as(directory / "model.safetensors", "2.bias", "F16")
    _rehash(directory)
    fresh = make_engine(seed=1)
    fresh.model.to(torch.bfloat16)
    fresh.optimizer = torch.optim.AdamW(fresh.model.parameters(), lr=0.01)
    with pytest.raises(ConfigError, match=r"'2\.bias', 'float16', 'bfloat16'"):
        load_checkpoint(fresh, directory)
    load_checkpoint(fresh, save_checkpoint(engine, tmp_path / "again"))  # its own dtypes load
    assert torch.equal(fresh.model[2].bias, engine.model[2].bias)


def test_weights_of_another_floating_point_precision_are_cast_as_load_state_dict_does(tmp_path: Path) -> None:
    engine = make_engine()
    cio.save_weights(engine.model, tmp_path / "model.safetensors")  # float32
    wide = make_engine(seed=1).model.to(torch.float64)
    cio.load_model_weights(wide, tmp_path)
    assert all(torch.equal(a, b.double()) for a, b in zip(wide.parameters(), engine.model.parameters()))


# -- weights copied in place without load_state_dict's per-module filtering -------------------------
class Recording(torch.nn.Linear):
    """A layer that loads in a way of its own (as BatchNorm does): it must still be asked."""

    seen: ClassVar[list[str]] = []

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        Recording.seen.append(prefix)
        super()._load_from_state_dict(state_dict, prefix, *args)


def test_plain_modules_are_loaded_without_load_state_dict_and_others_through_it(
    checkpoint: tuple[Engine, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    saved, directory = checkpoint
    calls: list[int] = []
    real = torch.nn.Module.load_state_dict
    counting = lambda self, *a, **k: calls.append(1) or real(self, *a, **k)  # noqa: E731
    monkeypatch.setattr(torch.nn.Module, "load_state_dict", counting)
    fresh = make_engine(seed=1)
    load_checkpoint(fresh, directory)
    assert calls == []  # each weight copied in place: no module filters the whole state by prefix
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.state_dict().values(), saved.model.state_dict().values()))

    hooked = make_engine(seed=1)
    hooked.model[2] = Recording(8, 2)
    hooked.optimizer = torch.optim.AdamW(hooked.model.parameters(), lr=0.01)
    Recording.seen.clear()
    load_checkpoint(hooked, directory)
    assert calls and Recording.seen == ["2."]  # its own loading ran
    assert torch.equal(hooked.model[2].weight, saved.model[2].weight)

    pre_hooked, hook_calls = make_engine(seed=1), []  # a hook gets (module, state, prefix, ...)
    pre_hooked.model[0].register_load_state_dict_pre_hook(lambda *args: hook_calls.append(args[2]))
    load_checkpoint(pre_hooked, directory)
    assert hook_calls == ["0."]
