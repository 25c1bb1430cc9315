"""The random number generators' states a checkpoint carries: Python's, numpy's, torch's CPU and CUDA ones.

The states themselves are read and set in ``data/rng.py`` (the data loading replays them on a resume).
"""

from __future__ import annotations

from typing import Any

from ..data.rng import rng_state as rng_state
from ..data.rng import same_rng_state as same_rng_state
from ..data.rng import set_rng_state as set_rng_state


def checkpoint_rng_state(engine: Any) -> dict[str, Any]:
    """This process's RNG states for a checkpoint, with

    * ``in_flight``: the states as the batch fetched ahead of this step started being made
      (``engine.rng_in_flight``, set by a loader that fetches one ahead and draws in this process), so a
      resume makes that batch again from the same draws;
    * ``epoch_start``: the states the epoch's data order was drawn from (``engine.rng_epoch_start``, set
      by the data plugin: ``data/replay.py``), so a resume draws the same order again;
    * ``evaluated``: an evaluation ran before (its persistent worker pool was started then, drawing a seed),
      so a resumed run starts that pool again without drawing (``ResumableData``).
    """
    state = rng_state()
    in_flight = getattr(engine, "rng_in_flight", None)
    if in_flight is not None:
        state["in_flight"] = in_flight
    epoch_start = getattr(engine, "rng_epoch_start", None)
    if epoch_start is not None:
        state["epoch_start"] = epoch_start
    if getattr(engine, "rng_evaluated", False):
        state["evaluated"] = True
    return state
