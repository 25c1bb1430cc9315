"""A run's identity: an id written when the run starts, kept by its resumes, in every checkpoint and log record.

"Is this the same run?" used to be answered by comparing what a checkpoint holds with the engine (the
state, a few weights): a checkpoint with nothing comparable (no log history, other parameter names)
differed in nothing and passed for the run's own. Now ``state.run_id`` says it: a random id set the
first time a run needs one (its TRAIN_START, or a log record written before it), saved in the trainer
state (``trainbus_state.json``) and in the checkpoint's manifest, loaded back by a resume, and written into
every record of the JSON lines and CSV sinks. Two runs share it only when one resumed the other (a
restart, a resume of the run's own checkpoint); a run that starts anew, or a branch the Checkpointing
plugin judges a new run (``lineage.py``), gets another. Checkpoints written before ids (older releases)
have none, and are judged as before, conservatively.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

from trainbus.engine import State

from . import verified
from .safety import DamagedCheckpoint

__all__ = ["RUN_ID", "MANIFEST_KEY", "checkpoint_run_id", "new_run_id", "run_id", "valid_run_id"]

#: the form of an id trainbus writes (a uuid4's 32 hex digits); a checkpoint holding another is damaged
RUN_ID = re.compile(r"^[0-9a-f]{32}$")
#: the manifest field that holds the id (read without the trainer state: ``checkpoint_run_id``)
MANIFEST_KEY = "run_id"


def new_run_id() -> str:
    """A fresh id: 128 random bits, hex (two runs never draw the same)."""
    return uuid.uuid4().hex


def valid_run_id(value: Any) -> bool:
    """Whether ``value`` is an id as trainbus writes them."""
    return isinstance(value, str) and RUN_ID.match(value) is not None


def run_id(state: State) -> str:
    """The run's id, set now if the run has none yet (a fresh run, or one resumed from an older release)."""
    if state.run_id is None:
        state.run_id = new_run_id()
    return state.run_id


def checkpoint_run_id(checkpoint: Path) -> str | None:
    """The id a checkpoint's manifest names; None for one written before ids, or one whose manifest does not read."""
    try:
        value = verified.read_manifest(checkpoint, verify=False).get(MANIFEST_KEY)
    except (DamagedCheckpoint, OSError, ValueError):
        return None
    return value if valid_run_id(value) else None
