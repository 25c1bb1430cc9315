"""Asynchronous checkpoints on two gloo processes, launched with torchrun as users launch (#36 item 1).

The jobs are ``async_ddp_jobs.py``'s: ``dist_jobs.py``'s AdamW run trained by the Trainer with ``save_async`` False
and True. Rank 0 writes in the background; every rank finds the checkpoints complete when train() returns; a run
that crashed resumes in a fresh launch bit for bit; a rank 0 still writing when every rank fails finishes the write
(the Trainer and a bare Engine: the other ranks wait for rank 0's word through the store); FSDP2's sharded
checkpoints are those of a synchronous run. A hand-composed Engine with Distributed checks that the Checkpointing
plugin itself makes the ranks meet after the last write.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_helpers import launch_job, results, untimed
from test_async_checkpoint import assert_same_checkpoints

JOBS = Path(__file__).with_name("async_ddp_jobs.py")
COMPLETE = {"complete": [2, 4, 6], "temporary": []}


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("async_ddp")
    launch_job(JOBS, "runs", out, 2)
    return out


def test_rank_0_writes_in_the_background_and_every_rank_finds_the_checkpoints_complete(launched: Path) -> None:
    ranks = [results(launched, "runs", rank) for rank in range(2)]
    for rank in ranks:
        done, sync = rank["async"], rank["sync"]
        assert done["on_disk"] == COMPLETE == sync["on_disk"]  # as soon as train() returned, on each rank
        assert done["params"] == sync["params"]  # bit for bit
        assert untimed(done["log_history"]) == untimed(sync["log_history"])
        assert done["training_loss"] == sync["training_loss"]
    assert [rank["async"]["writes"] for rank in ranks] == [3, 0]  # rank 0 wrote them, in the background
    # a bare Engine with Distributed: every rank leaves fit() once rank 0's last write is on disk
    assert [rank["engine"] for rank in ranks] == [
        {"on_disk": COMPLETE, "writes": 3},
        {"on_disk": COMPLETE, "writes": 0},
    ]
    # the run that crashed at step 3: rank 0 finished checkpoint-2's write before train() raised
    assert ranks[0]["crashed"] == {"error": "simulated crash at step 3", "on_disk": {"complete": [2], "temporary": []}}
    assert_same_checkpoints(launched / "sync", launched / "async")
    assert all((launched / "async" / "checkpoint-2" / f"rng-{rank}.json").is_file() for rank in range(2))


@pytest.fixture(scope="module")
def relaunched(launched: Path) -> Path:
    """A fresh launch: the crashed run resumed, then the FSDP2 runs (one start of the processes for both)."""
    launch_job(JOBS, "resume_and_fsdp", launched, 2)
    return launched


def test_the_crashed_run_resumes_bit_exact_in_a_fresh_launch(relaunched: Path) -> None:
    sync = results(relaunched, "runs")["sync"]
    for rank in range(2):
        resumed = results(relaunched, "resume_and_fsdp", rank)["resume"]
        assert resumed["params"] == sync["params"]  # bit for bit
        assert untimed(resumed["log_history"]) == untimed(sync["log_history"])
        assert resumed["training_loss"] == sync["training_loss"]
        assert resumed["on_disk"] == COMPLETE
    assert_same_checkpoints(relaunched / "sync", relaunched / "crashed", steps=(4, 6))


def test_a_write_in_flight_when_every_rank_fails_is_finished(tmp_path: Path) -> None:
    """torchrun stops rank 0 (SIGTERM) once rank 1 has failed; rank 0 is then still writing checkpoint-2."""
    from async_ddp_jobs import on_disk

    launch_job(JOBS, "crash_slow", tmp_path, 2, expect_failure="simulated crash at step 3")
    assert on_disk(tmp_path / "slow") == {"complete": [2], "temporary": []}


def test_a_bare_engines_write_in_flight_when_every_rank_fails_is_finished(tmp_path: Path) -> None:
    """The same without the Trainer: no Preemption plugin turns torchrun's SIGTERM into a flag on rank 0."""
    from async_ddp_jobs import on_disk

    launch_job(JOBS, "engine_crash_slow", tmp_path, 2, expect_failure="simulated crash at step 3")
    assert on_disk(tmp_path / "engine") == {"complete": [2], "temporary": []}  # as a synchronous save leaves it


def test_fsdp2_sharded_checkpoints_with_save_async_equal_synchronous_ones(relaunched: Path) -> None:
    for rank in range(2):
        ran = results(relaunched, "resume_and_fsdp", rank)
        assert ran["fsdp-async"]["model"] == "FSDPTokenModel"  # sharded
        assert ran["fsdp-async"]["on_disk"] == COMPLETE == ran["fsdp-sync"]["on_disk"]
        assert ran["fsdp-async"]["params"] == ran["fsdp-sync"]["params"]
    assert_same_checkpoints(relaunched / "fsdp-sync", relaunched / "fsdp-async")
    assert (relaunched / "fsdp-async" / "checkpoint-2" / "model-rank1.safetensors").is_file()
