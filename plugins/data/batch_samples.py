"""transformers' ``get_batch_samples`` as the source of an epoch's windows (a Trainer subclass's override).

transformers' epoch loop asks ``get_batch_samples(epoch_iterator, num_batches, device)`` once per optimizer step
for the window's micro-batches and their ``num_items_in_batch`` (``num_batches``: the accumulation steps, the
epoch's remainder for its last window). ``WindowsFromBatchSamples`` is an ``epoch_iterator`` hook wrapper doing
the same: the engine groups the batches it yields into windows of the same size, and each window's count waits
in ``items`` until the window's STEP_START takes it. It must sit outside the one-batch-ahead reader, as
transformers' loop pulls from accelerate's prefetching loader.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from trainbus.engine import ConfigError, data_length


class WindowsFromBatchSamples:
    """``wrapper(inner) -> epoch_iterator`` yielding what ``get_batch_samples`` returns, window by window."""

    def __init__(self, owner: Any, get_batch_samples: Callable[..., tuple[list[Any], Any]]) -> None:
        self.owner = owner  # the Trainer: its accumulation_steps, device and name
        self.get_batch_samples = get_batch_samples
        #: each window's num_items_in_batch, in the order its window was made
        self.items: collections.deque[Any] = collections.deque()

    def __call__(self, inner: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
        def epoch_iterator(data: Iterable[Any], epoch: int, skip_batches: int) -> Iterator[Any]:
            return self._windows(inner(data, epoch, skip_batches), data_length(data), skip_batches)

        return epoch_iterator

    def _windows(self, batches: Iterator[Any], length: int | None, skip: int) -> Iterator[Any]:
        k = max(1, int(self.owner.accumulation_steps))
        last = None if length is None else -(-length // k) - 1  # the index of the epoch's last window
        window = skip // k
        while last is None or window <= last:
            wanted = length - last * k if last is not None and window == last else k  # type: ignore[operator]
            samples, items = self.get_batch_samples(batches, wanted, self.owner.device)
            samples = list(samples)
            if not samples:
                return
            if len(samples) > wanted or (len(samples) < wanted and window != last and last is not None):
                raise ConfigError(
                    f"{type(self.owner).__name__}.get_batch_samples returned {len(samples)} batches for a window of "
                    f"{wanted}: trainbus trains windows of gradient_accumulation_steps micro-batches (the epoch's "
                    "last one shorter); return the batches it took from the iterator"
                )
            self.items.append(items)
            yield from samples
            window += 1

    def take(self) -> Any:
        """The count of the window starting now (None when no window is waiting)."""
        return self.items.popleft() if self.items else None
