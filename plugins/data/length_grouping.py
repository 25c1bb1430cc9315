"""The train sampler HF's ``train_sampling_strategy`` names: random, sequential or grouped by length.

``"group_by_length"`` uses transformers' ``LengthGroupedSampler`` (shuffle, cut into mega-batches,
sort each by length, longest batch first), so batches hold examples of similar length and need
little padding. Its shuffle is drawn from a generator seeded by ``seed + epoch``, like
``EpochSampler``: every process and a resumed run draw the same order, which the mid-epoch resume
skip relies on.

Unlike transformers 5, which also groups eval and test sets by length (so ``predict`` returns rows
in a shuffled order), trainbus groups only the train set: eval and predictions keep the data-set order.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, SequentialSampler

from trainbus.engine import ConfigError

from .loading import EpochSampler

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


class LengthGroupedEpochSampler(Sampler[int]):
    """transformers' ``LengthGroupedSampler`` with its shuffle seeded by ``seed + epoch``.

    Args:
        batch_size: examples per group of similar length (HF: per-device batch x accumulation steps).
        lengths: the length of every example.
        seed: base seed; epoch ``e`` draws from ``torch.Generator().manual_seed(seed + e)``.

    Example:
        >>> s = LengthGroupedEpochSampler(2, [1, 9, 2, 8], seed=0)
        >>> order = list(s)
        >>> sorted(order), order[0]  # every example once, the longest first
        ([0, 1, 2, 3], 1)
        >>> s.set_epoch(1); again = list(s); s.set_epoch(1); again == list(s)  # one order per epoch
        True
    """

    def __init__(self, batch_size: int, lengths: Sequence[int], seed: int) -> None:
        try:
            from transformers.trainer_pt_utils import LengthGroupedSampler
        except ImportError as exc:  # transformers is an optional dependency of trainbus
            raise ConfigError(
                "train_sampling_strategy='group_by_length' uses transformers' LengthGroupedSampler: "
                "pip install transformers"
            ) from exc
        self.inner = LengthGroupedSampler(batch_size, lengths=list(lengths))
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.inner)

    def __iter__(self) -> Iterator[int]:
        self.inner.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        yield from self.inner
        self.epoch += 1  # a finished pass moves on by itself, as EpochSampler does


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
    "check_sampling_strategy",
    "example_lengths",
    "main_input_name_of",
    "train_sampler",
]
