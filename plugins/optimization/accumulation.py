"""Gradient accumulation as a plugin: a window of k micro-batches per optimizer step.

Each micro-batch's loss is a mean over its own items (tokens whose label is not -100, or samples).
Summing k such means weights a micro-batch with 3 real tokens like one with 300; dividing by k
(what HF Trainer did for years) gives the wrong gradient whenever the counts differ. This plugin
rescales micro-batch ``i``'s loss by ``n_i / N``, where ``N`` counts the items of the whole window,
so the accumulated gradient is the gradient of the mean over all items of the window: exactly the
gradient of one big batch. The last, partial window of an epoch is normalised by its own items.

Across processes (``torch.distributed`` with W > 1 ranks, gradients averaged by DDP) ``N`` counts
the window's items on every rank (one all-reduce of the counts per window, never per micro-batch;
HF's ``average_tokens_across_devices``) and the weights are ``W * n_i / N``: DDP's average of the
ranks' gradients is then the gradient of the mean over all items of the global window, however
unevenly -100 padding falls across ranks.

This plugin is the one owner of DDP's ``no_sync``: the micro-batches before the last of a window run
inside ``no_sync()`` of the module training goes through: the engine's model when it has one (a
model the user wrapped in DDP), else the one a plugin offers through ``trained_module()`` (the
``Distributed`` plugin's DDP wrapper).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import ConfigTypeError, check_positive_int
from trainbus.hooks import batch_size_of, get_labels

from ..distributed.processes import all_reduce_sum, collective_device, world_size

if TYPE_CHECKING:
    from trainbus.engine import Engine
    from trainbus.engine.events import BackwardEndEvent, BatchStartEvent, LossEvent, StepStartEvent

Count = int | torch.Tensor
CountItems = Callable[[Any], Count]

IGNORE_INDEX = -100
# label dtypes that hold class indices (where -100 means "ignore"); others are regression targets
_CLASS_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8})


def count_items(batch: Any, label_names: tuple[str, ...] = ("labels",)) -> Count:
    """Items a micro-batch's mean loss averages over, counted where the labels are.

    Integer labels: the labels that are not -100 (tokens for language models, samples for
    classification). Float labels: their elements (a mean-squared error averages over them).
    No labels: the samples (``batch_size_of``). Labels still on the host (a DataLoader's batch before
    ``to_device`` moves it) are counted there, through numpy, into a Python int: no tensor, no
    kernel, no copy, and reading host memory is no sync. Labels that already live on an accelerator
    are counted there into a tensor that is never read back. Counts known from shapes are ints.
    """
    labels = get_labels(batch, label_names)
    if isinstance(labels, tuple):  # several label names: the first is what the loss averages over
        labels = labels[0]
    if not isinstance(labels, torch.Tensor):
        return int(batch_size_of(batch))
    if labels.dtype not in _CLASS_DTYPES:
        return labels.numel()
    if labels.device.type == "cpu":
        return int(np.count_nonzero(labels.numpy() != IGNORE_INDEX))
    return labels.ne(IGNORE_INDEX).sum()


class GradientAccumulation(Plugin):
    """Accumulate gradients over ``steps`` micro-batches, normalised by the items of the window.

    Sets ``engine.accumulation_steps``; at STEP_START counts the items of each micro-batch of the
    window; at LOSS (priority PRODUCER, so loggers see the normalised loss) scales the loss by
    ``n_i / N``. The sum of the scaled losses of a window is the window's mean loss.

    Args:
        steps: micro-batches per optimizer step (HF ``gradient_accumulation_steps``).
        count_items: ``fn(batch) -> int | tensor``: the items the model's loss averages over;
            default ``count_items`` (non -100 integer labels, else label elements, else samples).
        across_processes: with several processes, count the window's items on all ranks (HF's
            ``average_tokens_across_devices``, default); False normalises each rank by its own items.
        prescaled: the loss is already normalised over the window by user code that divides by the
            window's items (HF's ``loss_is_scaled_for_ga``): only the across-process factor applies.
            A callable is asked at every TRAIN_START (the Trainer passes its ``_loss_is_scaled_for_ga``).

    The window's item count (HF's ``num_items_in_batch``) is published at STEP_START in
    ``engine.step_outputs["num_items_in_batch"]``, where the Trainer's compute_loss reads it.

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(torch.randn(n, 2), torch.randn(n, 1)) for n in (4, 4, 1)]
        >>> engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data,
        ...                 max_epochs=1, loss_fn=torch.nn.MSELoss(), plugins=[GradientAccumulation(2)])
        >>> engine.fit().global_step
        2
    """

    priority = Priority.PRODUCER

    def __init__(
        self,
        steps: int,
        count_items: CountItems | None = None,
        *,
        across_processes: bool = True,
        prescaled: bool | Callable[[], bool] = False,
    ) -> None:
        check_positive_int("gradient accumulation steps", steps)
        if count_items is not None and not callable(count_items):
            raise ConfigTypeError(
                f"count_items must be callable (count_items(batch) -> items) or None, got {count_items!r}"
            )
        if not isinstance(across_processes, bool):
            raise ConfigError(f"across_processes must be True or False, got {across_processes!r}")
        self.steps = steps
        self.count_fn = count_items
        self.across_processes = across_processes
        # micro-batches of the windows this plugin has weighted: its position in the stream. No
        # position inside a window is kept: checkpoints are taken between windows, and a window that
        # fails is dropped whole (the engine zeroes its gradients), so a resume starts a window afresh
        self.micro_batches_seen = 0
        self._factors: list[float] | torch.Tensor = []
        # per micro-batch (weight, has_items) on the loss's device and dtype; built at the window's first LOSS
        self._per_micro: list[tuple[Any, Any]] | None = None
        self._sync_off = contextlib.ExitStack()
        self._synced: Any = None  # the module whose no_sync skips a micro-batch's all-reduce (a DDP wrapper)
        self._processes = 1
        #: the items of the current window (on all ranks across processes): HF's ``num_items_in_batch``
        self.window_items: Count = 0
        #: the loss is already normalised over the window by user code that divides by
        #: ``window_items`` (HF's ``loss_is_scaled_for_ga``): only the across-process factor applies
        if not (isinstance(prescaled, bool) or callable(prescaled)):
            raise ConfigTypeError(f"prescaled must be True, False or a function returning one, got {prescaled!r:.80}")
        self.prescaled = bool(prescaled) if not callable(prescaled) else False
        self._prescaled_source = prescaled if callable(prescaled) else None

    def attach(self, engine: Engine) -> None:
        if engine.step_function is not None and self.steps > 1:
            raise ConfigError(
                f"GradientAccumulation({self.steps}): a step function takes one batch per step and steps the "
                "optimizers itself, and gradients are zeroed after every step; accumulate inside it: give it "
                f"batches {self.steps}x larger and write `for part in batch.chunk({self.steps}): "
                f"(loss_of(part) / {self.steps}).backward()`, then engine.step_optimizer(name) (no loss: it steps "
                "the gradients as they are)"
            )
        engine.accumulation_steps = self.steps
        self._ddp_handles: list[Any] = []
        self.on(engine, Event.TRAIN_START, self.train_start)
        self.on(engine, Event.STEP_START, self.step_start)
        self.on(engine, Event.LOSS, self.scale_loss)

    def train_start(self, ev: Any) -> None:
        # per-micro-batch handlers only where there is a gradient sync to skip (a DDP model,
        # possibly wrapped after attach): without them the hot path builds no payload per batch
        engine = ev.engine
        self._processes = world_size() if self.across_processes else 1  # read once per run, not per window
        if self._prescaled_source is not None:
            self.prescaled = bool(self._prescaled_source())
        self._synced = synced_module(engine)
        if self._synced is not None and self.steps > 1 and not self._ddp_handles:
            self._ddp_handles = [
                self.on(engine, Event.BATCH_START, self.batch_start, priority=Priority.LAST),
                self.on(engine, Event.BACKWARD_END, self.backward_end, priority=Priority.FIRST),
            ]

    def detach(self, engine: Engine) -> None:
        self._sync_off.close()
        super().detach(engine)
        self._ddp_handles = []
        engine.accumulation_steps = 1

    # -- the window ------------------------------------------------------------------------------
    def step_start(self, ev: StepStartEvent) -> None:
        if self._ddp_handles:
            self._sync_off.close()  # a failed window must not leave gradient sync switched off
        self.micro_batches_seen += len(ev.batches)
        if self.count_fn is None:
            label_names = ev.engine.label_names
            counts = [count_items(b, label_names) for b in ev.batches]
        else:
            counts = [self.count_fn(b) for b in ev.batches]
        if self.prescaled:
            self.window_items = window_total(counts, self._processes)
            self._factors = [float(self._processes)] * len(counts)  # DDP divides the summed gradients by W
        else:
            self._factors, self.window_items = window_factors(counts, self._processes, with_total=True)
        self._per_micro = None  # tensor weights are cast to the loss's device and dtype at the first LOSS
        ev.engine.step_outputs["num_items_in_batch"] = self.window_items  # HF's num_items_in_batch

    def scale_loss(self, ev: LossEvent) -> None:
        per_micro = self._per_micro
        if per_micro is None:
            per_micro = self._per_micro = self._weights_like(ev.loss)
        weight, has_items = per_micro[ev.micro_index]
        if has_items is True:
            ev.loss = ev.loss * weight
        else:  # a flag tensor (no host read), or a micro-batch known to have no items
            # a micro-batch without items contributes a zero gradient, not its 0/0 mean loss
            ev.loss = torch.where(has_items, ev.loss * weight, 0.0)

    def _weights_like(self, loss: torch.Tensor) -> list[tuple[Any, Any]]:
        """The window's factors as (weight, has_items) per micro-batch, on the loss's device and dtype."""
        factors = self._factors
        if isinstance(factors, torch.Tensor):
            weights = factors.to(loss)  # the loss's device and dtype
            # a weight is 0 when its micro-batch has no items (the window's total is at least 1), or
            # when it underflows in a low-precision loss dtype: that micro-batch contributes 0 either way
            return list(zip(weights.unbind(), (weights > 0).unbind()))
        # the flag tensor is only made when some micro-batch has no items
        no_items = None if all(factors) else torch.zeros((), dtype=torch.bool, device=loss.device)
        return [(factor, True) if factor else (0.0, no_items) for factor in factors]

    # -- DDP: all-reduce once per window ---------------------------------------------------------
    def batch_start(self, ev: BatchStartEvent) -> None:
        no_sync = getattr(self._synced, "no_sync", None)
        if callable(no_sync) and ev.micro_index < ev.window_size - 1:
            self._sync_off.enter_context(no_sync())

    def backward_end(self, ev: BackwardEndEvent) -> None:
        self._sync_off.close()

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "micro_batches_seen": self.micro_batches_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a different ``steps`` is the user's new choice; "micro_index" in older checkpoints was always 0
        self.micro_batches_seen = int(state.get("micro_batches_seen", 0))


def synced_module(engine: Engine) -> Any:
    """The module whose ``no_sync()`` skips the gradient all-reduce: the engine's model when it has one,
    else the module a plugin's ``trained_module()`` offers (the Distributed plugin's DDP wrapper)."""
    if callable(getattr(engine.model, "no_sync", None)):
        return engine.model
    for plugin in engine.plugins:
        offer = getattr(plugin, "trained_module", None)
        module = offer() if callable(offer) else None
        if callable(getattr(module, "no_sync", None)):
            return module
    return None


def window_factors(counts: Sequence[Count], num_processes: int = 1, *, with_total: bool = False) -> Any:
    """``n_i / N`` for each micro-batch of a window (``num_processes * n_i / N`` across processes).

    All counts ints (counted on the host or from shapes), one process: a list of Python floats, 0 for
    every micro-batch of a window without items; applying one is the multiply a hand-written loop
    does with ``/ k``. Counts that live on an accelerator: without reading any value back, a float64
    tensor of the k weights there (float32 on mps, which has no float64), 0 where a micro-batch has
    no items. Across processes ``N`` is the window's items on all ranks: one all-reduce of the local
    total. ``with_total=True`` returns ``(factors, N)``.
    """
    if num_processes > 1:
        factors, total = _factors_across_processes(counts, num_processes)
        return (factors, total) if with_total else factors
    try:
        stacked = torch.stack(counts)  # type: ignore[arg-type]  # the common case: tensors on one device
    except (TypeError, RuntimeError):  # ints among them, or tensors on several devices
        if all(isinstance(c, int) for c in counts):
            items = sum(int(c) for c in counts)
            host = [int(c) / items if items else 0.0 for c in counts]
            return (host, items) if with_total else host
        device = next(c.device for c in counts if isinstance(c, torch.Tensor))  # the first tensor's
        stacked = torch.stack([torch.as_tensor(c, device=device) for c in counts])
    stacked = stacked.float() if stacked.is_mps else stacked.double()
    total = stacked.sum()
    factors = stacked / total.clamp_min(1.0)  # all-zero window: weights 0 instead of 0/0
    return (factors, total) if with_total else factors


def window_total(counts: Sequence[Count], num_processes: int = 1) -> Count:
    """``N``: the window's items (on every rank across processes), an int when counted on the host."""
    if num_processes > 1:
        return _factors_across_processes(counts, num_processes)[1]
    if all(isinstance(c, int) for c in counts):
        return sum(int(c) for c in counts)
    device = next(c.device for c in counts if isinstance(c, torch.Tensor))
    return torch.stack([torch.as_tensor(c, device=device) for c in counts]).sum()


def _factors_across_processes(counts: Sequence[Count], num_processes: int) -> tuple[torch.Tensor, torch.Tensor]:
    device = collective_device()
    if all(isinstance(c, int) for c in counts):
        host = torch.tensor(counts, dtype=torch.float64)
        # from pinned memory the copy to a GPU does not block the host (a pageable one would)
        local = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    else:
        local = torch.stack([torch.as_tensor(c, device=device) for c in counts]).double()
    total = all_reduce_sum(local.sum())
    return local * (num_processes / total.clamp_min(1.0)), total  # DDP divides the summed gradients by W
