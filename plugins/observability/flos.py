"""FloCounter: HF's ``total_flos``, the floating-point operations of a run's forwards and backwards.

Per micro-batch (at LOSS) it adds the estimate of ``flos_of(batch)``: by default the model's own
``floating_point_ops`` if it has one, else for transformers models HF's 6 x main-input elements x
non-embedding parameters (``estimate_flos``); the Trainer passes its ``floating_point_ops`` so that a
subclass's override is used, as in HF. Before a logging point, a checkpoint or the train-end metrics
read ``state.total_flos`` (LOG, SAVE, TRAIN_END, priority FIRST) the count is added to it, summed
over processes. Only shapes are read: no host sync.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import Event, Plugin, Priority
from trainbus.engine.errors import check_callable

from ..distributed.processes import all_reduce_sum, collective_device, world_size

if TYPE_CHECKING:
    from trainbus.engine import Engine, LossEvent, Payload, TrainStartEvent


def has_flos_estimate(model: Any) -> bool:
    """Whether ``estimate_flos`` can say anything for ``model`` (HF counts only for transformers models)."""
    return callable(getattr(model, "floating_point_ops", None)) or callable(getattr(model, "num_parameters", None))


class FloCounter(Plugin):
    """Counts FLOs per micro-batch into ``state.total_flos`` (HF's ``floating_point_ops`` / ``store_flos``).

    Args:
        flos_of: ``fn(inputs) -> int``, the FLOs of one forward and backward on a batch (a Mapping);
            default ``estimate``, on the engine's model.

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> class Counted(torch.nn.Linear):
        ...     def floating_point_ops(self, inputs):
        ...         return 10 * inputs["x"].shape[0]
        ...     def forward(self, x, labels):
        ...         return torch.nn.functional.mse_loss(super().forward(x), labels)
        >>> model = Counted(2, 1)
        >>> data = [{"x": torch.randn(4, 2), "labels": torch.randn(4, 1)}] * 3
        >>> engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data,
        ...                 max_epochs=1, plugins=[FloCounter()])
        >>> engine.fit().total_flos
        120.0
    """

    def __init__(self, flos_of: Callable[[Any], int] | None = None) -> None:
        check_callable("flos_of", flos_of, "a function flos_of(batch) -> the batch's floating point operations")
        self.flos_of = flos_of
        #: FLOs counted since they were last added to ``state.total_flos`` (HF's ``current_flos``)
        self.current_flos = 0.0
        self._non_embedding_parameters: int | None = None
        self._model: Any = None

    def attach(self, engine: Engine) -> None:
        self._model = engine.model
        self.on(engine, Event.TRAIN_START, self.train_start)
        self.on(engine, Event.LOSS, self.add_flos)
        for event in (Event.LOG, Event.SAVE, Event.TRAIN_END):  # before logs, checkpoints and train metrics read it
            self.on(engine, event, self.store_handler, priority=Priority.FIRST)

    def train_start(self, ev: TrainStartEvent) -> None:
        self._model = ev.engine.model
        self.current_flos, self._non_embedding_parameters = 0.0, None  # counted again: the model may be new

    def estimate(self, inputs: Mapping[str, Any], model: Any = None) -> int:
        """HF's ``floating_point_ops``: the model's own estimate, else 6 x main-input elements x
        non-embedding parameters for a transformers model, else 0."""
        model = self._model if model is None else model
        own = getattr(model, "floating_point_ops", None)
        if callable(own):
            return int(own(inputs))
        main_input = getattr(model, "main_input_name", "input_ids")
        if main_input not in inputs or not callable(getattr(model, "num_parameters", None)):
            return 0
        if self._non_embedding_parameters is None:  # counted once: HF walks every parameter per batch
            self._non_embedding_parameters = int(model.num_parameters(exclude_embeddings=True))
        return 6 * int(inputs[main_input].numel()) * self._non_embedding_parameters

    def add_flos(self, ev: LossEvent) -> None:
        if isinstance(ev.batch, Mapping):  # a collator's BatchEncoding is a UserDict, not a dict
            flos_of = self.flos_of if self.flos_of is not None else self.estimate
            self.current_flos += float(flos_of(ev.batch))  # shapes only: no host sync

    def store(self, engine: Engine) -> None:
        """Add the FLOs counted since the last call to ``state.total_flos`` (summed over processes, as HF)."""
        flos, self.current_flos = self.current_flos, 0.0
        if world_size() > 1:
            flos = float(all_reduce_sum(torch.tensor(flos, dtype=torch.float64, device=collective_device())).item())
        engine.state.total_flos += flos

    def store_handler(self, ev: Payload) -> None:
        self.store(ev.engine)
