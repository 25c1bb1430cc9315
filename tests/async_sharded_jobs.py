"""Jobs of tests/test_async_sharded.py: FSDP2 on 2 gloo CPU processes with asynchronous checkpoints.

``torchrun --nproc_per_node 2 tests/async_sharded_jobs.py JOB OUT``; every rank writes what it saw to
``OUT/JOB-rank{r}.json``. The model and data are ``dist_jobs.py``'s float64 token model.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from dist_helpers import run_job_main
from dist_jobs import trainer_for
from sharded_jobs import full_params

OPTIONS: dict[str, Any] = {"fsdp": True, "fsdp_config": {"transformer_layer_cls_to_wrap": ["Linear"]},
                           "save_total_limit": 2}  # fmt: skip


def _run(out: Path, save_async: bool, resume: bool = False) -> dict[str, Any]:
    trainer = trainer_for(out, "adamw_torch", 0.05, 1, save_async=save_async, **OPTIONS)
    writers: set[str] = set()
    if save_async:  # which threads wrote the rank's files: the writer's, not the training thread
        from trainbus.plugins.checkpoints import sharded_async

        real = sharded_async.cio.write_tensors

        def recording(path: Path, tensors: Any) -> Any:
            writers.add(threading.current_thread().name)
            return real(path, tensors)

        sharded_async.cio.write_tensors = recording  # type: ignore[assignment]
    output = trainer.train(resume_from_checkpoint=True if resume else None)
    found = sorted(p.name for p in out.iterdir()) if int(os.environ.get("RANK", "0")) == 0 else []
    return {"params": full_params(trainer.model), "training_loss": output.training_loss, "entries": found,
            "writers": sorted(writers), "global_step": trainer.state.global_step}  # fmt: skip


def both(out: Path) -> dict[str, Any]:
    """The same FSDP2 run with synchronous and with asynchronous checkpoints, then the async run's older
    checkpoint resumed (async) in the same launch."""
    results = {"sync": _run(out / "sync", False), "async": _run(out / "async", True)}
    if int(os.environ.get("RANK", "0")) == 0:  # the older of the two save_total_limit keeps
        oldest = min((p for p in (out / "async").glob("checkpoint-*")), key=lambda p: int(p.name.split("-")[1]))
        shutil.rmtree(out / "resumed", ignore_errors=True)
        shutil.copytree(oldest, out / "resumed" / oldest.name)
    torch.distributed.barrier()
    results["resumed"] = _run(out / "resumed", True, resume=True)
    return results


JOBS = {"both": both}

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    run_job_main(JOBS, sys.argv[1:])
