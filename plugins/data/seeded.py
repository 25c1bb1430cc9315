"""``SeededBatches``: a map-style dataset whose batches, in a worker, start from a seed of their own."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["SeededBatches", "SeededDatasetLoader", "fetched_dataset"]


class SeededBatches(Dataset[Any]):
    """A map-style dataset whose batches, when a worker loads them, start from their own seed.

    Worker ``i`` of a plain DataLoader seeds its RNGs once per epoch and draws from them for every
    batch it loads, so what a random transform or collator draws depends on which worker got the
    batch and on what that worker loaded before. A resumed run skips the epoch's first batches, the
    rest are dealt to the workers differently, and every draw moves. Here a worker seeds torch,
    ``random`` and numpy for each batch from ``(seed, epoch, the batch's indices)`` before loading
    it (and before the collator runs, in the same worker): draws differ from batch to batch and from
    epoch to epoch, and do not depend on the worker count or on where the epoch resumed. In the main
    process (no workers) nothing is reseeded: the training RNG is left alone. The epoch lives in shared
    memory: persistent workers, started at an earlier epoch, read the current one too.
    """

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)  # workers read it as they load (set between epochs, when they are idle)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        if torch.utils.data.get_worker_info() is not None:
            seed = _batch_seed(self.seed, self.epoch, indices)
            random.seed(seed)
            np.random.seed(seed % 2**32)
            torch.manual_seed(seed)
        getitems = getattr(self.dataset, "__getitems__", None)
        return list(getitems(indices)) if callable(getitems) else [self.dataset[i] for i in indices]

    def __getattr__(self, name: str) -> Any:  # column_names, features, ...: the wrapped dataset's
        if name in ("dataset", "_epoch"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _batch_seed(seed: int, epoch: int, indices: list[int]) -> int:
    digest = hashlib.blake2b(repr((seed, epoch, [int(i) for i in indices])).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


class SeededDatasetLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader whose workers fetch through ``SeededBatches`` while its ``.dataset`` is the user's dataset.

    transformers' loaders hold the dataset they were given (``trainer.get_train_dataloader().dataset``); the
    wrapper that seeds each batch in a worker is what this loader's iterators fetch from (``fetched_dataset``).
    """

    _fetching = False

    @property  # type: ignore[override]
    def dataset(self) -> Any:
        fetched = self.__dict__["_fetched"]
        return fetched if self._fetching else fetched.dataset

    @dataset.setter
    def dataset(self, value: Any) -> None:  # DataLoader.__init__ sets it once, with the SeededBatches
        self.__dict__["_fetched"] = value

    def _get_iterator(self) -> Any:
        self._fetching = True  # the iterator (and the workers it starts) read loader.dataset now
        try:
            return super()._get_iterator()
        finally:
            self._fetching = False


def fetched_dataset(loader: Any) -> Any:
    """What ``loader``'s batches are fetched from: its ``SeededBatches`` where it has one, else ``loader.dataset``."""
    if isinstance(loader, SeededDatasetLoader):
        return loader.__dict__["_fetched"]
    return getattr(loader, "dataset", None)
