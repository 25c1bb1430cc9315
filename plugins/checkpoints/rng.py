"""The random number generators' states a checkpoint carries: Python's, numpy's, torch's CPU and CUDA ones."""

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
