"""Jobs that ``test_elastic.py`` launches with torchrun as a cluster would: over two nodes, and with restarts.

``python tests/elastic_jobs.py JOB OUT`` runs JOB in one process (per-device batch 8);
``torchrun --nnodes 2 --nproc_per_node 1 --node_rank R ... tests/elastic_jobs.py JOB OUT`` (twice, one per
simulated node) or ``torchrun --standalone --nproc_per_node 2 --max-restarts 1 ...`` runs it on two processes
(per-device batch 4): the same global batch. Every rank writes its result to ``OUT/JOB-rank{r}.json``.
The model and data are ``dist_jobs``' float64 TokenModel and token sequences.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from dist_helpers import run_job_main
from dist_jobs import forward_counter, params_of, trainer_for

#: 20 samples, global batch 8: 3 steps per epoch, 9 in 3 epochs; checkpoints every 2 steps
EPOCHS, SAVE_STEPS = 3, 2
#: on the first attempt rank 1 kills itself at the end of this step (after checkpoint-4, before checkpoint-6)
KILL_AT = 5


def _trainer(run_dir: Path, callbacks: list[Any] | None = None) -> Any:
    return trainer_for(
        run_dir, "adamw_torch", 0.05, 1, callbacks=callbacks, num_train_epochs=EPOCHS, save_steps=SAVE_STEPS,
        ddp_timeout=60,
    )  # fmt: skip


def _result(trainer: Any, output: Any, **more: Any) -> dict[str, Any]:
    return {
        "params": params_of(trainer.model),
        "log_history": trainer.state.log_history,
        "training_loss": output.training_loss,
        "global_step": output.global_step,
        "world_size": trainer.args.world_size,
        **more,
    }


def nodes(out: Path) -> dict[str, Any]:
    """The run, on however many nodes and processes it was launched (one output_dir per launch)."""
    trainer = _trainer(out / "run")
    output = trainer.train()
    return _result(trainer, output, group_rank=os.environ.get("GROUP_RANK"))


class KillAt:
    """An HF callback: on the first attempt only, rank 1 SIGKILLs itself at the end of step ``step``."""

    def __init__(self, step: int, out: Path) -> None:
        self.step, self.out = step, out

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and state.global_step == self.step and os.environ.get("RANK") == "1":
            (self.out / f"killed-at-{self.step}").write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


def restarted(out: Path) -> dict[str, Any]:
    """The run under ``--max-restarts 1``: killed at step KILL_AT on the first attempt, restarted by torchrun.

    It calls plain ``train()``: the restarted attempt goes on from its last checkpoint by itself.
    """
    counter = forward_counter()
    trainer = _trainer(out / "run", callbacks=[KillAt(KILL_AT, out), counter])
    output = trainer.train()
    return _result(
        trainer, output, forwards=counter.forwards, restarts=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    )


JOBS = {"nodes": nodes, "restarted": restarted}


if __name__ == "__main__":
    run_job_main(JOBS, sys.argv[1:])
