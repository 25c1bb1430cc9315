"""Asynchronous checkpoints of an FSDP2 run (2 gloo CPU processes, torchrun): every rank writes its part in the
background, rank 0 publishes once all parts are on disk, and the checkpoints equal a synchronous run's."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_helpers import launch_job, results

from trainbus.plugins.checkpoints.verified import read_manifest

JOBS = Path(__file__).with_name("async_sharded_jobs.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("async_fsdp")
    launch_job(JOBS, "both", out, 2, timeout=420)
    return out


def test_async_fsdp2_checkpoints_equal_sync_ones_file_for_file(runs: Path) -> None:
    seen = results(runs, "both")
    assert seen["async"]["entries"] == seen["sync"]["entries"]  # the same checkpoints kept, nothing half-written
    assert not any(".tmp-" in name for name in seen["async"]["entries"])
    for name in seen["sync"]["entries"]:
        if not name.startswith("checkpoint-"):
            continue
        sync, async_ = read_manifest(runs / "sync" / name), read_manifest(runs / "async" / name)
        assert async_["world_size"] == 2 and async_["sharded"] == "fsdp2"
        assert sorted(async_["files"]) == sorted(sync["files"]), name
        for file, entry in sync["files"].items():
            if file.endswith(".safetensors") or file == "shards.json":  # tensors and the index: bit for bit
                assert async_["files"][file] == entry, (name, file)
    assert seen["async"]["params"] == seen["sync"]["params"]


def test_every_rank_writes_its_part_on_the_writer_thread(runs: Path) -> None:
    for rank in (0, 1):
        assert results(runs, "both", rank)["async"]["writers"] == ["trainbus-checkpoint-writer"]


def test_an_async_fsdp2_checkpoint_resumes_bit_exactly(runs: Path) -> None:
    seen = results(runs, "both")
    assert seen["resumed"]["global_step"] == seen["async"]["global_step"]
    assert seen["resumed"]["params"] == seen["async"]["params"]
