"""Checks and error messages of the Trainer facade, kept out of ``trainer.py``.

The engine's messages speak the engine's language (``Engine(..., loss_fn=...)``); a Trainer user has
no ``loss_fn`` to pass, so the Trainer's path re-words them in transformers' terms: make the model
return a loss, pass ``compute_loss_func``, or override ``compute_loss``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trainbus.engine import ConfigError
from trainbus.hooks import loss_from_outputs as engine_loss_from_outputs


def check_model(model: Any) -> None:
    """The Trainer's model must be a ``torch.nn.Module`` (``model='x'`` failed as ``'str' has no attribute 'to'``)."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"Trainer: model must be a torch.nn.Module (e.g. a transformers PreTrainedModel), got {model!r} "
            f"({type(model).__name__}); to load one by name use AutoModelFor...from_pretrained(name)"
        )


def loss_from_outputs(outputs: Any, batch: Any = None) -> torch.Tensor:
    """The engine's ``loss_from_outputs``, with an error that tells a Trainer user what to do."""
    try:
        loss: torch.Tensor = engine_loss_from_outputs(outputs)
    except ValueError:
        raise ConfigError(no_loss_message(outputs, batch)) from None
    return loss


def compute_loss(outputs: Any, batch: Any) -> torch.Tensor:
    """The Trainer's default ``compute_loss`` hook: the loss the model returned, as transformers' Trainer takes it.

    As deep as the engine's default (one frame above ``loss_from_outputs``): it runs every micro-batch.
    """
    try:
        return engine_loss_from_outputs(outputs)
    except ValueError:
        raise ConfigError(no_loss_message(outputs, batch)) from None


def no_loss_message(outputs: Any, batch: Any) -> str:
    """Why the model's outputs hold no loss, and the Trainer's three ways to get one."""
    got = type(outputs).__name__
    if isinstance(outputs, Mapping):
        got += f" with keys {sorted(map(str, outputs))}"
    why = ""
    if isinstance(batch, list | tuple) and not hasattr(batch, "_fields"):
        why = (
            " The batches are tuples, so the model was called with the inputs only and could not compute a loss"
            " from labels; a dataset of dicts such as {'input_ids': ..., 'labels': ...} calls model(**batch)."
        )
    return (
        f"the model returned no loss (looked at .loss, ['loss'], [0] and a scalar tensor; got {got}).{why} "
        "The Trainer takes the loss from the model's outputs, as transformers' does: make the model return a loss "
        "when it gets labels, pass Trainer(..., compute_loss_func=fn) with fn(outputs, labels, num_items_in_batch) "
        "-> loss, or subclass Trainer and override compute_loss"
    )
