"""The default evaluation / prediction step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .batch import get_labels
from .step import model_output


def prediction_step(
    model: torch.nn.Module,
    batch: Any,
    forward: Callable[[torch.nn.Module, Any], Any],
    compute_loss: Callable[[Any, Any], torch.Tensor],
    label_names: tuple[str, ...] = ("labels",),
) -> tuple[torch.Tensor | None, Any, Any]:
    """Run one evaluation batch: (loss or None when the batch has no labels, logits, labels).

    The caller has already entered ``torch.inference_mode`` and put the model in eval mode.
    """
    outputs = forward(model, batch)
    labels = get_labels(batch, label_names)
    loss: torch.Tensor | None = None
    if labels is not None:
        loss = compute_loss(outputs, batch).detach()
    logits = model_output(outputs)
    if isinstance(logits, torch.Tensor):
        logits = logits.detach()
    return loss, logits, labels
