"""Reading a checkpoint's JSON takes memory bounded by the file's size (#29 item 6).

The files are bounded in bytes (safety.MAX_JSON_BYTES) but a parse is not: a 64 MB trainer_state.json
of empty objects took 3.7 GB and 5 minutes to resume. Each file's parse is now estimated from its
bytes (objects, lists, separators) and refused before parsing when it would take more than a
bounded multiple of its size; the refusal is damage, so ``resume_from_checkpoint=True`` falls back.
"""

from __future__ import annotations

import json
import time
import tracemalloc
from pathlib import Path

import pytest

from tests.ckpt_hostile_helpers import make_engine, rehash, same_weights
from trainbus.plugins.checkpoints import history, safety
from trainbus.plugins.checkpoints.checkpoint import resume
from trainbus.plugins.checkpoints.safety import DamagedCheckpoint, parse_bounded_json


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("memory") / "run"
    make_engine(root, max_steps=4).fit()
    return root


@pytest.fixture
def run(template: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(template, tmp_path / "run")
    return tmp_path / "run"


def empty_objects(kilobytes: int) -> bytes:
    count = kilobytes * 1024 // 3
    return b'{"format":"x","records":[' + b",".join([b"{}"] * count) + b"]}"


@pytest.fixture
def small_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    """The floor under which any file parses, made 1 MiB (64 MiB): the files that show the rule stay small."""
    monkeypatch.setattr(safety, "PARSE_FLOOR", 1 << 20)


def test_a_trainer_state_of_empty_objects_is_refused_before_parsing_and_resume_falls_back(run: Path) -> None:
    state_file = run / "checkpoint-4" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    body = json.dumps(state)[:-1] + ', "trial_params": {"x": [' + ",".join(["{}"] * (3 << 20)) + "]}}"
    state_file.write_text(body)  # 9 MB of empty objects: over 400 MB parsed
    rehash(run / "checkpoint-4", "trainer_state.json")
    fresh = make_engine(run, max_steps=4)
    tracemalloc.start()
    began = time.perf_counter()
    try:
        with pytest.warns(UserWarning, match=r"checkpoint-4 .*trainer_state.json would take about \d+ MiB to parse"):
            assert resume(fresh, True) == run / "checkpoint-2"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(body), f"{peak / 2**20:.0f} MiB for a {len(body) / 2**20:.0f} MiB file"
    assert time.perf_counter() - began < 5
    assert fresh.state.global_step == 2 and same_weights(fresh.model, run / "checkpoint-2")


def test_the_bound_is_a_multiple_of_the_size_with_a_floor(small_floor: None) -> None:
    with pytest.raises(DamagedCheckpoint, match=r"x.json would take about \d+ MiB to parse .*objects and lists"):
        parse_bounded_json(empty_objects(256), Path("x.json"))
    assert len(parse_bounded_json(empty_objects(16), Path("x.json"))["records"]) > 5_000  # under the floor
    records = [{"loss": 0.5, "step": i} for i in range(20_000)]  # tiny real records, 440 kB: read
    data = json.dumps({"records": records}, separators=(",", ":")).encode()
    assert safety.parse_cost(data)[0] > 1 << 20
    assert len(parse_bounded_json(data, Path("x.json"))["records"]) == 20_000


def test_many_small_segments_of_empty_objects_are_bounded_together(run: Path, small_floor: None) -> None:
    """Each file under the floor, their sum far over it: the history as a whole is refused."""
    directory = run / "checkpoint-4"
    manifest = json.loads((directory / "manifest.json").read_text())
    names = [history.segment_name(i) for i in range(40)]
    (directory / names[0]).write_bytes(empty_objects(64))
    for name in names[1:]:
        (directory / name).hardlink_to(directory / names[0])
    manifest[history.MANIFEST_KEY] = names
    (directory / "manifest.json").write_text(json.dumps(manifest))
    for name in names:
        rehash(directory, name)
    fresh = make_engine(run, max_steps=4)
    with pytest.warns(UserWarning, match=r"log history .*would take about \d+ MiB to parse"):
        assert resume(fresh, True) == run / "checkpoint-2"
