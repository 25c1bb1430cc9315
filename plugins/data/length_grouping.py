"""The train sampler HF's ``train_sampling_strategy`` names: random, sequential or grouped by length.

``"group_by_length"`` (transformers 4.x: ``group_by_length=True``) uses transformers'
``get_length_grouped_indices`` (shuffle, cut into mega-batches, sort each by length, longest batch
first), so batches hold examples of similar length and need little padding.

Its shuffle is the one transformers draws: ``LengthGroupedSampler`` has no generator of its own
(accelerate's seedable sampler replaces only a ``RandomSampler``), so each epoch's permutation comes
from torch's global generator when the epoch starts, after the DataLoader drew its base seed from it.
trainbus draws from the same generator at the same point, so with the same seed (and the same draws
before, the model's init and dropout) it trains on the same batches, every epoch. ``data_seed`` does
not change that order, as in transformers.

A mid-epoch resume cannot draw again (the global generator has moved on since the epoch started), so
the sampler keeps the generator state each epoch drew from, the ``LengthGroupedOrder`` plugin saves it
in the checkpoint, and the resumed epoch draws its permutation from that state on a generator of its
own: the order of the interrupted run, bit for bit, with the global generator left to the resume.
Under several processes each rank's global generator may differ (dropout draws depend on the rank's
batches), so there the shuffle is drawn from ``seed + epoch`` (``data_seed`` if set) instead, the same
order on every rank (and again on resume) but not transformers' one.

Unlike transformers, which also groups eval and test sets by length (so ``predict`` returns rows in a
shuffled order), trainbus groups only the train set: eval and predictions keep the data-set order.
transformers 4.x shuffles those with the global generator, so there the eval loader makes the same
draw (``GroupedEvalDraw``) and the train shuffles after an evaluation stay 4.x's.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, SequentialSampler

from trainbus.engine import ConfigError, Event, Plugin, Priority

from .loading import EpochSampler

if TYPE_CHECKING:
    from trainbus.engine import Engine, TrainStartEvent

#: the values of ``train_sampling_strategy`` trainbus implements (HF 5 also has "batch_rebalance")
SAMPLING_STRATEGIES = ("random", "sequential", "group_by_length")


def check_sampling_strategy(strategy: str) -> None:
    """Raise ``ConfigError`` for a ``train_sampling_strategy`` trainbus does not implement."""
    if strategy == "batch_rebalance":
        raise ConfigError(
            "train_sampling_strategy='batch_rebalance' is not supported by trainbus; "
            f"use one of {list(SAMPLING_STRATEGIES)}"
        )
    if strategy not in SAMPLING_STRATEGIES:
        raise ConfigError(f"train_sampling_strategy must be one of {list(SAMPLING_STRATEGIES)}, got {strategy!r}")


def sampling_strategy(strategy: str, group_by_length: bool = False) -> str:
    """The strategy to train with: ``strategy``, or ``"group_by_length"`` for transformers 4.x's
    ``group_by_length=True``; a strategy that says otherwise next to it raises ``ConfigError``."""
    check_sampling_strategy(strategy)
    if not group_by_length:
        return strategy
    if strategy not in ("random", "group_by_length"):  # "random" is the default: not a choice that conflicts
        raise ConfigError(
            f"group_by_length=True (transformers 4.x) asks for train_sampling_strategy='group_by_length', but "
            f"train_sampling_strategy={strategy!r} was given too: pass one of them"
        )
    return "group_by_length"


def _several_processes() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class LengthGroupedEpochSampler(Sampler[int]):
    """transformers' ``LengthGroupedSampler``, drawing its shuffle where transformers does, and resumable.

    Args:
        batch_size: examples per group of similar length (HF: per-device batch x accumulation steps).
        lengths: the length of every example.
        seed: the shuffle's seed under several processes only (``seed + epoch``); in one process the
            shuffle comes from torch's global generator, as in transformers (seeded by ``set_seed``).

    Example:
        >>> s = LengthGroupedEpochSampler(2, [1, 9, 2, 8], seed=0)
        >>> _ = torch.manual_seed(0); order = list(s)
        >>> sorted(order), order[0]  # every example once, the longest first
        ([0, 1, 2, 3], 1)
        >>> _ = torch.manual_seed(0); order == list(s)  # the global generator's draw, as transformers'
        True
    """

    def __init__(self, batch_size: int, lengths: Sequence[int], seed: int) -> None:
        try:
            from transformers.trainer_pt_utils import get_length_grouped_indices
        except ImportError as exc:  # transformers is an optional dependency of trainbus
            raise ConfigError(
                "train_sampling_strategy='group_by_length' uses transformers' LengthGroupedSampler: "
                "pip install transformers"
            ) from exc
        self.grouped_indices = get_length_grouped_indices
        self.batch_size = batch_size
        self.lengths = list(lengths)
        self.seed = seed
        self.epoch = 0
        self.drawn: tuple[int, torch.Tensor] | None = None  # (epoch, generator state it drew from)
        self._resume: tuple[int, torch.Tensor] | None = None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        yield from self.grouped_indices(self.lengths, self.batch_size, generator=self._generator())
        self.epoch += 1  # a finished pass moves on by itself, as EpochSampler does

    def _generator(self) -> torch.Generator | None:
        """None (torch's global generator, transformers' draw), or the generator to draw from instead."""
        resume, self._resume = self._resume, None
        if _several_processes():
            self.drawn = None
            return torch.Generator().manual_seed(self.seed + self.epoch)
        if resume is not None and resume[0] == self.epoch:  # the interrupted epoch: its own draw again
            self.drawn = resume
            generator = torch.Generator()
            generator.set_state(resume[1])
            return generator
        self.drawn = (self.epoch, torch.get_rng_state())
        return None

    def state_dict(self) -> dict[str, Any]:
        """The epoch last drawn and the generator state it drew from (empty before the first draw)."""
        if self.drawn is None:
            return {}
        return {"epoch": self.drawn[0], "rng_state": self.drawn[1].clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Draw epoch ``state["epoch"]`` from its saved state when that epoch is the next one drawn."""
        if state:
            self._resume = (int(state["epoch"]), torch.as_tensor(state["rng_state"], dtype=torch.uint8).clone())


class GroupedEvalDraw(SequentialSampler):
    """Data-set order, drawing from torch's global generator what transformers 4.x's eval sampler draws.

    transformers 4.x groups eval and test sets by length too, shuffled by the global generator (one
    ``randperm`` of the set each time a loader is iterated): that draw moves every train shuffle and
    dropout mask after an evaluation. This sampler makes the same draw and keeps the set's order, so a
    run that evaluates between epochs trains on 4.x's batches all the same. (transformers 5 gives the
    eval sampler a generator of its own: nothing to draw there.)
    """

    def __iter__(self) -> Iterator[int]:
        torch.randperm(len(self.data_source))  # where 4.x's get_length_grouped_indices draws, discarded
        yield from range(len(self.data_source))


def eval_sampler(dataset: Any, strategy: str) -> Sampler[int] | None:
    """The sampler of an eval / test set: ``GroupedEvalDraw`` for ``"group_by_length"`` under a transformers whose
    eval sets are length-grouped too (4.x to 5.0: their draw from the global generator moves the next train
    epoch's), in one process; else None (the set's order, ``build_dataloader``'s ``SequentialSampler``)."""
    if strategy != "group_by_length" or isinstance(dataset, DataLoader | IterableDataset) or _several_processes():
        return None
    if not _transformers_groups_eval_sets() or not hasattr(dataset, "__len__"):
        return None
    return GroupedEvalDraw(range(len(dataset)))


@functools.cache
def _transformers_groups_eval_sets() -> bool:
    """Whether the installed transformers' Trainer groups eval sets by length drawing from the global generator
    (its code says: 4.x to 5.0 do; later releases give the sampler a seeded generator of its own)."""
    try:
        from transformers import Trainer
    except ImportError:
        return False
    try:
        source = inspect.getsource(Trainer._get_eval_sampler)
    except (AttributeError, OSError, TypeError):
        return False
    return "LengthGroupedSampler" in source and "generator=" not in source  # newer ones seed their own


def grouped_sampler_of(data: Any) -> LengthGroupedEpochSampler | None:
    """The ``LengthGroupedEpochSampler`` a train loader draws from, if any."""
    for owner in (getattr(data, "sampler", None), getattr(getattr(data, "batch_sampler", None), "sampler", None)):
        if isinstance(owner, LengthGroupedEpochSampler):
            return owner
    return None


class LengthGroupedOrder(Plugin):
    """Keeps the length-grouped shuffle of the epoch in progress in checkpoints (see the module's doc).

    Attached by the Trainer with ``train_sampling_strategy="group_by_length"``; with any other sampler it
    saves nothing and does nothing.
    """

    def __init__(self) -> None:
        self.engine: Any = None
        self.pending: dict[str, Any] = {}

    def attach(self, engine: Engine) -> None:
        self.engine = engine
        # first: the state reaches the sampler before any handler could start iterating the data
        self.on(engine, Event.TRAIN_START, self._hand_over, priority=Priority.FIRST)

    def _hand_over(self, ev: TrainStartEvent) -> None:
        sampler = grouped_sampler_of(ev.engine.train_data)
        if sampler is not None and self.pending:
            sampler.load_state_dict(self.pending)
        self.pending = {}

    def state_dict(self) -> dict[str, Any]:
        sampler = grouped_sampler_of(getattr(self.engine, "train_data", None))
        return sampler.state_dict() if sampler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = dict(state)


def example_lengths(dataset: Any, length_column_name: str, model_input_name: str | None) -> list[int]:
    """The length of every example, as HF finds it for ``group_by_length``.

    A ``datasets.Dataset`` with a ``length_column_name`` column gives its values; otherwise each
    example must be a dict holding ``model_input_name`` (default ``"input_ids"``), whose length is taken.
    """
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list) and length_column_name in columns:
        return [int(n) for n in dataset[length_column_name]]
    key = model_input_name or "input_ids"
    lengths = []
    for i in range(len(dataset)):
        example = dataset[i]
        if not hasattr(example, "keys") or key not in example:
            found = sorted(example.keys()) if hasattr(example, "keys") else type(example).__name__
            raise ConfigError(
                f"train_sampling_strategy='group_by_length' needs each example's length: add a "
                f"{length_column_name!r} column (length_column_name) or use dict examples with {key!r}; "
                f"example {i} has {found}"
            )
        lengths.append(len(example[key]))
    return lengths


def main_input_name_of(processing_class: Any) -> str | None:
    """The key of the main model input a tokenizer / processor makes: its first ``model_input_names`` (HF)."""
    names = getattr(processing_class, "model_input_names", None)
    return str(names[0]) if names else None


def train_sampler(
    dataset: Any,
    strategy: str,
    *,
    seed: int,
    group_size: int,
    length_column_name: str = "length",
    model_input_name: str | None = None,
) -> Sampler[int] | None:
    """The sampler of a map-style train set for ``strategy``; None for an iterable data set (its own order).

    ``group_size`` is the number of examples grouped by length (HF: the per-device batch times the
    accumulation steps; trainbus also times the processes, so W processes group as one does).
    """
    check_sampling_strategy(strategy)
    if isinstance(dataset, DataLoader):  # the caller's own loader keeps its own sampler
        if strategy != "random":
            raise ConfigError(
                f"train_sampling_strategy={strategy!r} chooses the train sampler, but the train data is already a "
                "DataLoader with its own: pass the dataset instead, or leave the strategy at 'random'"
            )
        return None
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__"):
        if strategy == "group_by_length":
            raise ConfigError(
                "train_sampling_strategy='group_by_length' needs a map-style data set with a length; "
                f"got {type(dataset).__name__} (an iterable one keeps its own order)"
            )
        return None
    try:
        size = len(dataset)
    except TypeError as exc:
        raise ConfigError(f"a map-style dataset needs __len__; got {type(dataset).__name__}") from exc
    if strategy == "sequential":
        return SequentialSampler(range(size))
    if strategy == "group_by_length":
        lengths = example_lengths(dataset, length_column_name, model_input_name)
        return LengthGroupedEpochSampler(group_size, lengths, seed)
    return EpochSampler(size, seed)


__all__ = [
    "SAMPLING_STRATEGIES",
    "LengthGroupedEpochSampler",
    "GroupedEvalDraw",
    "LengthGroupedOrder",
    "check_sampling_strategy",
    "eval_sampler",
    "example_lengths",
    "grouped_sampler_of",
    "main_input_name_of",
    "sampling_strategy",
    "train_sampler",
]
