"""The functional pieces of a step, and the ``Hooks`` bundle the engine composes.

``hooks/`` is a leaf: it imports torch only, never the engine. Replace a piece by giving the
engine another function with the same signature::

    engine = Engine(model, opt, train_data=loader, max_epochs=1,
                    hooks=Hooks(compute_loss=my_loss))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from .batch import batch_size_of, get_labels, to_device
from .data import epoch_iterator, eval_data
from .predict import prediction_step
from .step import backward, compute_loss, forward, loss_from_outputs, loss_with, model_output, optimizer_step, zero_grad


@dataclass(frozen=True)
class Hooks:
    """The replaceable functions of the loop. Defaults are the functions of this package.

    Frozen: the engine reads its hooks into locals once per window and re-reads them only when
    ``engine.hooks`` is another object, so a piece is changed with ``engine.set_hook`` /
    ``wrap_hook`` (which compose a new ``Hooks``), never by assigning to a field.
    """

    to_device: Callable[[Any, torch.device | None], Any] = to_device
    forward: Callable[[torch.nn.Module, Any], Any] = forward
    compute_loss: Callable[[Any, Any], torch.Tensor] = compute_loss
    backward: Callable[[torch.Tensor], None] = backward
    optimizer_step: Callable[[torch.optim.Optimizer], Any] = optimizer_step  # False: did not step
    zero_grad: Callable[[torch.optim.Optimizer], None] = zero_grad
    prediction_step: Callable[..., tuple[torch.Tensor | None, Any, Any]] = prediction_step
    epoch_iterator: Callable[[Iterable[Any], int, int], Iterator[Any]] = epoch_iterator
    eval_data: Callable[[Iterable[Any]], Iterable[Any]] = eval_data

    @staticmethod
    def names() -> tuple[str, ...]:
        return tuple(f.name for f in fields(Hooks))


__all__ = [
    "Hooks",
    "backward",
    "batch_size_of",
    "compute_loss",
    "epoch_iterator",
    "eval_data",
    "forward",
    "get_labels",
    "loss_from_outputs",
    "loss_with",
    "model_output",
    "optimizer_step",
    "prediction_step",
    "to_device",
    "zero_grad",
]
