"""The torchrun launch this process belongs to, which a checkpoint's manifest records."""

from __future__ import annotations

import os
import socket


def torchelastic_run() -> str | None:
    """The torchrun launch this process belongs to, the same across its restarts; None outside torchrun.

    torchrun's ``--rdzv-id`` (a fresh uuid under ``--standalone``). Without one (``none``: a static
    rendezvous), the agent that started this worker, host and pid: the restarts of a launch keep it
    on the node of rank 0, which alone writes checkpoints. A checkpoint's manifest records it, so a
    restarted worker knows the checkpoints its launch wrote (``resuming.resume_after_restart``).
    """
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None:
        return None
    return run if run not in ("", "none") else f"{socket.gethostname()}:{os.getppid()}"
