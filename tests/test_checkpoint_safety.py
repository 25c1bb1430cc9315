"""Nothing is read outside a checkpoint directory, and any damage makes a checkpoint 'damaged' (#23, item 4).

Each damage kind is applied to the newest of two checkpoints. Then: listing the directory still
works and lists the intact one; ``resume_from_checkpoint=True`` warns naming the damaged checkpoint
and resumes from the one before (bit for bit its weights and step); the damaged one given as a path
is a clear ConfigError. Kinds that point outside the directory (links, ``..``, absolute names,
devices) point at a byte-identical copy with a matching manifest entry, so following them would
*succeed*: the test records every file opened and fails if one outside the run's directory was.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trainbus.engine import ConfigError, Engine
from trainbus.plugins.checkpoints import io as cio
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, list_checkpoints, resume
from trainbus.plugins.checkpoints.safety import MAX_MANIFEST_BYTES, DamagedCheckpoint

GOOD, BAD = "checkpoint-2", "checkpoint-4"


def make_engine(output_dir: Path, max_steps: int = 4) -> Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    data = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(3)]
    return Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        train_data=data,
        max_steps=max_steps,
        loss_fn=torch.nn.MSELoss(),
        plugins=[Checkpointing(output_dir, save_strategy="steps", save_steps=2)],
    )


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("template") / "run"
    make_engine(root).fit()
    assert [step for step, _ in list_checkpoints(root)] == [2, 4]
    return root


@pytest.fixture
def run(template: Path, tmp_path: Path) -> Path:
    shutil.copytree(template, tmp_path / "run", symlinks=True)
    (tmp_path / "outside").mkdir()
    return tmp_path / "run"


# -- helpers that damage a checkpoint -------------------------------------------------------------
def manifest_of(directory: Path) -> dict[str, Any]:
    return json.loads((directory / cio.MANIFEST).read_text())


def write_manifest(directory: Path, manifest: Any) -> None:
    (directory / cio.MANIFEST).write_text(json.dumps(manifest))


def relist(directory: Path, name: str) -> None:
    """Rewrite the manifest entry of ``name`` to match the file now there (a consistent forgery)."""
    manifest = manifest_of(directory)
    manifest["files"][name] = cio.file_entry(directory / name)
    write_manifest(directory, manifest)


def rewrite_json(name: str, change: Callable[[Any], Any]) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        path = directory / name
        path.write_text(json.dumps(change(json.loads(path.read_text()))))
        relist(directory, name)

    return damage


def truncate(name: str) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        path = directory / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return damage


def flip(name: str) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        data = bytearray((directory / name).read_bytes())
        data[len(data) * 3 // 4] ^= 0x10
        (directory / name).write_bytes(bytes(data))

    return damage


def delete(name: str) -> Callable[[Path], None]:
    return lambda directory: (directory / name).unlink()


def outside(directory: Path) -> Path:
    return directory.parent.parent / "outside"


def link_to_copy(name: str) -> Callable[[Path], None]:
    """``name`` becomes a symlink to an identical file outside the run: following it would verify."""

    def damage(directory: Path) -> None:
        copy = outside(directory) / name
        shutil.move(directory / name, copy)
        (directory / name).symlink_to(copy)

    return damage


def listed_outside(kind: str) -> Callable[[Path], None]:
    """The manifest lists a file outside the checkpoint, with its right size and hash."""

    def damage(directory: Path) -> None:
        secret = outside(directory) / "secret.json"
        secret.write_text('{"format": "trainbus-checkpoint", "data": 1}')
        name = {"dotdot": "../../outside/secret.json", "absolute": str(secret)}[kind]
        manifest = manifest_of(directory)
        manifest["files"][name] = cio.file_entry(secret)
        write_manifest(directory, manifest)

    return damage


def listed_name(name: str, entry: Any = None) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        manifest = manifest_of(directory)
        manifest["files"][name] = entry if entry is not None else {"size": 100, "xxh3_128": "0" * 32}
        write_manifest(directory, manifest)

    return damage


def manifest_field(key: str, value: Any) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        manifest = manifest_of(directory)
        manifest[key] = value
        write_manifest(directory, manifest)

    return damage


def deep(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


def raw_manifest(text: str | bytes) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        path = directory / cio.MANIFEST
        path.write_bytes(text if isinstance(text, bytes) else text.encode())

    return damage


def deep_manifest(directory: Path) -> None:
    """100,000 nested lists: the json module's recursion gives up (RecursionError)."""
    text = json.dumps(manifest_of(directory))[:-1] + ', "note": ' + "[" * 100_000 + "]" * 100_000 + "}"
    (directory / cio.MANIFEST).write_text(text)


def huge_safetensors_header(directory: Path) -> None:
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes((1 << 40).to_bytes(8, "little") + data[8:])
    relist(directory, "model.safetensors")


def fifo(name: str) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        (directory / name).unlink()
        os.mkfifo(directory / name)

    return damage


def directory_instead(name: str) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        (directory / name).unlink()
        (directory / name).mkdir()

    return damage


HUGE_INT_MANIFEST = '{"format": "trainbus-checkpoint", "version": 2, "global_step": ' + "9" * 5000 + ', "files": {}}'


def size_a_string(directory: Path) -> None:
    manifest = manifest_of(directory)
    manifest["files"]["rng.json"]["size"] = str(manifest["files"]["rng.json"]["size"])
    write_manifest(directory, manifest)


def checkpoint_dir_is_a_link(directory: Path) -> None:
    copy = outside(directory) / BAD
    shutil.move(directory, copy)
    directory.symlink_to(copy, target_is_directory=True)


DAMAGE: dict[str, Callable[[Path], None]] = {
    "truncated weights": truncate("model.safetensors"),
    "truncated manifest": truncate(cio.MANIFEST),
    "truncated trainer state": truncate("trainer_state.json"),
    "bit-flipped weights": flip("model.safetensors"),
    "bit-flipped optimizer json": flip("optimizer.json"),
    "bit-flipped optimizer tensors": flip("optimizer.safetensors"),
    "deleted weights": delete("model.safetensors"),
    "deleted rng state": delete("rng.json"),
    "missing manifest": delete(cio.MANIFEST),
    "empty manifest": raw_manifest(b""),
    "manifest not utf-8": raw_manifest(b"\xff\xfe{}"),
    "extra listed file with a wrong hash": listed_name("notes.json", {"size": 2, "xxh3_128": "0" * 32}),
    "weights a symlink to an identical file": link_to_copy("model.safetensors"),
    "manifest a symlink to an identical file": link_to_copy(cio.MANIFEST),
    "optimizer json a symlink": link_to_copy("optimizer.json"),
    "checkpoint directory a symlink": checkpoint_dir_is_a_link,
    "'..' name listed": listed_outside("dotdot"),
    "absolute name listed": listed_outside("absolute"),
    "/dev/zero listed": listed_name("/dev/zero"),
    "'..' alone listed": listed_name(".."),
    "backslash name listed": listed_name("a\\b"),
    "empty name listed": listed_name(""),
    "fifo in place of a file": fifo("rng.json"),
    "directory in place of the weights": directory_instead("model.safetensors"),
    "deeply nested manifest": deep_manifest,
    "deeply nested plugin state (hash matching)": rewrite_json("plugins.json", lambda doc: {**doc, "data": deep(80)}),
    "5000-digit integer in the manifest": raw_manifest(HUGE_INT_MANIFEST),
    "manifest over its size bound": raw_manifest(b" " * (MAX_MANIFEST_BYTES + 1) + b"{}"),
    "huge safetensors header (hash matching)": huge_safetensors_header,
    "manifest a list": raw_manifest("[1, 2]"),
    "files a list": manifest_field("files", ["model.safetensors"]),
    "file entry a string": listed_name("model.safetensors", "big"),
    "size a string": size_a_string,
    "unknown version": manifest_field("version", 99),
    "version a bool": manifest_field("version", True),
    "world_size a string": manifest_field("world_size", "2"),
    "log segments not a list": manifest_field("log_history_segments", "log_history-000000.json"),
    "trainer state a list (hash matching)": rewrite_json("trainer_state.json", lambda state: [state]),
    "plugin states not a dict (hash matching)": rewrite_json("plugins.json", lambda doc: {**doc, "data": 5}),
    "rng state without torch (hash matching)": rewrite_json("rng.json", lambda doc: {**doc, "data": {"python": 1}}),
    "optimizer json of another format (hash matching)": rewrite_json("optimizer.json", lambda d: {**d, "format": "x"}),
}


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Every path os.open / open / io.open is asked to open while the test runs."""
    seen: list[Path] = []

    def recording(real: Any) -> Any:
        def opening(path: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(path, str | os.PathLike):
                seen.append(Path(os.fspath(path)))
            return real(path, *args, **kwargs)

        return opening

    monkeypatch.setattr(os, "open", recording(os.open))
    monkeypatch.setattr(io, "open", recording(io.open))
    monkeypatch.setattr(builtins, "open", recording(builtins.open))
    yield seen


def test_there_are_more_than_25_damage_kinds() -> None:
    assert len(DAMAGE) >= 25


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damage_is_skipped_by_resume_true_and_refused_by_path_reading_nothing_outside(
    run: Path, kind: str, opened: list[Path]
) -> None:
    good_weights = cio.read_tensors(run / GOOD / "model.safetensors", owned=True)
    DAMAGE[kind](run / BAD)
    opened.clear()
    # listing survives a damaged sibling and still sees the intact one
    assert (2, run / GOOD) in list_checkpoints(run)
    fresh = make_engine(run)
    with pytest.warns(UserWarning, match=rf"skipping the damaged checkpoint .*{BAD}"):
        assert resume(fresh, True, run) == run / GOOD
    assert fresh.state.global_step == 2
    for name, tensor in fresh.model.state_dict().items():
        assert torch.equal(tensor, good_weights[name]), name
    with pytest.raises(ConfigError, match=BAD) as refused:
        resume(make_engine(run), run / BAD)
    assert isinstance(refused.value, DamagedCheckpoint)
    escaped = [p for p in opened if not os.path.realpath(p).startswith(os.path.realpath(run) + os.sep)]
    assert not [p for p in escaped if "outside" in str(p) or str(p).startswith("/dev")], escaped


def test_extra_unlisted_files_are_not_damage_and_are_not_read(run: Path, opened: list[Path]) -> None:
    (run / BAD / "notes.txt").write_text("a user's note")
    (run / BAD / "extra.safetensors").symlink_to("/dev/zero")
    opened.clear()
    fresh = make_engine(run)
    assert resume(fresh, True, run) == run / BAD
    assert fresh.state.global_step == 4
    assert not [p for p in opened if p.name in ("notes.txt", "extra.safetensors")]


def test_every_checkpoint_damaged_is_a_clear_error_listing_what_is_there(run: Path) -> None:
    DAMAGE["bit-flipped weights"](run / BAD)
    DAMAGE["missing manifest"](run / GOOD)
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match=r"every checkpoint in .* is damaged.*found:"):
        resume(make_engine(run), True, run)


def test_a_model_index_naming_a_shard_outside_is_refused(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    secret = tmp_path / "secret.safetensors"
    cio.write_tensors(secret, model.state_dict())
    saved = tmp_path / "model"
    saved.mkdir()
    for name in ("../secret.safetensors", str(secret)):
        (saved / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"weight": name}}))
        with pytest.raises(ConfigError, match="not a plain file name"):
            cio.load_model_weights(model, saved)
    (saved / "model.safetensors").symlink_to(secret)
    with pytest.raises(ConfigError, match="symlink"):
        cio.load_model_weights(model, saved)


# -- a same-step re-save killed at any point loses neither copy (#23 item 8) -------------------------
KILL_POINTS = [
    "before moving the old copy aside",
    "between the two renames",
    "after publishing, before removing the old copy",
    "half way through removing the old copy",
]


def _resave_killed(run: Path, point: str) -> None:
    """In a forked child: re-save checkpoint-4 with other contents, and die (os._exit) at ``point``."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            engine = make_engine(run)
            resume(engine, run / BAD)
            engine.optimizer.param_groups[0]["lr"] = 0.5  # type: ignore[union-attr]  # tells the copies apart
            real_replace, real_rmtree, calls = os.replace, shutil.rmtree, {"replace": 0}

            def replace(src: Any, dst: Any) -> None:
                calls["replace"] += 1
                if point == KILL_POINTS[0] and calls["replace"] == 1:
                    os._exit(9)
                real_replace(src, dst)
                if (point == KILL_POINTS[1] and calls["replace"] == 1) or (
                    point == KILL_POINTS[2] and calls["replace"] == 2
                ):
                    os._exit(9)

            def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
                if point == KILL_POINTS[3] and ".old-" in str(path):
                    (Path(path) / "model.safetensors").unlink()
                    os._exit(9)
                real_rmtree(path, *args, **kwargs)

            os.replace, shutil.rmtree = replace, rmtree  # type: ignore[assignment]
            from trainbus.plugins.checkpoints.checkpoint import save_checkpoint

            save_checkpoint(engine, run)
            os._exit(0)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 9, "the child was to die inside the re-save"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked child inside the save")
@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_resave_killed_inside_a_rename_keeps_a_complete_copy_of_that_step(run: Path, point: str) -> None:
    import warnings

    from trainbus.plugins.checkpoints.checkpoint import save_checkpoint

    _resave_killed(run, point)
    fresh = make_engine(run)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no damaged checkpoint to skip: step 4 is there, complete
        assert resume(fresh, True, run) == run / BAD
    assert fresh.state.global_step == 4
    lr = fresh.optimizer.param_groups[0]["lr"]  # type: ignore[union-attr]
    assert lr == (0.01 if point == KILL_POINTS[0] else 0.5)  # the old copy, or the re-save once it was complete
    fresh.state.global_step = 5
    save_checkpoint(fresh, run)  # the next save tidies up: it keeps step 4 and leaves no leftovers
    from trainbus.plugins.checkpoints.checkpoint import rotate_checkpoints

    rotate_checkpoints(run, None)
    assert sorted(p.name for p in run.iterdir()) == [GOOD, BAD, "checkpoint-5"]
    verified_steps = [step for step, _ in list_checkpoints(run)]
    assert verified_steps == [2, 4, 5]
