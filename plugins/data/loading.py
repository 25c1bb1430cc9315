"""Data for the facade: seeded data loaders, resumable epochs (collators and column removal: collators.py).

* ``EpochSampler``: a shuffle seeded by ``seed + epoch``: the same order for an epoch in any process.
* ``ResumableData``: a plugin whose ``epoch_iterator`` skips already-consumed batches in the batch
  sampler, so a mid-epoch resume does not load them (D3); with ``ignore_data_skip=True`` the resumed
  epoch starts again from its first batch instead (HF's ``ignore_data_skip``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, SequentialSampler

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import check_flag

if TYPE_CHECKING:
    from trainbus.engine import Engine, EvalStartEvent, TrainStartEvent

from .collators import (
    Collator,
    DataCollatorWithPadding,
    RemoveColumnsCollator,
    default_data_collator,
    is_tokenizer_like,
    remove_unused_columns,
    signature_columns,
)
from .replay import (
    RngReplay,
    data_roots,
    epoch_start_states,
    make_pool_quietly,
    needs_new_pool,
    set_epoch_start_states,
    skip_first_batches,
    warn_unless_replayable,
)
from .rng import rng_state, same_rng_state, track_data
from .seeded import SeededBatches, SeededDatasetLoader, epoch_key, fetched_dataset, seeded_loader


class EpochSampler(Sampler[int]):
    """A random permutation seeded by ``seed + epoch``: reproducible per epoch, independent of global RNG.

    Example:
        >>> s = EpochSampler(5, seed=0)
        >>> s.set_epoch(1); a = list(s); s.set_epoch(1); a == list(s)
        True
    """

    #: its order is a function of (seed, epoch) alone: the data plugin need not probe it (``replay.replay_problem``)
    order_by_epoch = True

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


def resumable_epoch_iterator(
    data: Iterable[Any], epoch: int, skip_batches: int, replay: RngReplay | None = None, key: int | None = None
) -> Iterator[Any]:
    """The batches of epoch ``epoch``; a map-style DataLoader skips ``skip_batches`` in its sampler.

    The sampler's ``set_epoch`` is called first so the skipped prefix is the one the interrupted
    run consumed. Other data falls back to skipping by iteration (an iterable dataset has no index).
    ``replay`` (a mid-epoch resume): the epoch's order is drawn again from the states of its start,
    and the checkpoint's states are set once the consumed batches are skipped (``replay.py``).
    ``key``: what a loader ``seeded_loader`` made seeds its workers' batches from, in place of the epoch.
    """
    batch_sampler = getattr(data, "batch_sampler", None)
    owners = (data, getattr(data, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None),
              getattr(data, "dataset", None))  # fmt: skip
    for owner in owners:  # the first owner of a set_epoch: a seeded sampler, or an iterable dataset
        set_epoch = getattr(owner, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            break
    dataset = fetched_dataset(data)
    if isinstance(dataset, SeededBatches):  # its workers' seeds (a sampler's set_epoch above is separate)
        dataset.set_epoch(epoch if key is None else key)
    if replay is None:
        if skip_batches and isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset):
            return iter(skip_first_batches(data, skip_batches))
        iterator = iter(data)
        return itertools.islice(iterator, skip_batches, None) if skip_batches else iterator
    return replay.wrap(_replayed_epoch(data, skip_batches, replay))


def _replayed_epoch(data: Iterable[Any], skip_batches: int, replay: RngReplay) -> Iterator[Any]:
    """The resumed epoch's iterator, made from the epoch's starting states, its order drawn, the
    consumed batches skipped and the checkpoint's first states set (``replay.first``)."""
    start = replay.epoch_start
    restart = None
    if start is not None:
        set_epoch_start_states(data, start)
        if not start.get("base_seed", True):  # the uninterrupted run reused its pool: drew no base seed
            restart = lambda: set_epoch_start_states(data, start)  # noqa: E731
    if skip_batches and isinstance(data, DataLoader) and not isinstance(data.dataset, IterableDataset):
        loader = skip_first_batches(data, skip_batches, drawn=replay.first, restart=restart)
        iterator = iter(loader)
        loader.batch_sampler.prime()  # type: ignore[union-attr]  # done already if workers prefetched
        return iterator
    if restart is not None and needs_new_pool(data):
        make_pool_quietly(data)
    iterator = iter(data)
    for _ in itertools.islice(iterator, skip_batches):  # made, as the data cannot skip by index
        pass
    replay.first()
    return iterator


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


class FetchAheadLoader(DataLoader[Any]):
    """A DataLoader read as accelerate's ``DataLoaderShard`` reads it (what transformers' evaluation and prediction
    loops iterate): each batch is yielded once the next one has been made, so a random transform or collator
    draws batch i+1's numbers before the model runs batch i, as under transformers."""

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return fetch_one_ahead(super().__iter__())


class SeededFetchAheadLoader(SeededDatasetLoader, FetchAheadLoader):
    """A ``FetchAheadLoader`` whose workers fetch through ``SeededBatches`` (its ``.dataset`` the user's)."""


#: the loader class of a map-style dataset read by workers, for each loader class build_dataloader is given
_SEEDED_LOADERS: dict[type, type] = {DataLoader: SeededDatasetLoader, FetchAheadLoader: SeededFetchAheadLoader}


IMPLICIT = "_implicit_resumable_data"  # the engine's attribute for the one ensure_resumable_data attached


class ResumableData(Plugin):
    """Makes ``epoch_iterator`` skip consumed batches in the sampler (D3) and replay the epoch's order.

    Each epoch's starting random states are kept for checkpoints (``engine.rng_epoch_start``), so a
    mid-epoch resume draws the same order from a loader whose sampler draws from a generator
    (``DataLoader(shuffle=True)``) and every draw after it is the uninterrupted run's (``replay.py``).
    A sampler that cannot be replayed is reported with a warning when this plugin attaches.
    ``Checkpointing`` attaches one when the composition has none (``ensure_resumable_data``).

    Args:
        ignore_data_skip: on a mid-epoch resume, start the interrupted epoch again from its first
            batch instead of skipping the batches it had consumed (HF's ``ignore_data_skip``: a
            faster resume that does not reproduce the uninterrupted run). The step count goes on
            from the checkpoint, so the run still ends at its ``max_steps``.
    """

    def __init__(self, ignore_data_skip: bool = False) -> None:
        check_flag("ignore_data_skip", ignore_data_skip)
        self.ignore_data_skip = ignore_data_skip

    def attach(self, engine: Engine) -> None:
        implicit = getattr(engine, IMPLICIT, None)
        if implicit is not None:  # one attached for a checkpoint plugin (ensure_resumable_data): this one rules
            implicit.detach(engine)
            setattr(engine, IMPLICIT, None)
        self._replay: RngReplay | None = None
        self._engine = engine
        self.wrap_hook(engine, "epoch_iterator", lambda inner: self._epoch_iterator)
        if self.ignore_data_skip:
            # first: every other TRAIN_START handler sees the epoch restarted
            self.on(engine, Event.TRAIN_START, self._restart_epoch, priority=Priority.FIRST)
        self.on(engine, Event.EVAL_START, self._eval_start, priority=Priority.FIRST)
        self._checked = engine.train_data
        track_data(data_roots(self._checked))
        warn_unless_replayable(self._checked)
        # the Trainer makes its loader in train(): checked when training starts, if it is another
        self.on(engine, Event.TRAIN_START, self._check_data, priority=Priority.LAST)

    def replay_rng(self, states: list[Any], epoch_start: dict[str, Any] | None = None) -> RngReplay:
        """Draw the next epoch's order from ``epoch_start`` (the interrupted epoch's starting states), then
        set ``states`` (a checkpoint's, the in-flight batch's first) before that epoch's first fetches."""
        self._replay = RngReplay(states, epoch_start)
        return self._replay

    def _epoch_iterator(self, data: Iterable[Any], epoch: int, skip_batches: int) -> Iterator[Any]:
        replay, self._replay = self._replay, None
        engine = self._engine
        track_data(data_roots(data))  # its own generators travel with the global ones (rng.py)
        loader, data = data, seeded_loader(data)  # a worker loader's batches each seeded (seeded.py)
        if replay is not None:
            start = replay.epoch_start  # the interrupted epoch's, kept by checkpoints written later in it
        else:
            if engine.state.global_step > 0 and needs_new_pool(data):
                make_pool_quietly(data)  # a resumed run: the uninterrupted one reused its pool here
            start = epoch_start_states(data)
        engine.rng_epoch_start = start  # type: ignore[attr-defined]
        key = None if data is loader else epoch_key(epoch, start)
        return resumable_epoch_iterator(data, epoch, skip_batches, replay, key)

    def _check_data(self, ev: TrainStartEvent) -> None:
        if ev.engine.train_data is not self._checked:
            self._checked = ev.engine.train_data
            track_data(data_roots(self._checked))
            warn_unless_replayable(self._checked)

    def _eval_start(self, ev: EvalStartEvent) -> None:
        """A resumed run's first evaluation starts a persistent eval pool without a trace in any generator
        when the uninterrupted run had evaluated before its checkpoint (it reused the pool it started then)."""
        engine = ev.engine
        if getattr(engine, "rng_evaluated", False) and needs_new_pool(ev.dataloader):
            make_pool_quietly(ev.dataloader)
        engine.rng_evaluated = True  # type: ignore[attr-defined]  # checkpoints keep it (checkpoints/rng.py)

    def _restart_epoch(self, ev: TrainStartEvent) -> None:
        state = ev.engine.state
        if state.batches_in_epoch:
            state.batches_in_epoch = 0
            state.epoch_step = 0
            state.epoch = float(state.epochs_completed)


def find_resumable_data(engine: Engine) -> ResumableData | None:
    """The engine's data plugin: one attached as a plugin, else the one ``ensure_resumable_data`` attached."""
    added = next((p for p in engine.plugins if isinstance(p, ResumableData)), None)
    return added if added is not None else getattr(engine, IMPLICIT, None)


def ensure_resumable_data(engine: Engine) -> None:
    """Attach a ``ResumableData`` unless the composition has one (``Checkpointing`` and ``resume`` call this).

    Checkpoints need it for exact resumes: it keeps each epoch's starting random states and skips the
    consumed batches in the sampler. It is attached, not added: not among ``engine.plugins``, so
    checkpoints name no extra plugin and one a user adds later (``ignore_data_skip=True``) replaces it.
    """
    if find_resumable_data(engine) is None:
        plugin = ResumableData()
        plugin.attach(engine)
        setattr(engine, IMPLICIT, plugin)
    track_data(data_roots(engine.train_data))  # a resume sets their own generators' states too (rng.py)


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
    loader_class: type[DataLoader[Any]] = DataLoader,
) -> DataLoader[Any]:
    """A DataLoader with an ``EpochSampler`` when shuffling a map-style dataset (iterables keep their order).

    ``sampler`` replaces that choice (e.g. a ``LengthGroupedEpochSampler``); ``multiprocessing_context``
    is the workers' start method ("fork", "spawn", "forkserver") when ``num_workers > 0``; ``loader_class``
    a DataLoader subclass (``FetchAheadLoader`` for the Trainer's evaluation and prediction loaders).
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
    if num_workers > 0 and not iterable:  # its .dataset stays the user's (SeededDatasetLoader)
        dataset = SeededBatches(dataset, seed, collate_fn)
        loader_class = _SEEDED_LOADERS.get(loader_class, loader_class)
    return loader_class(
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


__all__ = [
    "DataCollatorWithPadding",
    "EpochSampler",
    "FetchAheadLoader",
    "SeededFetchAheadLoader",
    "RemoveColumnsCollator",
    "ResumableData",
    "build_dataloader",
    "check_multiprocessing_context",
    "fetch_one_ahead",
    "default_data_collator",
    "ensure_resumable_data",
    "is_tokenizer_like",
    "remove_unused_columns",
    "resumable_epoch_iterator",
    "signature_columns",
    "skip_first_batches",
]
