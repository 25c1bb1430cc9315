"""Two gloo processes, launched as users launch them, against one process with the same global batch.

The jobs live in ``dist_jobs.py``: a float64 token model with uneven -100 padding across ranks,
trained by the Trainer (torchrun) and by a hand-composed Engine (accelerate launch). One process
runs per-device batch 8, two processes per-device batch 4.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
from dist_helpers import TOL, assert_close, launch_job, results, untimed

from trainbus.engine import ConfigError, Engine
from trainbus.plugins import Checkpointing, Distributed, TrainingArguments
from trainbus.plugins.checkpoints.checkpoint import load_checkpoint
from trainbus.plugins.distributed.sharding import ShardedBatchSampler, shard_eval_loader, shard_train_loader, share

JOBS = Path(__file__).with_name("dist_jobs.py")


def checkpoint_tensors(run: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``checkpoint-N/{model,optimizer}.safetensors`` of a run, by checkpoint and file."""
    found = {}
    for path in sorted(run.glob("checkpoint-*")):
        for name in ("model", "optimizer"):
            found[f"{path.name}/{name}"] = st.load_file(str(path / f"{name}.safetensors"))
    return found


def assert_same_checkpoints(one: Path, two: Path, exact: bool = False) -> None:
    a, b = checkpoint_tensors(one), checkpoint_tensors(two)
    assert sorted(a) == sorted(b) and a, f"checkpoints differ: {sorted(a)} vs {sorted(b)}"
    for name in a:
        assert sorted(a[name]) == sorted(b[name]), name
        for key, tensor in a[name].items():
            if exact:
                assert torch.equal(tensor, b[name][key]), f"{name}:{key}"
            else:
                torch.testing.assert_close(tensor, b[name][key], rtol=0, atol=TOL, msg=f"{name}:{key}")


# -- the Trainer under torchrun ------------------------------------------------------------------------
def test_trainer_on_two_processes_equals_one_process(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    launch_job(JOBS, "facade", one, 1)
    launch_job(JOBS, "facade", two, 2)
    single, ranks = results(one, "facade"), [results(two, "facade", r) for r in range(2)]
    assert single["world_size"] == 1 and [r["world_size"] for r in ranks] == [2, 2]
    assert [r["flags"] for r in ranks] == [[True, True], [False, False]]
    # the ddp_* arguments reach DDP through accelerate
    bucket = 10 * 1024 * 1024
    assert ranks[0]["ddp"] == {
        "wrapper": "DistributedDataParallel", "find_unused_parameters": True, "broadcast_buffers": False,
        "bucket_bytes_cap": bucket,
    }  # fmt: skip
    assert single["ddp"]["wrapper"] == "TokenModel"
    for name, expected in single["configs"].items():
        for rank in ranks:  # SGD and AdamW, with and without accumulation, uneven -100 padding
            got = rank["configs"][name]
            assert_close(got["params"], expected["params"], f"{name} params")
            assert_close(untimed(got["log_history"]), untimed(expected["log_history"]), f"{name} logs")
            assert_close(got["training_loss"], expected["training_loss"], f"{name} training_loss")
        assert_same_checkpoints(one / "runs" / name, two / "runs" / name)
        for rank in range(2):
            assert (two / "runs" / name / "checkpoint-2" / f"rng-{rank}.json").is_file()
        assert (two / "runs" / name / "model.safetensors").is_file()
    # evaluate() and predict() on 101 samples: data-set order, padding duplicates dropped, exact metrics
    for rank in ranks:
        assert_close(untimed([rank["evaluate"]]), untimed([single["evaluate"]]), "evaluate")
        assert_close(rank["predict"]["label_ids"], single["predict"]["label_ids"], "label_ids")
        assert_close(rank["predict"]["predictions"], single["predict"]["predictions"], "predictions")
        assert_close(untimed([rank["predict"]["metrics"]]), untimed([single["predict"]["metrics"]]), "predict")
    assert len(single["predict"]["label_ids"]) == 101
    # only rank 0 writes under output_dir, and every checkpoint file was written once
    assert ranks[1]["writes"] == []
    written = [path for event, path in ranks[0]["writes"] if event in ("open", "safetensors.save_file")]
    assert written and len(written) == len(set(written))


# -- resume in a fresh launch ----------------------------------------------------------------------------
def test_two_process_resume_in_a_fresh_launch_is_bit_exact(tmp_path: Path) -> None:
    from dist_jobs import CRASH_AT_STEP, RESUMED, TRAIN_SIZE

    full, broken = tmp_path / "full", tmp_path / "broken"
    launch_job(JOBS, "facade", full, 2)  # the uninterrupted runs (RESUMED among them)
    launch_job(JOBS, "crash", broken, 2, expect_failure="simulated crash")
    kept = sorted(p.name for p in (broken / "resumed").glob("checkpoint-*"))
    assert kept == ["checkpoint-2"]  # the newest complete checkpoint before the crash
    launch_job(JOBS, "resume", broken, 2)
    reference = results(full, "facade")["configs"][RESUMED]
    for rank in range(2):
        resumed = results(broken, "resume", rank)
        assert resumed["params"] == reference["params"]  # bit for bit
        # every step's logged loss, grad_norm and lr, and the closing summary: its train_loss is the mean over
        # the whole run, as if never interrupted (a resumed HF run's covers only the resumed part)
        assert untimed(resumed["log_history"]) == untimed(reference["log_history"])
        assert resumed["training_loss"] == reference["training_loss"]
        assert [e["step"] for e in resumed["log_history"] if "loss" in e] == list(range(1, 7))
        # resumed at step 2 of 6 (one batch per step): 4 training forwards, the first two batches skipped
        assert CRASH_AT_STEP == 3 and resumed["forwards"] == 2 * math.ceil(TRAIN_SIZE / 8) - 2
    assert_same_checkpoints(full / "runs" / RESUMED, broken / "resumed", exact=True)


# -- preemption: SIGTERM on one rank ------------------------------------------------------------------------
def test_sigterm_on_rank_0_stops_every_rank_at_the_same_step_and_resumes_bit_exact(tmp_path: Path) -> None:
    from dist_jobs import PREEMPTION_EVERY, SIGNAL_AT

    launch_job(JOBS, "preempt", tmp_path, 2)
    ranks = [results(tmp_path, "preempt", r) for r in range(2)]
    stop = SIGNAL_AT + (-SIGNAL_AT) % PREEMPTION_EVERY  # the first agreement step at or after the signal
    for rank in ranks:  # rank 1 got no signal: it learnt of rank 0's at the agreement step
        assert (rank["step"], rank["global_step"], rank["code"], rank["signal"]) == (stop, stop, 143, 15)
        assert rank["checkpoint"] == str(tmp_path / "preempted" / f"checkpoint-{stop}")
        assert rank["restored"]  # the SIGTERM handler from before train() is back
    assert sorted(p.name for p in (tmp_path / "preempted").glob("checkpoint-*")) == [f"checkpoint-{stop}"]
    launch_job(JOBS, "preempt_resume", tmp_path, 2)
    launch_job(JOBS, "preempt_whole", tmp_path, 2)
    for rank in range(2):
        resumed, whole = results(tmp_path, "preempt_resume", rank), results(tmp_path, "preempt_whole", rank)
        assert resumed["params"] == whole["params"]  # bit for bit
        assert untimed(resumed["log_history"]) == untimed(whole["log_history"])
        assert resumed["training_loss"] == whole["training_loss"]


# -- the ranks agree on the data ------------------------------------------------------------------------------
def test_ranks_with_different_data_lengths_all_stop_with_a_clear_error(tmp_path: Path) -> None:
    launch_job(JOBS, "unequal", tmp_path, 2)  # every rank returns (no SIGABRT, no hang)
    for rank in range(2):
        error = results(tmp_path, "unequal", rank)["error"]
        assert error is not None and "the 2 processes disagree on the training data" in error
        assert "samples: rank 0 has 20, rank 1 has 16" in error and "same data set" in error


# -- HF's main_process_first and parallel_mode ----------------------------------------------------------------
def test_main_process_first_runs_the_main_process_body_before_the_others(tmp_path: Path) -> None:
    launch_job(JOBS, "main_first", tmp_path, 2)
    main, other = results(tmp_path, "main_first", 0), results(tmp_path, "main_first", 1)
    assert main["existed_on_entry"] == {"True": False, "False": False}  # rank 0 went first and wrote the file
    assert other["existed_on_entry"] == {"True": True, "False": True}  # rank 1 waited until it was written
    assert main["parallel_mode"] == other["parallel_mode"] == "distributed" and main["world_size"] == 2


# -- a hand-composed Engine under accelerate launch --------------------------------------------------------
def test_engine_with_distributed_plugin_equals_one_process(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    launch_job(JOBS, "engine", one, 1)
    launch_job(JOBS, "engine", two, 2, launcher="accelerate")
    single = results(one, "engine")
    for rank in range(2):
        got = results(two, "engine", rank)
        for steps in ("k1", "k2"):
            assert_close(got[steps]["params"], single[steps]["params"], f"{steps} params")
            assert_close(untimed(got[steps]["log_history"]), untimed(single[steps]["log_history"]), f"{steps} logs")
        assert "global_batch_size=12 cannot be made from per-device batch 4 x 2 processes" in got["global_batch_error"]


# -- in one process: sharding arithmetic and bad set-ups ------------------------------------------------
@pytest.mark.parametrize("size", range(0, 11))
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_shares_partition_each_batch_in_order(size: int, replicas: int) -> None:
    batch = list(range(100, 100 + size))
    shares = [share(batch, replicas, r) for r in range(replicas)]
    assert [i for part in shares for i in part] == batch
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_sharded_loader_gives_each_rank_its_share_of_the_global_batch() -> None:
    from trainbus.plugins import EpochSampler

    data = list(range(20))
    loaders = [
        shard_train_loader(torch.utils.data.DataLoader(data, batch_size=4, sampler=EpochSampler(20, seed=3)), 2, r)
        for r in range(2)
    ]
    one = list(torch.utils.data.DataLoader(data, batch_size=8, sampler=EpochSampler(20, seed=3)))
    for loader in loaders:
        assert isinstance(loader.batch_sampler, ShardedBatchSampler) and len(loader) == len(one) == 3
    for epoch in (0, 1):
        for loader in loaders:
            loader.batch_sampler.set_epoch(epoch)  # type: ignore[union-attr]
        one_epoch = list(torch.utils.data.DataLoader(data, batch_size=8, sampler=_seeded(20, 3, epoch)))
        for joint, a, b in zip(one_epoch, *loaders):
            assert torch.cat([a, b]).tolist() == joint.tolist()
    assert shard_train_loader(loaders[0], 2, 0) is loaders[0]  # already sharded


def _seeded(size: int, seed: int, epoch: int) -> Any:
    from trainbus.plugins import EpochSampler

    sampler = EpochSampler(size, seed)
    sampler.set_epoch(epoch)
    return sampler


def test_a_last_batch_the_processes_cannot_share_fails_before_training() -> None:
    loader = torch.utils.data.DataLoader(list(range(17)), batch_size=4)  # 17 = 2 x 8 + 1
    with pytest.raises(ConfigError, match=r"17 samples in global batches of 8 .* last batch of 1"):
        shard_train_loader(loader, 2, 0)
    dropping = torch.utils.data.DataLoader(list(range(17)), batch_size=4, drop_last=True)
    assert len(shard_train_loader(dropping, 2, 1)) == 2
    with pytest.raises(ConfigError, match="map-style dataset"):
        shard_train_loader([torch.zeros(2)], 2, 0)
    with pytest.raises(ConfigError, match="own batch_sampler"):
        shard_train_loader(torch.utils.data.DataLoader(range(8), batch_sampler=[[0, 1]]), 2, 0)


def test_eval_shards_use_the_distributed_sampler_layout() -> None:
    loader = torch.utils.data.DataLoader(list(range(101)), batch_size=4)
    shards = [shard_eval_loader(loader, 2, r) for r in range(2)]
    assert [len(s.sampler) for s in shards] == [51, 51]  # type: ignore[arg-type]
    assert next(iter(shards[1])).tolist() == [1, 3, 5, 7]
    assert shard_eval_loader(shards[0], 2, 0) is shards[0]


def test_nccl_without_gpus_fails_at_construction() -> None:
    with pytest.raises(ConfigError, match="ddp_backend='nccl' needs CUDA GPUs"):
        TrainingArguments("out", ddp_backend="nccl", use_cpu=True)
    with pytest.raises(ConfigError, match=r"ddp_backend must be one of \['nccl', 'gloo'"):
        TrainingArguments("out", ddp_backend="glooo")
    with pytest.raises(ConfigError, match="ddp_timeout"):
        TrainingArguments("out", ddp_timeout=0)
    args = TrainingArguments("out", ddp_find_unused_parameters=True, ddp_bucket_cap_mb=10, ddp_backend="gloo")
    assert (args.world_size, args.process_index, args.local_process_index) == (1, 0, 0)
    assert args.should_save and args.should_log


def test_bad_ddp_options_fail_at_construction() -> None:
    with pytest.raises(ConfigError, match="bucket_cap_mb must be int"):
        Distributed(bucket_cap_mb="25")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="find_unused_parameters must be bool"):
        Distributed(find_unused_parameters=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="global_batch_size"):
        Distributed(global_batch_size=0)


def test_one_process_plugin_only_sets_the_flags() -> None:
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1))] * 2
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_epochs=1,
                    loss_fn=torch.nn.MSELoss(), plugins=[Distributed()])  # fmt: skip
    assert engine.train_data is data and engine.model is model
    assert engine.fit().global_step == 2 and engine.state.is_world_process_zero


def test_a_checkpoint_from_another_world_size_is_refused(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), max_steps=1, loss_fn=torch.nn.MSELoss(),
                    train_data=[(torch.ones(2, 2), torch.ones(2, 1))],
                    plugins=[Checkpointing(tmp_path, save_strategy="steps", save_steps=1)])  # fmt: skip
    engine.fit()
    manifest = tmp_path / "checkpoint-1" / "manifest.json"
    written = json.loads(manifest.read_text())
    written["world_size"] = 2  # as a 2-process run records it
    manifest.write_text(json.dumps(written))
    with pytest.raises(ConfigError, match=r"written by 2 process\(es\) but this run has 1: resume it with 2"):
        load_checkpoint(engine, tmp_path / "checkpoint-1")


# -- the README's script -------------------------------------------------------------------------------
def test_readme_train_script_runs_under_torchrun(tmp_path: Path) -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    script = next(block for block in readme.split("```python\n") if block.startswith("# train.py"))
    outputs = {}
    for processes in (1, 2):
        run_dir = tmp_path / f"processes-{processes}"  # one run per output_dir: a second run there is refused
        run_dir.mkdir()
        (run_dir / "train.py").write_text(script.split("```")[0])
        command = [sys.executable, "train.py"] if processes == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        lines = [line for line in done.stdout.splitlines() if line.startswith("processes=")]
        assert len(lines) == 1, done.stdout  # printed by rank 0 only
        outputs[processes] = lines[0]
    assert outputs[1].startswith("processes=1") and outputs[2].startswith("processes=2")
    losses = [float(outputs[n].split("eval_loss=")[1]) for n in (1, 2)]
    assert math.isclose(*losses, abs_tol=1e-5)  # the same global batch: the same run (float32)
