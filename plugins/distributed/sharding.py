"""Data for several processes: each rank's share of the batches a single process would see.

Training: the loader's ``batch_size`` is the per-device batch ``b``. With ``W`` processes the seeded
sampler's order is cut into global batches of ``b * W``, and rank ``r`` takes the ``r``-th contiguous
share of each. So a step on ``W`` processes sees exactly the samples of a step of one process with
batch ``b * W``, in the same seeded order, and the last, short batch of an epoch is split too
(shares differ by at most one sample) instead of being filled with repeated samples, as
accelerate's ``BatchSamplerShard`` does: a repeated sample would count twice in the gradient.
Skipping batches for a mid-epoch resume works on the sharded loader as on any other (D3).

Evaluation: torch's ``DistributedSampler`` (no shuffle); ``EvalCollector`` and ``IgniteMetrics``
know its layout, drop the samples it repeats to pad the shards and restore the data-set order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler

from trainbus.engine import ConfigError

from ..data.loading import EpochSampler
from .processes import all_gather, broadcast_from_main


def share(batch: list[int], num_replicas: int, rank: int) -> list[int]:
    """Rank ``rank``'s contiguous share of ``batch``: sizes differ by at most one, the first ranks larger."""
    base, extra = divmod(len(batch), num_replicas)
    start = rank * base + min(rank, extra)
    return batch[start : start + base + (rank < extra)]


class ShardedBatchSampler(Sampler[list[int]]):
    """The ``rank``-th share of each global batch of ``global_batches`` (a batch sampler of ``b * W``)."""

    def __init__(self, global_batches: Iterable[list[int]], num_replicas: int, rank: int) -> None:
        self.global_batches = global_batches
        self.num_replicas = num_replicas
        self.rank = rank

    def __len__(self) -> int:
        return len(self.global_batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.global_batches:
            yield share(batch, self.num_replicas, self.rank)

    def set_epoch(self, epoch: int) -> None:
        set_epoch = getattr(getattr(self.global_batches, "sampler", None), "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def _loader_like(loader: DataLoader[Any], **changes: Any) -> DataLoader[Any]:
    """A DataLoader over ``loader``'s dataset with its collation and worker settings and ``changes``."""
    workers = loader.num_workers > 0
    settings: dict[str, Any] = dict(
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context if workers else None,
        persistent_workers=loader.persistent_workers if workers else False,
        prefetch_factor=loader.prefetch_factor if workers else None,
    )
    return DataLoader(loader.dataset, **{**settings, **changes})


def _map_style(loader: Any, what: str, num_replicas: int) -> DataLoader[Any]:
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        raise ConfigError(
            f"with {num_replicas} processes the {what} data must be a DataLoader over a map-style dataset "
            f"(so each rank can take its share), got {type(loader).__name__}"
            + (" over an IterableDataset" if isinstance(loader, DataLoader) else "")
        )
    if loader.batch_size is None:
        raise ConfigError(
            f"the {what} DataLoader has its own batch_sampler; with {num_replicas} processes give it a batch_size "
            "and a sampler instead, so every rank cuts the same batches"
        )
    return loader


def shard_train_loader(loader: Any, num_replicas: int, rank: int) -> DataLoader[Any]:
    """Rank ``rank``'s loader: shares of the global batches (``loader.batch_size * num_replicas``).

    A ``RandomSampler`` becomes an ``EpochSampler`` seeded from rank 0, so every rank draws the same
    order. Fails before training when a data set's last global batch has fewer samples than there are
    processes: some rank would get none (set drop_last, or change the batch size or data size).
    """
    if isinstance(getattr(loader, "batch_sampler", None), ShardedBatchSampler):
        return loader  # type: ignore[no-any-return]
    loader = _map_style(loader, "train", num_replicas)
    sampler: Sampler[int] = loader.sampler
    if isinstance(sampler, RandomSampler):
        if sampler.replacement:
            raise ConfigError("a RandomSampler with replacement=True cannot be sharded exactly across processes")
        sampler = EpochSampler(len(sampler), int(broadcast_from_main(torch.initial_seed() % 2**31)))
    per_device = int(loader.batch_size)  # type: ignore[arg-type]
    global_batch = per_device * num_replicas
    size = len(sampler) if isinstance(sampler, Sized) else None
    check_same_data({"samples": size, "per-device batch": per_device, "drop_last": loader.drop_last}, "at setup")
    last = size % global_batch if size is not None else 0
    if last and not loader.drop_last and last < num_replicas:
        raise ConfigError(
            f"{size} samples in global batches of {global_batch} (per-device batch {per_device} x {num_replicas} "
            f"processes) leave a last batch of {last}, which {num_replicas} processes cannot share (each needs a "
            "sample); set drop_last / dataloader_drop_last=True or choose another per-device batch size"
        )
    batches = ShardedBatchSampler(BatchSampler(sampler, global_batch, loader.drop_last), num_replicas, rank)
    return _loader_like(loader, batch_sampler=batches)


def check_same_data(facts: dict[str, Any], when: str) -> None:
    """Raise the same ConfigError on every rank unless every rank has the same ``facts`` about its train data.

    Each rank takes its share of every global batch, so every rank must hold the same data set: with
    different lengths the ranks make different numbers of steps, and the first collective one of them
    makes alone aborts the job (gloo: SIGABRT) or hangs it, or, when the step counts happen to agree,
    the ranks train on unequal shares without a word. One ``all_gather_object`` of a few ints: at setup
    and at each TRAIN_START, never per step.
    """
    every = all_gather(facts)
    differing = [key for key in facts if len({repr(rank_facts.get(key)) for rank_facts in every}) > 1]
    if not differing:
        return
    detail = "; ".join(
        f"{key}: " + ", ".join(f"rank {r} has {rank_facts.get(key)!r}" for r, rank_facts in enumerate(every))
        for key in differing
    )
    raise ConfigError(
        f"the {len(every)} processes disagree on the training data {when} ({detail}); every rank must load the "
        "same data set with the same batch size (each rank takes its share of every global batch): give every "
        "process the same train_dataset / DataLoader"
    )


def shard_eval_loader(loader: Any, num_replicas: int, rank: int) -> DataLoader[Any]:
    """Rank ``rank``'s loader of an eval / test set: torch's ``DistributedSampler``, in order."""
    if isinstance(getattr(loader, "sampler", None), DistributedSampler):
        return loader  # type: ignore[no-any-return]
    loader = _map_style(loader, "eval", num_replicas)
    sampler = DistributedSampler(loader.dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
    return _loader_like(loader, batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last)


__all__ = ["ShardedBatchSampler", "check_same_data", "shard_eval_loader", "shard_train_loader", "share"]
