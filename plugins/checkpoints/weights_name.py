"""Which file of a checkpoint holds the weights a resume reads: the manifest's ``"weights"``, else model.safetensors.

Its own module so ``io.load_model_weights`` and ``model_part`` (which imports io) both read it without a cycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .safety import DamagedCheckpoint, plain_name

WEIGHTS = "model.safetensors"
OWN_WEIGHTS = "trainbus_weights.safetensors"
MANIFEST_KEY = "weights"


def weights_file(manifest: Mapping[str, Any], listed_in: Path) -> str:
    """The name of a checkpoint's resume weights: the manifest's ``"weights"``, else ``model.safetensors``."""
    name = manifest.get(MANIFEST_KEY, WEIGHTS)
    plain_name(name, listed_in)
    if not str(name).endswith(".safetensors"):
        raise DamagedCheckpoint(f"{listed_in} names {name!r} as its weights, not a .safetensors file")
    return str(name)
