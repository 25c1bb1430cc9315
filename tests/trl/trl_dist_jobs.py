"""The SFT script on several processes, launched as users launch it (``torchrun ... trl_dist_jobs.py JOB OUT``).

JOB is ``sft-trl`` or ``sft-trainbus``: the same script with only the import changed; each rank writes its
log history and a digest of the trained weights to ``OUT/JOB-rank{r}.json``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: dist_helpers, conformance

from dist_helpers import run_job_main
from trl_jobs import common_config, sft_script, text_rows


def sft(implementation: str, out: Path) -> dict[str, Any]:
    tokenizer_dir = os.environ["TRL_TOKENIZER_DIR"]  # one tokenizer for every run and rank (made by the test)
    config = common_config(out / implementation, num_train_epochs=1, gradient_accumulation_steps=2,
                           per_device_train_batch_size=2, save_strategy="no")  # fmt: skip
    trainer = sft_script(implementation, tokenizer_dir, "llama", text_rows(24, seed=3), config)
    weights = {k: float(v.double().sum()) for k, v in trainer.model.state_dict().items()}
    return {"log_history": trainer.state.log_history, "weights": weights}


JOBS = {"sft-trl": lambda out: sft("trl", out), "sft-trainbus": lambda out: sft("trainbus", out)}

if __name__ == "__main__":
    run_job_main(JOBS, sys.argv[1:])
