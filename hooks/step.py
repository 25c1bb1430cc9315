"""The default pieces of a training step: forward, loss, backward, optimizer step.

Each is a plain function with explicit inputs and outputs; the engine calls whatever
``engine.hooks`` holds, so a user replaces a piece by passing another function with the same
signature, and a plugin wraps one (autocast around forward, a scaler around backward).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .batch import get_labels

LossFn = Callable[[Any, Any], torch.Tensor]


def forward(model: torch.nn.Module, batch: Any) -> Any:
    """Call the model the way its batch is shaped.

    dict -> ``model(**batch)``; (inputs, target) tuple/list -> ``model(inputs)``; longer tuples ->
    ``model(*batch[:-1])``; anything else -> ``model(batch)``.
    """
    if type(batch) is tuple or type(batch) is list:
        return model(batch[0]) if len(batch) == 2 else model(*batch[:-1]) if len(batch) > 2 else model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, list | tuple) and not hasattr(batch, "_fields"):
        if len(batch) == 2:
            return model(batch[0])
        if len(batch) > 2:
            return model(*batch[:-1])
    return model(batch)


def loss_from_outputs(outputs: Any) -> torch.Tensor:
    """The loss a model computed itself: ``outputs.loss``, ``outputs["loss"]``, ``outputs[0]``, or a scalar."""
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    if loss is None and isinstance(outputs, list | tuple) and outputs and isinstance(outputs[0], torch.Tensor):
        loss = outputs[0]
    if loss is None and isinstance(outputs, torch.Tensor) and outputs.dim() == 0:
        loss = outputs
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            "could not find a scalar loss in the model outputs (looked at .loss, ['loss'], [0] and a scalar "
            f"tensor; got {type(outputs).__name__}); pass a loss function, "
            "e.g. Engine(..., loss_fn=nn.CrossEntropyLoss())"
        )
    return loss


def model_output(outputs: Any) -> Any:
    """The prediction part of model outputs: logits when named, else the first tensor."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if logits is None and isinstance(outputs, Mapping):
        logits = outputs.get("logits")
    if logits is None and isinstance(outputs, list | tuple) and outputs:
        logits = outputs[0]
    return outputs if logits is None else logits


def compute_loss(outputs: Any, batch: Any) -> torch.Tensor:
    """Default loss: the loss the model returned (HF models compute it from ``labels``)."""
    return loss_from_outputs(outputs)


def loss_with(loss_fn: LossFn, label_names: tuple[str, ...] = ("labels",)) -> Callable[[Any, Any], torch.Tensor]:
    """A compute_loss hook that applies ``loss_fn(prediction, labels)``, e.g. ``nn.CrossEntropyLoss()``."""

    def compute_loss_with_fn(outputs: Any, batch: Any) -> torch.Tensor:
        if type(batch) is tuple and len(batch) == 2 and type(outputs) is torch.Tensor:
            return loss_fn(outputs, batch[1])  # the (inputs, target) case, without the general lookups
        labels = get_labels(batch, label_names)
        if labels is None:
            raise ValueError(f"the batch has no labels (looked for {label_names} or a trailing tuple element)")
        return loss_fn(model_output(outputs), labels)

    compute_loss_with_fn.__qualname__ = f"loss_with({getattr(loss_fn, '__qualname__', type(loss_fn).__name__)})"
    return compute_loss_with_fn


# The last three defaults are the torch calls themselves, not Python wrappers around them: they
# run once per step, and a step of a small model is ~200 us, so a saved frame is measurable.

#: ``backward(loss)``: ``loss.backward()``
backward: Callable[[torch.Tensor], None] = torch.Tensor.backward

#: ``optimizer_step(optimizer)``: ``optimizer.step()``. A replacement returns False when it did
#: not step (an AMP overflow); any other result, None included, counts as a step taken.
optimizer_step: Callable[[torch.optim.Optimizer], Any] = operator.methodcaller("step")

#: ``zero_grad(optimizer)``: ``optimizer.zero_grad(set_to_none=True)``
zero_grad: Callable[[torch.optim.Optimizer], None] = operator.methodcaller("zero_grad", set_to_none=True)
