"""How an epoch's batches are produced."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any


def epoch_iterator(data: Iterable[Any], epoch: int, skip_batches: int) -> Iterator[Any]:
    """The batches of epoch ``epoch`` (0-based), without the first ``skip_batches``.

    Calls ``set_epoch(epoch)`` on the data or its sampler when they have one, so a seeded
    shuffle differs per epoch and is reproducible. This default skips by iterating; a data
    plugin may replace it with one that skips in the sampler without loading the batches.
    """
    for owner in (data, getattr(data, "sampler", None), getattr(data, "batch_sampler", None)):
        set_epoch = getattr(owner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            break
    iterator = iter(data)
    if skip_batches:
        return itertools.islice(iterator, skip_batches, None)
    return iterator


def eval_data(data: Iterable[Any]) -> Iterable[Any]:
    """The batches ``evaluate()`` / ``predict()`` iterate: ``data`` itself.

    Called before EVAL_START / PREDICT_START, so the payload carries what is iterated; a plugin
    replaces it to evaluate this process's share of the data (the distributed plugin does).
    """
    return data
