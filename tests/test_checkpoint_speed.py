"""Fast checkpoints keep their guarantees: hashed once as written, verified on load, durable before the rename.

No timing is asserted here (timing lives in benchmarks/checkpoint_speed.py); these tests pin what the
speed-ups must not change: every file's hash is the hash of its bytes on disk, any change to a file is
caught and named, manifests of older checkpoints (sha256) still verify and load, and every file and the
temporary directory are fsynced before the directory is renamed into place. A load reads and hashes each
file once, and applies nothing to the engine before every listed file has been checked.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import multiprocessing
import os
import random
import re
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

import trainbus.plugins.checkpoints.writing as writing
from trainbus.engine import ConfigError, Engine
from trainbus.plugins.checkpoints import io as cio
from trainbus.plugins.checkpoints import verified
from trainbus.plugins.checkpoints.checkpoint import load_checkpoint, resume, save_checkpoint
from trainbus.plugins.checkpoints.codec import join_tensors, split_tensors
from trainbus.plugins.checkpoints.frozen import base_fingerprint

TENSOR_FILES = ["model.safetensors", "optimizer.safetensors", "plugins.safetensors", "rng.safetensors"]
JSON_FILES = ["optimizer.json", "plugins.json", "rng.json", "trainbus_state.json", "trainer_state.json"]


def make_engine(seed: int = 0) -> Engine:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    data = [(torch.randn(4, 6), torch.randn(4, 2)) for _ in range(2)]
    return Engine(
        model, torch.optim.AdamW(model.parameters(), lr=0.01), train_data=data, max_steps=2, loss_fn=torch.nn.MSELoss()
    )


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Engine, Path]:
    engine = make_engine()
    engine.fit()
    return engine, save_checkpoint(engine, tmp_path / "out")


def manifest_of(directory: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((directory / cio.MANIFEST).read_text())
    return manifest


# -- what the manifest records ---------------------------------------------------------------------
def test_manifest_holds_each_files_size_and_xxh3_of_its_bytes_on_disk(checkpoint: tuple[Engine, Path]) -> None:
    _, directory = checkpoint
    manifest = manifest_of(directory)
    assert manifest["version"] == 2
    assert set(manifest["files"]) == set(TENSOR_FILES + JSON_FILES)
    for name, entry in manifest["files"].items():
        data = (directory / name).read_bytes()
        assert entry == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}, name


def test_writers_return_the_entry_of_what_they_wrote(tmp_path: Path) -> None:
    entries = {
        "t.safetensors": cio.write_tensors(tmp_path / "t.safetensors", {"a": torch.arange(5.0), "b": torch.ones(2, 3)}),
        "j.json": cio.write_json(tmp_path / "j.json", {"x": [1, 2.5, "é"]}),
        "c.json": cio.write_json(tmp_path / "c.json", {"x": [1, 2]}, indent=None),
        "s.txt": cio.write_text(tmp_path / "s.txt", "ünïcode\n"),
        "e.txt": cio.write_text(tmp_path / "e.txt", ""),  # empty: mmap refuses it, the hash must not
    }
    entries["big.safetensors"] = cio.write_tensors(tmp_path / "big.safetensors", {"a": torch.arange(40_000.0)})
    model = torch.nn.Linear(3, 2)
    entries["w.safetensors"] = cio.save_weights(model, tmp_path / "w.safetensors")
    for name, entry in entries.items():
        data = (tmp_path / name).read_bytes()
        assert entry == {"size": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}, name
        assert cio.file_entry(tmp_path / name) == entry
    assert json.loads((tmp_path / "c.json").read_text()) == {"x": [1, 2]}


def test_a_save_hashes_each_tensor_file_once_and_no_json_file_from_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    engine.fit()
    hashed: list[str] = []
    real = cio.digest_file

    def counting(path: Path, *args: Any) -> str:
        hashed.append(path.name)
        digest: str = real(path, *args)
        return digest

    monkeypatch.setattr(cio, "digest_file", counting)
    save_checkpoint(engine, tmp_path)
    assert sorted(hashed) == sorted(TENSOR_FILES)  # JSON from the bytes in hand; the manifest reads nothing back


# -- verification ----------------------------------------------------------------------------------
def _flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", TENSOR_FILES + JSON_FILES)
def test_one_flipped_bit_anywhere_fails_verification_naming_the_file(
    checkpoint: tuple[Engine, Path], name: str
) -> None:
    _, directory = checkpoint
    for at in (0.0, 0.5, 0.999):
        _flip_byte(directory / name, at)
        with pytest.raises(ConfigError, match=rf"{re.escape(name)} does not match its xxh3_128 in .*manifest"):
            verified.read_manifest(directory, verify=True)
        _flip_byte(directory / name, at)  # back
        verified.read_manifest(directory, verify=True)


@pytest.mark.parametrize("name", ["model.safetensors", "rng.json"])
def test_truncated_or_grown_files_fail_verification_naming_the_file(checkpoint: tuple[Engine, Path], name: str) -> None:
    _, directory = checkpoint
    path = directory / name
    data = path.read_bytes()
    for changed in (data[:-1], data + b" "):
        path.write_bytes(changed)
        with pytest.raises(ConfigError, match=rf"{re.escape(name)} has {len(changed)} bytes, the manifest says"):
            load_checkpoint(make_engine(), directory)
    path.write_bytes(data)
    load_checkpoint(make_engine(), directory)


def test_an_entry_without_a_known_hash_or_a_newer_version_is_refused(checkpoint: tuple[Engine, Path]) -> None:
    _, directory = checkpoint
    manifest = manifest_of(directory)
    original = dict(manifest["files"]["rng.json"])
    manifest["files"]["rng.json"] = {"size": original["size"], "md5": "0" * 32}
    (directory / cio.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"lists rng\.json without a size and a hash of \['sha256', 'xxh3_128'\]"):
        verified.read_manifest(directory)
    manifest["files"]["rng.json"] = original
    manifest["version"] = 3
    (directory / cio.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"format version 3; this trainbus reads \[1, 2\]"):
        verified.read_manifest(directory)


def _as_version_1(directory: Path) -> None:
    """Rewrite the manifest as trainbus wrote it before xxh3: version 1, a sha256 per file."""
    manifest = manifest_of(directory)
    manifest["version"] = 1
    manifest["files"] = {
        name: {"size": entry["size"], "sha256": hashlib.sha256((directory / name).read_bytes()).hexdigest()}
        for name, entry in manifest["files"].items()
    }
    (directory / cio.MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def test_a_checkpoint_with_a_sha256_manifest_still_verifies_and_resumes(checkpoint: tuple[Engine, Path]) -> None:
    saved, directory = checkpoint
    _as_version_1(directory)
    fresh = make_engine(seed=1)
    assert resume(fresh, directory) == directory
    assert fresh.state.global_step == 2
    for name, tensor in saved.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], tensor), name
    _flip_byte(directory / "optimizer.safetensors")
    with pytest.raises(ConfigError, match=r"optimizer\.safetensors does not match its sha256"):
        resume(make_engine(), directory)


# -- durability ------------------------------------------------------------------------------------
def test_every_file_and_the_directory_are_fsynced_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine()
    engine.fit()
    synced: list[Path] = []
    real_fsync, real_publish = cio.fsync_path, writing.publish_directory
    published: list[Path] = []

    def recording_fsync(path: Path) -> None:
        real_fsync(path)
        synced.append(path)

    def checked_publish(tmp: Path, final: Path) -> None:
        assert set(tmp.iterdir()) | {tmp} <= set(synced), "a file or the directory was not durable before the rename"
        synced.clear()
        real_publish(tmp, final)
        published.append(final)

    monkeypatch.setattr(cio, "fsync_path", recording_fsync)
    monkeypatch.setattr(writing, "publish_directory", checked_publish)
    final = save_checkpoint(engine, tmp_path)
    assert published == [final]
    assert synced == [tmp_path]  # then the parent, so the rename itself is durable


def test_sync_files_waits_for_every_fsync_and_raises_the_first_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = [f"f{i}" for i in range(6)]
    for name in names:
        (tmp_path / name).write_text(name)
    done: list[str] = []

    def fsync(path: Path) -> None:
        if path.name == "f1":
            raise OSError(5, "I/O error on f1")
        done.append(path.name)

    monkeypatch.setattr(cio, "fsync_path", fsync)
    with pytest.raises(OSError, match="I/O error on f1"):
        cio.sync_files(tmp_path, names)
    assert sorted(done) == sorted([*names[:1], *names[2:], tmp_path.name])  # none was abandoned


def _sync_in_child(directory: str) -> None:
    cio.sync_files(Path(directory), ["a"])


def test_a_forked_child_syncs_with_threads_of_its_own(tmp_path: Path) -> None:
    (tmp_path / "a").write_text("a")
    cio.sync_files(tmp_path, ["a"])  # the parent's pool now has threads; a child has none of them
    child = multiprocessing.get_context("fork").Process(target=_sync_in_child, args=(str(tmp_path),))
    child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        pytest.fail("sync_files in a forked child waited for the parent's threads")
    assert child.exitcode == 0


# -- the codec's fast paths and the frozen base's fingerprint --------------------------------------
def test_plain_sequences_and_integer_arrays_round_trip_and_come_back_as_new_objects(tmp_path: Path) -> None:
    value: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "ints": [1, -2, 3, True, None, "s"],
        "floats": np.array([1.5, np.inf, -np.inf, np.nan], dtype=np.float32),
        "mixed": [1, (2, 3), [torch.ones(2), 4]],
    }
    structure, tensors = split_tensors(value, "x")
    assert structure["ints"] is not value["ints"]
    back = join_tensors(json.loads(json.dumps(structure)), tensors, "x.json")
    assert back["python"] == value["python"]
    assert back["numpy"][0] == "MT19937" and np.array_equal(back["numpy"][1], value["numpy"][1])
    assert back["numpy"][1].dtype == value["numpy"][1].dtype and back["numpy"][2:] == value["numpy"][2:]
    assert back["ints"] == value["ints"]
    assert np.array_equal(back["floats"], value["floats"], equal_nan=True) and back["floats"].dtype == np.float32
    assert back["mixed"][:2] == [1, (2, 3)] and torch.equal(back["mixed"][2][0], torch.ones(2))
    random.setstate(back["python"])
    first = random.random()
    random.setstate(value["python"])
    assert random.random() == first


def test_frozen_base_fingerprint_is_the_sha256_of_names_dtypes_shapes_and_bytes() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[0].requires_grad_(False)
    model[0].weight.data = model[0].weight.data.to(torch.bfloat16)
    expected = hashlib.sha256()
    for name in ("0.bias", "0.weight"):
        tensor = dict(model.named_parameters())[name].detach()
        expected.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        expected.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    fingerprint = base_fingerprint(model)
    assert fingerprint is not None
    assert fingerprint["digest"] == expected.hexdigest() and fingerprint["elements"] == 16


# -- the benchmark runs ----------------------------------------------------------------------------
def test_checkpoint_benchmark_runs_every_row(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import checkpoint_speed

    results = checkpoint_speed.main(["--jobs", "tiny", "--rounds", "2"])
    times = results["tiny"]
    assert set(times) == set(checkpoint_speed.AGAINST)
    assert all(len(row) == 2 and all(t > 0 for t in row) for row in times.values())
    table = capsys.readouterr().out
    assert "trainbus save_checkpoint" in table and "x save_file + fsync" in table
    assert "x load_file + into place" in table  # issue 23 item 11's baseline: copies into memory in use, no hash


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc to list file mappings")
def test_a_resumed_run_keeps_no_mapping_of_the_checkpoint_it_loaded(tmp_path: Path) -> None:
    from tests.facade_helpers import Regressor, quiet_args, regression_data
    from trainbus.plugins import Trainer

    def trainer(max_steps: int) -> Trainer:
        args = quiet_args(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=2, save_total_limit=1)
        return Trainer(Regressor(), args, train_dataset=regression_data(32))

    trainer(2).train()
    resumed = trainer(6)
    resumed.train(resume_from_checkpoint=True)  # rotation deletes checkpoint-2, the one it loaded
    assert not (tmp_path / "checkpoint-2").exists()
    maps = Path("/proc/self/maps").read_text()
    assert "checkpoint-2" not in maps  # the optimizer state is a copy: no deleted file held on disk


# -- loading: each file read once, nothing applied before every file is checked --------------------
def _engine_snapshot(engine: Engine) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """The model's weights, the optimizer's state tensors and the global step, copied."""
    assert engine.optimizer is not None
    weights = {name: tensor.clone() for name, tensor in engine.model.state_dict().items()}
    _, optimizer = split_tensors(engine.optimizer.state_dict())
    return weights, {key: tensor.clone() for key, tensor in optimizer.items()}, engine.state.global_step


def test_a_load_opens_and_hashes_each_listed_file_once(
    checkpoint: tuple[Engine, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, directory = checkpoint
    opened: list[str] = []
    hashed: list[str] = []

    def counting_open(real: Any) -> Any:
        def opening(path: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(path, str | os.PathLike) and Path(path).parent == directory:
                opened.append(Path(path).name)
            return real(path, *args, **kwargs)

        return opening

    def counting_hash(name: str) -> Any:
        real = cio.HASHES[name]
        return lambda *data: hashed.append(name) or real(*data)

    monkeypatch.setattr(os, "open", counting_open(os.open))
    monkeypatch.setattr(io, "open", counting_open(io.open))  # Path.read_bytes() and the open() builtin
    monkeypatch.setattr(builtins, "open", counting_open(builtins.open))
    monkeypatch.setattr(cio, "HASHES", {name: counting_hash(name) for name in cio.HASHES})
    load_checkpoint(make_engine(seed=1), directory)
    assert sorted(opened) == sorted([cio.MANIFEST, *TENSOR_FILES, *JSON_FILES])  # none twice (safetensors' own
    assert hashed == ["xxh3_128"] * len(TENSOR_FILES + JSON_FILES)  # opens of a file it loads are not seen)


@pytest.mark.parametrize("name", TENSOR_FILES + JSON_FILES)
def test_a_damaged_file_fails_the_load_before_anything_is_applied(checkpoint: tuple[Engine, Path], name: str) -> None:
    saved, directory = checkpoint
    fresh = make_engine(seed=1)
    fresh.fit()  # a state of its own, that a failed load must leave as it is
    fresh.state.global_step = 7
    before = _engine_snapshot(fresh)
    in_checkpoint = _engine_snapshot(saved)
    assert not any(torch.equal(before[1][key], in_checkpoint[1][key]) for key in before[1] if "exp_avg" in key)
    _flip_byte(directory / name, 0.99)
    with pytest.raises(ConfigError, match=rf"{re.escape(name)} does not match its xxh3_128"):
        load_checkpoint(fresh, directory)
    after = _engine_snapshot(fresh)
    for saved, kept in zip(before[:2], after[:2], strict=True):
        assert saved.keys() == kept.keys() and all(torch.equal(saved[key], kept[key]) for key in saved)
    assert after[2] == 7


def test_a_listed_file_the_load_does_not_read_is_checked_too(checkpoint: tuple[Engine, Path]) -> None:
    _, directory = checkpoint
    extra = directory / "notes.json"
    manifest = manifest_of(directory)
    manifest["files"]["notes.json"] = cio.write_json(extra, {"note": "kept by a newer writer"})
    (directory / cio.MANIFEST).write_text(json.dumps(manifest))
    load_checkpoint(make_engine(seed=1), directory)
    _flip_byte(extra)
    with pytest.raises(ConfigError, match=r"notes\.json does not match its xxh3_128"):
        load_checkpoint(make_engine(seed=1), directory)


def test_a_file_the_manifest_does_not_list_is_not_read(checkpoint: tuple[Engine, Path]) -> None:
    _, directory = checkpoint
    manifest = manifest_of(directory)
    del manifest["files"]["plugins.json"]
    (directory / cio.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"plugins\.json is not listed in .*manifest\.json"):
        load_checkpoint(make_engine(seed=1), directory)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_in_place_of_a_file_is_refused_without_waiting_for_a_writer(checkpoint: tuple[Engine, Path]) -> None:
    _, directory = checkpoint
    (directory / "rng.json").unlink()
    os.mkfifo(directory / "rng.json")
    errors: list[str] = []

    def load() -> None:
        for read in (
            lambda: load_checkpoint(make_engine(seed=1), directory),
            lambda: cio.read_json(directory / "rng.json"),
        ):
            try:
                read()
            except ConfigError as exc:
                errors.append(str(exc))

    loader = threading.Thread(target=load, daemon=True)  # a blocked open() would hang here, not the suite
    loader.start()
    loader.join(timeout=30)
    assert not loader.is_alive(), "opening a FIFO in place of a checkpoint file waited for a writer"
    assert len(errors) == 2
    assert re.search(r"rng\.json listed in .* is missing", errors[0]) and re.search(r"rng\.json is missing", errors[1])


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc to list file mappings")
def test_a_loaded_optimizer_state_owns_its_memory_tensor_by_tensor(checkpoint: tuple[Engine, Path]) -> None:
    saved, directory = checkpoint
    fresh = make_engine(seed=1)
    load_checkpoint(fresh, directory)
    assert str(directory) not in Path("/proc/self/maps").read_text()  # nothing of the file stays mapped
    assert fresh.optimizer is not None and saved.optimizer is not None
    state = [t for s in fresh.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr() for t in state}
    assert len(storages) == len(state)  # one storage each: a later save writes them without copying
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in state)
    for param_state, saved_state in zip(fresh.optimizer.state.values(), saved.optimizer.state.values(), strict=True):
        for key, value in saved_state.items():
            assert torch.equal(param_state[key], value), key


@pytest.mark.parametrize("path", ["pread", "mapped and cloned", "mapped and cloned (safetensors < 0.8)"])
def test_owned_tensors_are_copies_whichever_way_they_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    if path == "pread" and not cio._PREAD:
        pytest.skip("this safetensors has no pread backend")
    if path != "pread":
        monkeypatch.setattr(cio, "_PREAD_MAX", -1)
    if path.endswith("< 0.8)"):
        monkeypatch.setattr(cio, "_PREAD", False)
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16), "e": torch.empty(0)}
    cio.write_tensors(tmp_path / "t.safetensors", tensors)
    loaded = cio.read_tensors(tmp_path / "t.safetensors", owned=True)
    assert all(torch.equal(loaded[key], tensors[key]) and loaded[key].dtype == tensors[key].dtype for key in tensors)
    loaded["a"].add_(1)  # writable, and written to memory of its own
    assert torch.equal(cio.read_tensors(tmp_path / "t.safetensors")["a"], tensors["a"])
    if Path("/proc/self/maps").exists():
        assert str(tmp_path) not in Path("/proc/self/maps").read_text()


def test_a_bundle_whose_json_refers_to_no_tensor_is_checked_but_not_loaded(
    checkpoint: tuple[Engine, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, directory = checkpoint
    loaded: list[str] = []
    real = cio.read_tensors

    def recording(path: Path, **kwargs: Any) -> dict[str, torch.Tensor]:
        loaded.append(path.name)
        return real(path, **kwargs)

    monkeypatch.setattr(cio, "read_tensors", recording)
    load_checkpoint(make_engine(seed=1), directory)
    assert sorted(loaded) == ["model.safetensors", "optimizer.safetensors", "rng.safetensors"]  # plugins: none


def test_files_returned_in_pieces_by_read_are_read_whole(
    checkpoint: tuple[Engine, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    saved, directory = checkpoint
    expected = cio.read_bundle(directory, "rng")
    real_read, asked = os.read, []

    def short_read(fd: int, size: int) -> bytes:
        asked.append(size)
        return real_read(fd, min(size, 100))

    monkeypatch.setattr(os, "read", short_read)
    fresh = make_engine(seed=1)
    rng = load_checkpoint(fresh, directory)
    assert max(asked) > 100  # some file came in pieces
    assert fresh.state.global_step == saved.state.global_step
    assert rng["python"] == expected["python"] and torch.equal(rng["torch"], expected["torch"])
