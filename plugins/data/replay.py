"""Making a resumed epoch's data order again: the generators' states from the epoch's start, replayed.

A plain ``DataLoader(shuffle=True)`` draws from torch's global generator every epoch: making its
iterator draws a base seed (unless a persistent worker pool is reused), then the ``RandomSampler``
draws its seed at the first fetch. So an epoch's order depends on every draw before it, dropout
masks included, and a resume that makes the iterator again draws once more. The data plugin keeps,
as each epoch's iterator is made, the states those draws come from (``epoch_start_states``: the global
generators' and those of the loader's and sampler's own ``torch.Generator``, and whether making the
iterator drew the base seed); checkpoints carry them (``checkpoints/rng.py``). A mid-epoch resume sets
them, makes the epoch's iterator, lets the sampler draw its order and skips the consumed batches
(indices only: ``SkipBatches``), and only then sets the checkpoint's own states (or those of the
batch that was in flight), before any batch is made: every later draw is the uninterrupted run's.
(accelerate's ``SeedableRandomSampler`` gets a reproducible order by replacing the sampler; this keeps
the user's sampler and its order, for any sampler that draws when a pass starts.)

A sampler whose order depends on more than that (a private state carried from pass to pass, draws
from the global generator as it goes) cannot be replayed: ``replay_problem`` finds it when the data
plugin attaches, on a copy, so the run draws nothing for the check.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from .generators import find_generators, generator_state, set_generator_state
from .rng import rng_state, same_rng_state, set_rng_state
from .seeded import SeededBatches, fetched_dataset

#: torch's samplers that draw only when a pass starts, from the global generator or their own
REPLAYABLE = (SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
#: larger samplers are not probed at attach (a probe iterates a copy twice)
PROBE_LIMIT = 1_000_000


def loader_generators(data: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects the loader and its samplers draw from (each once)."""
    batch_sampler = getattr(data, "batch_sampler", None)
    owners = (data, getattr(data, "sampler", None), batch_sampler, getattr(batch_sampler, "sampler", None))
    found: list[torch.Generator] = []
    for owner in owners:
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def data_roots(data: Any) -> dict[str, Any]:
    """The objects whose own generators a loader draws from as it loads (``rng.track_data``): its dataset,
    collator and samplers; for other data (a list of batches, a generator), the data itself."""
    if not isinstance(data, DataLoader):
        return {"data": data}
    batch_sampler = data.batch_sampler
    roots = {
        "generator": data.generator,
        "dataset": data.dataset,
        "collate_fn": data.collate_fn,
        "sampler": data.sampler,
    }
    return roots | {"batch_sampler": batch_sampler, "batch_sampler.sampler": getattr(batch_sampler, "sampler", None)}


def has_live_pool(data: Any) -> bool:
    """Whether ``iter(data)`` reuses a persistent worker pool (then it draws no base seed)."""
    return isinstance(data, DataLoader) and getattr(data, "_iterator", None) is not None


def needs_new_pool(data: Any) -> bool:
    return isinstance(data, DataLoader) and data.persistent_workers and data.num_workers > 0 and not has_live_pool(data)


def epoch_start_states(data: Any) -> dict[str, Any]:
    """The states the epoch's order is drawn from, and whether making the iterator draws a base seed."""
    state = rng_state()
    state["generators"] = [g.get_state() for g in loader_generators(data)]
    state["base_seed"] = not has_live_pool(data)
    return state


def set_epoch_start_states(data: Any, state: dict[str, Any]) -> None:
    set_rng_state(state)
    generators = loader_generators(data)
    saved = state.get("generators", [])
    if len(saved) == len(generators):  # another loader than the checkpoint's: its own generators stay
        for generator, value in zip(generators, saved, strict=True):
            generator.set_state(value)


def make_pool_quietly(data: Any) -> None:
    """Start a persistent loader's worker pool without a trace in any generator.

    The uninterrupted run started its pool once, at its first epoch (drawing a base seed there), and
    reused it since; a resumed run starts it again later. Made here and put back, the draws (the base
    seed, the sampler's order of the prefetched batches, dropped by the next ``iter``) leave no trace.
    """
    saved = epoch_start_states(data)
    iter(data)
    set_epoch_start_states(data, saved)


#: the roots (``data_roots``) whose generators the sampler side draws from: the replay itself draws them again
SAMPLER_SIDE = frozenset({"generator", "sampler", "batch_sampler"})


def _data_side(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without the sampler side's own generators: a resumed epoch's replay has drawn them again from
    the epoch's start (the exhaustion of the pass included, which a checkpoint at the epoch's last batch
    precedes, or follows when workers prefetched), so the checkpoint's states would put them off."""
    own = state.get("own")
    if not own:
        return state
    return {**state, "own": {path: v for path, v in own.items() if path.split(".")[0] not in SAMPLER_SIDE}}


class RngReplay:
    """States to set as the resumed epoch's batches are made: ``first()`` once the sampler has drawn its
    order (before the first batch is made), then one state before each following fetch (the global
    generators and the dataset's and collator's own; the sampler side's are the replay's)."""

    def __init__(self, states: list[Any], epoch_start: dict[str, Any] | None = None) -> None:
        self.states = [_data_side(state) for state in states]
        self.epoch_start = epoch_start
        self.used = False

    def first(self) -> None:
        if not self.used:
            set_rng_state(self.states[0])
            self.used = True

    def wrap(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for index, state in enumerate(self.states):
            if index == 0:
                self.first()
            else:
                set_rng_state(state)
            try:
                batch = next(iterator)
            except StopIteration:
                return
            yield batch
        yield from iterator


class SkipBatches(Sampler[list[int]]):
    """The batches of ``inner`` after the first ``skip``: indices only, no example is loaded.

    ``prime()`` runs the sampler's pass up to the first batch kept (its draws), then calls ``drawn``;
    the loader's iterator calls it from its first fetch (one process) or while it is made (workers
    prefetch), and the resume calls it right after making the iterator, so the sampler always draws
    after the base seed, as the loader does. ``restart``: states to set before the pass (the epoch's
    start, when the uninterrupted run reused its worker pool and drew no base seed).
    """

    def __init__(
        self,
        inner: Iterable[list[int]],
        skip: int,
        length: int,
        drawn: Callable[[], None] | None = None,
        restart: Callable[[], None] | None = None,
    ) -> None:
        self.inner = inner
        self.skip = skip
        self.length = length
        self.drawn = drawn
        self.restart = restart
        self._primed: tuple[list[list[int]], Iterator[list[int]]] | None = None
        self._passes = 0  # primed passes: the resume's one pass primes once, whoever asks first

    def __len__(self) -> int:
        return max(self.length - self.skip, 0)

    def prime(self) -> None:
        if self._primed is not None or self._passes:
            return
        self._passes += 1
        if self.restart is not None:
            self.restart()
        iterator = iter(self.inner)
        first = list(itertools.islice(iterator, self.skip, self.skip + 1))
        self._primed = (first, iterator)
        if self.drawn is not None:
            self.drawn()

    def __iter__(self) -> Iterator[list[int]]:
        if self.drawn is None and self.restart is None:  # a plain skip: lazily, as the loader asks
            yield from itertools.islice(iter(self.inner), self.skip, None)
            return
        self.prime()
        if self._primed is None:  # a second pass over the resumed epoch's remainder: no replay
            yield from itertools.islice(iter(self.inner), self.skip, None)
            return
        first, rest = self._primed
        self._primed = None
        yield from first
        if first:
            yield from rest


def skip_first_batches(
    loader: DataLoader[Any],
    skip: int,
    drawn: Callable[[], None] | None = None,
    restart: Callable[[], None] | None = None,
) -> DataLoader[Any]:
    """A loader over the same data and order without its first ``skip`` batches, not loading them.

    Its workers (if any) live for this one pass: the resumed epoch's remainder.
    """
    batch_sampler = loader.batch_sampler
    if batch_sampler is None or isinstance(loader.dataset, IterableDataset):
        from trainbus.engine import ConfigError

        raise ConfigError("skip_first_batches needs a map-style DataLoader with a batch sampler")
    sampler = SkipBatches(batch_sampler, skip, len(batch_sampler), drawn, restart)  # type: ignore[arg-type]
    workers = loader.num_workers > 0
    return DataLoader(
        fetched_dataset(loader),  # a worker loader's SeededBatches: the resumed batches seeded as before
        batch_sampler=sampler,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        prefetch_factor=loader.prefetch_factor if workers else None,
        generator=loader.generator,
    )


# -- which samplers can be replayed ----------------------------------------------------------------
def replay_problem(data: Any) -> str | None:
    """Why a mid-epoch resume cannot make ``data``'s epoch order again, or None when it can (or may).

    torch's samplers are replayable, and those whose order is a function of their epoch (``order_by_epoch``,
    trainbus's ``EpochSampler``). Another sampler (one with a ``set_epoch`` too: it may keep more state
    than its epoch) is tried on a copy: two passes from the same states (the global generators', those of
    its own, the same epoch) must give the same order, and draw from the global generators only before
    their first batch (draws as it goes are interleaved with the steps' draws).
    """
    if not isinstance(data, DataLoader) or isinstance(data.dataset, IterableDataset):
        return None
    batch_sampler = data.batch_sampler
    sampler = batch_sampler.sampler if type(batch_sampler) is BatchSampler else batch_sampler
    if type(sampler) in REPLAYABLE or getattr(type(sampler), "order_by_epoch", False):
        return None
    try:
        size = len(sampler)  # type: ignore[arg-type]
    except TypeError:
        size = PROBE_LIMIT + 1
    if size > PROBE_LIMIT:
        return None
    saved = rng_state()
    try:
        return _probe(sampler, data.dataset, saved)
    finally:
        set_rng_state(saved)


def _probe(sampler: Any, dataset: Any, saved: dict[str, Any]) -> str | None:
    try:
        probe = copy.deepcopy(sampler, memo={id(dataset): dataset})
    except Exception as exc:  # a lock, a file handle: say so rather than guess
        return f"could not be copied to check that it replays its order ({type(exc).__name__}: {exc})"
    own = {path: generator_state(g) for path, g in find_generators({"sampler": probe}).items()}
    set_epoch = getattr(probe, "set_epoch", None)
    passes = []
    for _ in range(2):
        set_rng_state(saved)
        generators = find_generators({"sampler": probe})
        for path, value in own.items():
            set_generator_state(generators[path], value)
        if callable(set_epoch):
            set_epoch(0)
        iterator = iter(probe)
        order = list(itertools.islice(iterator, 1))
        after_first = rng_state()
        order += list(iterator)
        if not same_rng_state(after_first, rng_state()):
            return "draws from the global random generators while it yields indices"
        passes.append(order)
    if passes[0] != passes[1]:
        return "gives another order for the same random states (it keeps a state of its own from pass to pass)"
    return None


def warn_unless_replayable(data: Any) -> None:
    """Warn when a mid-epoch resume cannot make ``data``'s epoch order again (``replay.replay_problem``), or
    the random draws its workers make (``worker_problems``)."""
    for worker_problem in worker_problems(data):
        warnings.warn(
            f"ResumableData: {worker_problem}, so a mid-epoch resume will not reproduce the uninterrupted run",
            stacklevel=4,
        )
    problem = replay_problem(data)
    if problem is not None:
        sampler = getattr(data, "batch_sampler", None)
        sampler = getattr(sampler, "sampler", sampler) if type(sampler) is BatchSampler else sampler
        warnings.warn(
            f"ResumableData: the train loader's sampler {type(sampler).__name__} {problem}: a mid-epoch resume "
            "cannot draw the interrupted epoch's order again, so it will not reproduce the uninterrupted run. "
            "Give the sampler a set_epoch(epoch) that fixes each epoch's order, or let it draw from the global "
            "generators or its own torch.Generator only when a pass starts",
            stacklevel=4,
        )


def worker_problems(data: Any) -> list[str]:
    """What a resume cannot draw again in ``data``'s worker processes (none in the main process).

    Each batch a map-style dataset's workers load is seeded on its own (``seeded.py``), generators a
    dataset or collator makes at its first call in each worker included. Not so: an iterable dataset's
    persistent workers (their generators go on from epoch to epoch in processes a resumed run starts
    again), and a DataLoader subclass (its batches are not fetched through ``SeededBatches``).
    """
    if not isinstance(data, DataLoader) or data.num_workers == 0:
        return []
    problems = []
    if isinstance(data.dataset, IterableDataset) and data.persistent_workers:
        problems.append(
            f"the iterable dataset {type(data.dataset).__name__} is read by persistent workers: any random "
            "draw it makes goes on from epoch to epoch in worker processes that a resumed run starts anew "
            "(set persistent_workers=False, or draw from generators seeded by the epoch)"
        )
    if type(data) is not DataLoader and not isinstance(fetched_dataset(data), IterableDataset | SeededBatches):
        problems.append(
            f"the train loader is a {type(data).__name__} (a DataLoader subclass), whose workers' batches cannot be "
            "seeded one by one: if its dataset or collator draws random numbers, a resumed epoch deals the "
            "remaining batches to workers that loaded others before, and draws differ (pass a torch DataLoader)"
        )
    return problems
