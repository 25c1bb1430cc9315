"""The random number generators' states: Python's, numpy's, torch's CPU and CUDA global ones, and those of
their own that the data being loaded keeps (read and set by the data loading that replays them on a resume,
and written into checkpoints).

The data plugin names the objects of the loader it trains on (``track_data``): its dataset, collator and
samplers. Their own generators (``generators.py``) are read with the global ones (``"own"``: by path) and
set with them, so the epoch's start, a batch in flight and a checkpoint each carry them, as they carry the
global ones: a dataset's or a collator's own draws are made again on a resume, as global ones are.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from .generators import find_generators, generator_state, restore_generators

try:  # numpy is optional: its RNG state is saved when it is installed
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with every supported torch
    np = None  # type: ignore[assignment]


#: the loading objects whose own generators are read and set with the global ones (``track_data``)
_tracked: dict[str, Any] = {}


def track_data(roots: dict[str, Any]) -> None:
    """Read and set the own generators of these objects (``{"dataset": ..., "collate_fn": ...}``) from now on."""
    _tracked.clear()
    _tracked.update({name: root for name, root in roots.items() if root is not None})


def tracked_data() -> dict[str, Any]:
    return dict(_tracked)


def rng_state() -> dict[str, Any]:
    """The states of Python's ``random``, numpy's global generator, torch CPU and CUDA generators, and
    (``"own"``) those of the tracked data's own generators, by path."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if _tracked:
        own = find_generators(_tracked)
        if own:
            state["own"] = {path: generator_state(g) for path, g in own.items()}
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
    own = state.get("own")
    if own and _tracked:
        restore_generators(_tracked, own)


def same_rng_state(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two ``rng_state()`` results are equal (no generator drew in between)."""
    if a["python"] != b["python"] or not torch.equal(a["torch"], b["torch"]):
        return False
    if "numpy" in a and not (a["numpy"][2:] == b["numpy"][2:] and (a["numpy"][1] == b["numpy"][1]).all()):
        return False
    if not all(torch.equal(x, y) for x, y in zip(a.get("cuda", ()), b.get("cuda", ()), strict=True)):
        return False
    return _same_own(a.get("own", {}), b.get("own", {}))


def _same_own(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    for path, x in a.items():
        y = b[path]
        if x["kind"] != y["kind"]:
            return False
        if x["kind"] == "torch":
            if not torch.equal(x["state"], y["state"]):
                return False
        elif x["kind"] == "numpy-legacy":
            if not (x["state"][2:] == y["state"][2:] and (x["state"][1] == y["state"][1]).all()):
                return False
        elif x["state"] != y["state"]:
            return False
    return True
