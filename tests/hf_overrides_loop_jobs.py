"""The distributed job of ``test_hf_overrides_loop.py``: a ``_maybe_log_save_evaluate`` override on 1 and 2 processes.

``python tests/hf_overrides_loop_jobs.py override OUT`` trains in one process with per-device batch 8;
``torchrun --standalone --nproc_per_node 2 ...`` on two with per-device batch 4 (``dist_jobs``' model and data:
float64, uneven -100 padding across the ranks). Each rank writes its log history to ``OUT/override-rank{r}.json``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dist_helpers import run_job_main
from dist_jobs import TokenModel, per_device_batch, train_set


def override(out: Path) -> dict[str, Any]:
    from trainbus.plugins import Trainer, TrainingArguments

    class LogsLearningRate(Trainer):
        """super() logs the loss (averaged over the processes) and saves; the override adds a value of its own."""

        def _maybe_log_save_evaluate(
            self, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None
        ):  # type: ignore[no-untyped-def]
            if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
                self.extra = {"lr_x_1000": learning_rate * 1000}
            super()._maybe_log_save_evaluate(
                tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=learning_rate
            )

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if "loss" in logs:
                logs.update(self.extra)
            super().log(logs, start_time)

    args = TrainingArguments(
        output_dir=str(out / "run"), per_device_train_batch_size=per_device_batch(), num_train_epochs=2,
        learning_rate=0.05, optim="adamw_torch", gradient_accumulation_steps=2, logging_steps=1, save_steps=2,
        report_to="none", disable_tqdm=True, use_cpu=True, seed=0, ddp_timeout=120,
    )  # fmt: skip
    trainer = LogsLearningRate(TokenModel(), args, train_dataset=train_set())
    output = trainer.train()
    return {"log_history": list(trainer.state.log_history), "training_loss": output.training_loss,
            "checkpoints": sorted(p.name for p in (out / "run").glob("checkpoint-*"))}  # fmt: skip


if __name__ == "__main__":
    run_job_main({"override": override}, sys.argv[1:])
