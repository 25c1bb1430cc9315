"""The random number generators' states a checkpoint carries: Python's, numpy's, torch's CPU and CUDA ones.

The states themselves are read and set in ``data/rng.py`` (the data loading replays them on a resume).
"""

from __future__ import annotations

from typing import Any

from ..data.rng import rng_state as rng_state
from ..data.rng import same_rng_state as same_rng_state
from ..data.rng import set_rng_state as set_rng_state


def checkpoint_rng_state(engine: Any) -> dict[str, Any]:
    """This process's RNG states for a checkpoint, with ``in_flight``: the states as the batch fetched ahead
    of this step started being made (``engine.rng_in_flight``, set by a loader that fetches one ahead and
    draws in this process), so a resume makes that batch again from the same draws."""
    state = rng_state()
    in_flight = getattr(engine, "rng_in_flight", None)
    if in_flight is not None:
        state["in_flight"] = in_flight
    return state
