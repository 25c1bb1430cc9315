"""Jobs test_async_checkpoint_ddp.py launches with torchrun on two gloo processes: asynchronous checkpoints.

``torchrun --standalone --nproc_per_node 2 tests/async_ddp_jobs.py JOB OUT``. The run is ``dist_jobs.py``'s resumed
one (AdamW, float64 token model, uneven -100 padding, 6 steps, a checkpoint every 2), trained by the Trainer with
``save_async`` False and True; every rank writes what it saw to ``OUT/JOB-rank{r}.json``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from dist_helpers import run_job_main
from dist_jobs import (
    RESUMED,
    TRAIN_SIZE,
    CrashAt,
    TokenModel,
    _resumed_config,
    params_of,
    per_device_batch,
    train_set,
    trainer_for,
)

CRASH_AT = 3  # the crashed run dies after checkpoint-2
SLOW_WRITE = 2.0  # seconds crash_slow's writes wait before writing


def on_disk(run: Path) -> dict[str, Any]:
    """What this rank finds in ``run`` now: the complete checkpoints (every file verified), any temporary folder."""
    from trainbus.plugins.checkpoints import verified
    from trainbus.plugins.checkpoints.checkpoint import list_checkpoints

    complete = []
    for step, path in list_checkpoints(run):
        verified.read_manifest(path)  # every listed file's size and hash: raises on a torn checkpoint
        complete.append(step)
    return {"complete": complete, "temporary": sorted(p.name for p in run.iterdir() if ".tmp-" in p.name)}


def background_writes(trainer: Any) -> int:
    from trainbus.plugins.checkpoints.checkpoint import Checkpointing

    plugin = trainer.get_plugin(Checkpointing)
    return -1 if plugin.writer is None else plugin.writer.writes


@contextlib.contextmanager
def slow_writes(seconds: float) -> Iterator[None]:
    """Each background write waits ``seconds`` first: a rank that does not wait for it finds it missing."""
    from trainbus.plugins.checkpoints.writing import PendingCheckpoint

    original = PendingCheckpoint.write

    def slow(self: PendingCheckpoint) -> Path:
        time.sleep(seconds)
        return original(self)

    PendingCheckpoint.write = slow  # type: ignore[method-assign]
    try:
        yield
    finally:
        PendingCheckpoint.write = original  # type: ignore[method-assign]


def runs(out: Path) -> dict[str, Any]:
    """The run synchronously and asynchronously (its writes slow), then asynchronously dying at step CRASH_AT: each
    rank looks at the checkpoints as soon as train() returns (or raises)."""
    results: dict[str, Any] = {"config": RESUMED}
    for name, save_async in (("sync", False), ("async", True)):
        trainer = trainer_for(out / name, *_resumed_config(), save_async=save_async)
        with slow_writes(0.3 if save_async else 0.0):
            output = trainer.train()
        results[name] = {"params": params_of(trainer.model), "log_history": list(trainer.state.log_history),
                         "training_loss": output.training_loss, "on_disk": on_disk(out / name),
                         "writes": background_writes(trainer)}  # fmt: skip
    crashed = trainer_for(out / "crashed", *_resumed_config(), callbacks=[CrashAt(CRASH_AT)], save_async=True)
    try:
        crashed.train()
    except RuntimeError as exc:
        results["crashed"] = {"error": str(exc), "on_disk": on_disk(out / "crashed")}
    results["engine"] = engine_run(out / "engine")
    return results


def engine_run(run: Path, crash_at: int | None = None, seconds: float = 0.3) -> dict[str, Any]:
    """A hand-composed Engine (Distributed, Checkpointing(save_async=True)), its writes slow: nothing but the
    Checkpointing plugin makes the ranks meet after the last write. ``crash_at``: every rank fails at that step."""
    from torch.utils.data import DataLoader

    from trainbus.engine import Engine, Event
    from trainbus.plugins import Checkpointing, Distributed, EpochSampler, default_data_collator

    model = TokenModel()
    loader = DataLoader(train_set(), batch_size=per_device_batch(), sampler=EpochSampler(TRAIN_SIZE, seed=0),
                        collate_fn=default_data_collator)  # fmt: skip
    plugins = [Distributed(), Checkpointing(run, save_strategy="steps", save_steps=2, save_async=True)]
    engine = Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.5), train_data=loader, max_epochs=2, plugins=plugins
    )
    if crash_at is not None:
        engine.on(Event.STEP_END, lambda ev: CrashAt(crash_at).on_step_end(None, ev.engine.state, None))
    with slow_writes(seconds):
        engine.fit()
    return {"on_disk": on_disk(run), "writes": plugins[1].writer.writes}  # type: ignore[attr-defined]


def engine_crash_slow(out: Path) -> dict[str, Any]:
    """crash_slow with a hand-composed Engine: no Preemption plugin handles torchrun's SIGTERM on rank 0."""
    engine_run(out / "engine", crash_at=CRASH_AT, seconds=SLOW_WRITE)
    raise AssertionError("the crash did not happen")


def resume(out: Path) -> dict[str, Any]:
    """The crashed asynchronous run resumed (``resume_from_checkpoint=True``) in a fresh launch, asynchronously."""
    trainer = trainer_for(out / "crashed", *_resumed_config(), save_async=True)
    output = trainer.train(resume_from_checkpoint=True)
    return {"params": params_of(trainer.model), "log_history": list(trainer.state.log_history),
            "training_loss": output.training_loss, "on_disk": on_disk(out / "crashed")}  # fmt: skip


def crash_slow(out: Path) -> dict[str, Any]:
    """The asynchronous run dying at step CRASH_AT on every rank, the error left to end the processes (torchrun then
    stops the ranks still running), checkpoint-2's write slow: rank 0 is still writing when the others fail."""
    trainer = trainer_for(out / "slow", *_resumed_config(), callbacks=[CrashAt(CRASH_AT)], save_async=True)
    with slow_writes(SLOW_WRITE):
        trainer.train()
    raise AssertionError("the crash callback did not fire")


def fsdp(out: Path) -> dict[str, Any]:
    """FSDP2 sharded checkpoints with save_async False and True (the sharded save stays synchronous)."""
    from sharded_jobs import full_params

    config = {"transformer_layer_cls_to_wrap": ["Linear"]}
    results: dict[str, Any] = {}
    for name, save_async in (("fsdp-sync", False), ("fsdp-async", True)):
        trainer = trainer_for(out / name, *_resumed_config(), fsdp=True, fsdp_config=config, save_async=save_async)
        trainer.train()
        results[name] = {"params": full_params(trainer.model), "on_disk": on_disk(out / name),
                         "model": type(trainer.model).__name__}  # fmt: skip
    return results


def resume_and_fsdp(out: Path) -> dict[str, Any]:
    """``resume`` then ``fsdp``, in one launch (one start of the processes less)."""
    return {"resume": resume(out), **fsdp(out)}


JOBS = {
    "runs": runs,
    "resume_and_fsdp": resume_and_fsdp,
    "crash_slow": crash_slow,
    "engine_crash_slow": engine_crash_slow,
}

if __name__ == "__main__":
    run_job_main(JOBS, sys.argv[1:])
