"""``SeededBatches``: a map-style dataset whose batches, in a worker, start from a seed of their own."""

from __future__ import annotations

import copy
import hashlib
import random
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .generators import find_generators, lazy_generator_owners, reseed

__all__ = ["SeededBatches", "SeededDatasetLoader", "epoch_key", "fetched_dataset", "seeded_loader"]


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

    Generators of their own that the dataset or ``collator`` (the loader's ``collate_fn``, which runs in
    the same worker right after) keep are seeded per batch as well, each from the batch's seed and its
    path (``generators.py``); one they make at their first call in a process (transformers' collators
    with a ``seed``) is made before the batch's draws, then seeded the same way.
    """

    def __init__(self, dataset: Any, seed: int, collator: Any = None) -> None:
        self.dataset = dataset
        self.seed = seed
        self.collator = collator
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
        if torch.utils.data.get_worker_info() is None:
            return self._fetch(indices)
        seed = _batch_seed(self.seed, self.epoch, indices)
        roots = {"dataset": self.dataset, "collate_fn": self.collator}
        _seed_all(seed, roots)
        lazy = len(lazy_generator_owners({"dataset": self.dataset}))
        items = self._fetch(indices)
        if lazy and len(lazy_generator_owners({"dataset": self.dataset})) < lazy:
            _seed_all(seed, roots)  # it made a generator while loading: made again from the batch's seed
            items = self._fetch(indices)
        if self.collator is not None and lazy_generator_owners({"collate_fn": self.collator}):
            self._make_collator_generators(items, seed)
        return items

    def _fetch(self, indices: list[int]) -> list[Any]:
        getitems = getattr(self.dataset, "__getitems__", None)
        return list(getitems(indices)) if callable(getitems) else [self.dataset[i] for i in indices]

    def _make_collator_generators(self, items: list[Any], seed: int) -> None:
        """A collator that makes its generator at its first call in a process (transformers', with a ``seed``)
        is called once on a copy of the batch, its draws put back, so that it has made it; then it is seeded
        from the batch, as it is for every later batch in this worker."""
        state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        try:
            self.collator(copy.deepcopy(items))
        except Exception:  # the real call reports it; this one only made the generator
            pass
        finally:
            random.setstate(state[0])
            np.random.set_state(state[1])
            torch.set_rng_state(state[2])
        for path, generator in find_generators({"collate_fn": self.collator}).items():
            reseed(generator, _batch_seed(seed, 0, [], path))

    def __getattr__(self, name: str) -> Any:  # column_names, features, ...: the wrapped dataset's
        if name in ("dataset", "_epoch", "collator"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _seed_all(seed: int, roots: dict[str, Any]) -> None:
    """Seed this worker's global generators, and the roots' own (each from ``seed`` and its path)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    for path, generator in find_generators(roots).items():
        reseed(generator, _batch_seed(seed, 0, [], path))


def _batch_seed(seed: int, epoch: int, indices: list[int], path: str = "") -> int:
    key = (seed, epoch, [int(i) for i in indices], path) if path else (seed, epoch, [int(i) for i in indices])
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
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


def seeded_loader(loader: Any) -> Any:
    """What to iterate for ``loader``: itself, or for a DataLoader whose workers load a map-style dataset
    in batches and do not fetch through ``SeededBatches``, a loader that does (made once, kept with it).

    The two share the sampler, batch sampler, collator, generator, ``worker_init_fn`` and worker settings,
    so the order and the batches are the loader's; only each batch's random draws in a worker come from its
    own seed (``SeededBatches``), so that a resumed epoch draws what the uninterrupted one drew. Its seed is
    0: the data plugin sets each epoch's key from the states the epoch started from (``epoch_key``).
    """
    if (
        type(loader) is not DataLoader
        or loader.num_workers == 0
        or loader.batch_sampler is None
        or isinstance(loader.dataset, torch.utils.data.IterableDataset | SeededBatches)
    ):
        return loader
    twin = loader.__dict__.get("_trainbus_seeded")
    if twin is None:
        ordered: dict[str, Any] = {"in_order": loader.in_order} if hasattr(loader, "in_order") else {}  # torch >= 2.6
        twin = SeededDatasetLoader(
            SeededBatches(loader.dataset, 0, loader.collate_fn),
            batch_sampler=loader.batch_sampler,
            collate_fn=loader.collate_fn,
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
            **ordered,
        )
        loader.__dict__["_trainbus_seeded"] = twin
    return twin


def epoch_key(epoch: int, start: dict[str, Any] | None) -> int:
    """An epoch's key for a loader ``seeded_loader`` made: from the global torch state the epoch started from
    (a resume draws the epoch again from the same states: ``replay.py``), so it needs no seed of its own."""
    if start is None:
        return epoch
    digest = hashlib.blake2b(start["torch"].numpy().tobytes() + str(epoch).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63
