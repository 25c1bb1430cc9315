"""Real transformers families trained across processes (launched by tests/test_loss_protocol.py).

One optimizer step in float64 with a window of 8 uneven sequences split over the ranks; the result
must equal one process's batch of 8 (the loss protocol plus accumulation across ranks).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dist_helpers import run_job_main
from test_loss_protocol import one_step

FAMILIES_ACROSS = ("gpt2", "t5", "bert_tokens")


def families(out: Path) -> dict[str, Any]:
    """Per family: per-device batch 2 x accumulation 2 on 2 processes (a global window of 8)."""
    return {
        family: {name: value.reshape(-1).tolist() for name, value in one_step(family, 2, 2, out / family).items()}
        for family in FAMILIES_ACROSS
    }


JOBS = {"families": families}


if __name__ == "__main__":
    run_job_main(JOBS, sys.argv[1:])
