"""The global random number generators' states: Python's, numpy's, torch's CPU and CUDA ones (read and set
by the data loading that replays them on a resume, and written into checkpoints)."""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import torch

try:  # numpy is optional: its RNG state is saved when it is installed
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every supported torch
    np = None  # type: ignore[assignment]


def rng_state() -> dict[str, Any]:
    """The states of Python's ``random``, numpy's global generator, torch CPU and CUDA generators."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` returned (CUDA states only when CUDA is available)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state_all(list(state["cuda"]))
        else:
            warnings.warn("the checkpoint holds CUDA RNG states but CUDA is not available; not restored", stacklevel=2)


def same_rng_state(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two ``rng_state()`` results are equal (no generator drew in between)."""
    if a["python"] != b["python"] or not torch.equal(a["torch"], b["torch"]):
        return False
    if "numpy" in a and not (a["numpy"][2:] == b["numpy"][2:] and (a["numpy"][1] == b["numpy"][1]).all()):
        return False
    return all(torch.equal(x, y) for x, y in zip(a.get("cuda", ()), b.get("cuda", ()), strict=True))
