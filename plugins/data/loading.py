"""Data for the facade: seeded data loaders, resumable epochs (collators and column removal: collators.py).

* ``EpochSampler``: a shuffle seeded by ``seed + epoch``: the same order for an epoch in any process.
* ``ResumableData``: a plugin whose ``epoch_iterator`` skips already-consumed batches in the batch
  sampler, so a mid-epoch resume does not load them (D3); with ``ignore_data_skip=True`` the resumed
  epoch starts again from its first batch instead (HF's ``ignore_data_skip``).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, SequentialSampler

from trainbus.engine import ConfigError, Event, Plugin, Priority

if TYPE_CHECKING:
    from trainbus.engine import Engine, TrainStartEvent

from .collators import (
    Collator,
    DataCollatorWithPadding,
    RemoveColumnsCollator,
    default_data_collator,
    is_tokenizer_like,
    remove_unused_columns,
    signature_columns,
)
from .rng import rng_state, same_rng_state, set_rng_state


class EpochSampler(Sampler[int]):
    """A random permutation seeded by ``seed + epoch``: reproducible per epoch, independent of global RNG.

    Example:
        >>> s = EpochSampler(5, seed=0)
        >>> s.set_epoch(1); a = list(s); s.set_epoch(1); a == list(s)
        True
    """

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        yield from torch.randperm(self.size, generator=generator).tolist()
        # a finished pass moves on by itself (as accelerate's seedable sampler does): a loader that
        # wraps this one and does not forward set_epoch still gets a new order every epoch
        self.epoch += 1


class _SkipBatchSampler(Sampler[list[int]]):
    """The batches of ``inner`` after the first ``skip``: indices only, no example is loaded."""

    def __init__(self, inner: Iterable[list[int]], skip: int, length: int) -> None:
        self.inner = inner
        self.skip = skip
        self.length = length

    def __len__(self) -> int:
        return max(self.length - self.skip, 0)

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(iter(self.inner), self.skip, None)


def skip_first_batches(loader: DataLoader[Any], skip: int) -> DataLoader[Any]:
    """A loader over the same data and order without its first ``skip`` batches, not loading them."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is None or isinstance(loader.dataset, IterableDataset):
        raise ConfigError("skip_first_batches needs a map-style DataLoader with a batch sampler")
    return DataLoader(
        loader.dataset,
        batch_sampler=_SkipBatchSampler(batch_sampler, skip, len(batch_sampler)),  # type: ignore[arg-type]
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if loader.num_workers > 0 else None,
        persistent_workers=loader.persistent_workers if loader.num_workers > 0 else False,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
    )


def resumable_epoch_iterator(data: Iterable[Any], epoch: int, skip_batches: int) -> Iterator[Any]:
    """The batches of epoch ``epoch``; a map-style DataLoader skips ``skip_batches`` in its sampler.

    The sampler's ``set_epoch`` is called first so the skipped prefix is the one the interrupted
    run consumed. Other data falls back to skipping by iteration (an iterable dataset has no index).
    """
    sampler = getattr(data, "sampler", None)
    owners = (data, sampler, getattr(data, "batch_sampler", None), getattr(data, "dataset", None))
    for owner in owners:  # the first owner of a set_epoch: a seeded sampler, or an iterable dataset
        set_epoch = getattr(owner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            break
    dataset = getattr(data, "dataset", None)
    if isinstance(dataset, SeededBatches):  # its workers' seeds (a sampler's set_epoch above is separate)
        dataset.set_epoch(epoch)
    if skip_batches and isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset):
        return iter(skip_first_batches(data, skip_batches))
    iterator = iter(data)
    return itertools.islice(iterator, skip_batches, None) if skip_batches else iterator


def fetch_one_ahead(batches: Iterable[Any], note_in_flight: Callable[[Any], None] | None = None) -> Iterator[Any]:
    """The same batches, each yielded once the next one has been made (accelerate's DataLoaderShard order).

    ``note_in_flight(states)`` gets the RNG states from just before the batch ahead started being made
    (None when no batch is in flight), for checkpoints: a resume makes that batch again from them. They
    are read only when making a batch draws from the global generators in this process (random masks,
    crops; probed on each epoch's first batch ahead), so other loaders pay nothing per batch.
    """
    iterator = iter(batches)
    try:
        current = next(iterator)
    except StopIteration:
        return
    track = probe = note_in_flight is not None
    while True:
        before = rng_state() if track else None
        try:
            upcoming = next(iterator)
        except StopIteration:
            break
        if probe:  # once per epoch; a loader that draws nothing then costs no call per batch
            probe = False
            track = not same_rng_state(before, rng_state())  # type: ignore[arg-type]
            if not track:
                note_in_flight(None)  # type: ignore[misc]
        if track:
            note_in_flight(before)  # type: ignore[misc]
        yield current
        current = upcoming
    if note_in_flight is not None:
        note_in_flight(None)
    yield current


class RngReplay:
    """RNG states to set right before the resumed epoch's first fetches; ``used`` once they were."""

    def __init__(self, states: list[Any]) -> None:
        self.states = states
        self.used = False

    def wrap(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for state in self.states:
            set_rng_state(state)
            self.used = True
            try:
                batch = next(iterator)
            except StopIteration:
                return
            yield batch
        yield from iterator


class ResumableData(Plugin):
    """Makes ``epoch_iterator`` skip consumed batches in the sampler (D3); stateless.

    Args:
        ignore_data_skip: on a mid-epoch resume, start the interrupted epoch again from its first
            batch instead of skipping the batches it had consumed (HF's ``ignore_data_skip``: a
            faster resume that does not reproduce the uninterrupted run). The step count goes on
            from the checkpoint, so the run still ends at its ``max_steps``.
    """

    def __init__(self, ignore_data_skip: bool = False) -> None:
        self.ignore_data_skip = ignore_data_skip

    def attach(self, engine: Engine) -> None:
        self._replay: RngReplay | None = None
        self.wrap_hook(engine, "epoch_iterator", lambda inner: self._epoch_iterator)
        if self.ignore_data_skip:
            # first: every other TRAIN_START handler sees the epoch restarted
            self.on(engine, Event.TRAIN_START, self._restart_epoch, priority=Priority.FIRST)

    def replay_rng(self, states: list[Any]) -> RngReplay:
        """Set ``states`` (a checkpoint's, the in-flight batch's first) before the next epoch's first fetches."""
        self._replay = RngReplay(states)
        return self._replay

    def _epoch_iterator(self, data: Iterable[Any], epoch: int, skip_batches: int) -> Iterator[Any]:
        iterator = resumable_epoch_iterator(data, epoch, skip_batches)
        replay, self._replay = self._replay, None
        return iterator if replay is None else replay.wrap(iterator)

    def _restart_epoch(self, ev: TrainStartEvent) -> None:
        state = ev.engine.state
        if state.batches_in_epoch:
            state.batches_in_epoch = 0
            state.epoch_step = 0
            state.epoch = float(state.epochs_completed)


def check_multiprocessing_context(context: str | None, num_workers: int) -> None:
    """Raise ``ConfigError`` unless ``context`` is None or a start method this platform has, with workers."""
    if context is None:
        return
    methods = torch.multiprocessing.get_all_start_methods()
    if context not in methods:
        raise ConfigError(f"dataloader_multiprocessing_context must be one of {methods} or None, got {context!r}")
    if num_workers <= 0:
        raise ConfigError(
            f"dataloader_multiprocessing_context={context!r} is the start method of worker processes, but "
            "dataloader_num_workers=0 loads in the main process: set dataloader_num_workers > 0 or leave it None"
        )


def build_dataloader(
    dataset: Any,
    *,
    batch_size: int,
    collate_fn: Collator,
    shuffle: bool,
    seed: int,
    drop_last: bool = False,
    num_workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    multiprocessing_context: str | None = None,
    sampler: Sampler[int] | None = None,
) -> DataLoader[Any]:
    """A DataLoader with an ``EpochSampler`` when shuffling a map-style dataset (iterables keep their order).

    ``sampler`` replaces that choice (e.g. a ``LengthGroupedEpochSampler``); ``multiprocessing_context``
    is the workers' start method ("fork", "spawn", "forkserver") when ``num_workers > 0``.
    """
    if isinstance(dataset, DataLoader):
        return dataset
    iterable = isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__")
    if iterable:
        if sampler is not None:
            raise ConfigError(f"a sampler needs a map-style dataset; got the iterable {type(dataset).__name__}")
        if not isinstance(dataset, IterableDataset):
            dataset = _IterableWrapper(dataset)
    elif sampler is None:
        try:
            size = len(dataset)
        except TypeError as exc:
            raise ConfigError(f"a map-style dataset needs __len__; got {type(dataset).__name__}") from exc
        sampler = EpochSampler(size, seed) if shuffle else SequentialSampler(range(size))
    check_multiprocessing_context(multiprocessing_context, num_workers)
    workers: dict[str, Any] = {}
    if num_workers > 0:
        workers = dict(
            persistent_workers=persistent_workers,
            prefetch_factor=prefetch_factor,
            multiprocessing_context=multiprocessing_context,
        )
    if num_workers > 0 and not iterable:
        dataset = SeededBatches(dataset, seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
        num_workers=num_workers,
        pin_memory=pin_memory,
        **workers,  # type: ignore[arg-type]
    )


class _IterableWrapper(IterableDataset[Any]):
    """Lets a plain iterable (a generator function's result, an HF IterableDataset) feed a DataLoader."""

    def __init__(self, data: Iterable[Any]) -> None:
        self.data = data

    def __iter__(self) -> Iterator[Any]:
        return iter(self.data)

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(self.data, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


class SeededBatches(Dataset[Any]):
    """A map-style dataset whose batches, when a worker loads them, start from their own seed.

    Worker ``i`` of a plain DataLoader seeds its RNGs once per epoch and draws from them for every
    batch it loads, so what a random transform or collator draws depends on which worker got the
    batch and on what that worker loaded before. A resumed run skips the epoch's first batches, the
    rest are dealt to the workers differently, and every draw moves. Here a worker seeds torch,
    ``random`` and numpy for each batch from ``(seed, epoch, the batch's indices)`` before loading
    it (and before the collator runs, in the same worker): draws differ from batch to batch and from
    epoch to epoch, and do not depend on the worker count or on where the epoch resumed. In the main
    process (no workers) nothing is reseeded: the training RNG is left alone.
    """

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset = dataset
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch  # read by the workers started for this epoch (they copy the dataset)

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
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _batch_seed(seed: int, epoch: int, indices: list[int]) -> int:
    digest = hashlib.blake2b(repr((seed, epoch, [int(i) for i in indices])).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


__all__ = [
    "DataCollatorWithPadding",
    "EpochSampler",
    "RemoveColumnsCollator",
    "ResumableData",
    "build_dataloader",
    "check_multiprocessing_context",
    "fetch_one_ahead",
    "default_data_collator",
    "is_tokenizer_like",
    "remove_unused_columns",
    "resumable_epoch_iterator",
    "signature_columns",
    "skip_first_batches",
]
