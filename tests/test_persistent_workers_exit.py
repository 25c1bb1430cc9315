"""A run with persistent DataLoader workers exits when it is done.

Workers forked while Preemption runs ignore the process group's SIGTERM (tests/test_sigterm_group.py). The
workers of a persistent pool outlive ``fit()``; at interpreter exit multiprocessing ends them with SIGTERM
and waits: a worker that still ignored it hung the process forever. Outside training they stop as usual.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import sys, torch
from torch.utils.data import DataLoader, TensorDataset
from trainbus.engine import Engine
from trainbus.plugins.checkpoints.checkpoint import Checkpointing
from trainbus.plugins.control.preemption import Preemption

data = TensorDataset(torch.randn(32, 2), torch.randn(32, 1))
loader = DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True)
model = torch.nn.Linear(2, 1)
engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.05), max_steps=4, train_data=loader,
                loss_fn=torch.nn.MSELoss(), plugins=[Checkpointing(sys.argv[1]), Preemption()])
engine.fit()
print("trained", flush=True)
"""


def test_a_run_with_persistent_workers_exits_after_training(tmp_path: Path) -> None:
    run = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tmp_path / "run")], cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        out, err = run.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        out, err = "", "hung at exit"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
    assert "trained" in out and run.returncode == 0, err[-2000:]
