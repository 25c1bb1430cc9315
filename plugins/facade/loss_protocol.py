"""What a model's loss averages over, read from the protocol transformers models declare.

Gradient accumulation is exact when every micro-batch's loss is weighted by the share of the
window's items it averages over. Two facts decide that share, and both come from the model:

- **which labels count.** A causal LM predicts token t+1 from token t: its loss averages over
  ``labels[..., 1:]`` (or a collator's ``shift_labels``), not over ``labels``. Counting the unshifted
  labels gives every sequence one item too many, and the gradient of a window of uneven sequences
  is then off (9% in a four-sequence trial). transformers marks causal LMs by listing them in
  ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` or by their ``loss_type``; encoder-decoders shift inside the
  decoder and count every label.
- **whether the model divides by ``num_items_in_batch``.** transformers' rule: it passes the window's
  item count to a forward that takes loss kwargs (the model's ``accepts_loss_kwargs``, else a
  ``**kwargs`` parameter) when the batch's ``labels`` are a tensor it can count, and then takes the
  loss as already normalised over the window. Many forwards take ``**kwargs`` and ignore the count
  (BERT's heads, T5, a detection model whose labels are a list of dicts, which transformers does
  not count at all): transformers' assumption then sums k means. trainbus passes the count exactly
  where transformers does, and *measures* whether the loss divides by it (``divides_by_items``: the
  forward run twice on the step's first batch, with the count and with twice the count, in eval
  mode, without gradients, the random generators restored), so the window's loss stays its mean.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from trainbus.hooks import get_labels

from ..data.rng import rng_state, set_rng_state
from ..optimization.accumulation import IGNORE_INDEX, Count, CountItems, count_items


def unwrap_model(model: Any) -> Any:
    """The module whose forward defines the protocol: through DDP / compile wrappers and a peft model."""
    for _ in range(8):
        if hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None)):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
        else:
            break
    return model


def accepts_loss_kwargs(model: Any) -> bool:
    """transformers' rule: the model's ``accepts_loss_kwargs``, else whether its forward takes ``**kwargs``."""
    model = unwrap_model(model)
    declared = getattr(model, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    params = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def counted_by_transformers(batch: Any) -> bool:
    """Whether transformers counts ``num_items_in_batch`` for this batch (``_get_num_items_in_batch``): a dict
    batch with ``labels`` whose labels (or ``shift_labels``) are a tensor. A detection model's list of
    per-image dicts is not counted: transformers passes no count and divides the loss by the steps."""
    if not isinstance(batch, Mapping) or "labels" not in batch:
        return False
    labels = batch["shift_labels"] if "shift_labels" in batch else batch["labels"]
    return isinstance(labels, torch.Tensor)


def divides_by_items(model: Any, batch: Any, count: Any) -> bool | None:
    """Measured: whether ``model(**batch, num_items_in_batch=n)`` returns a loss divided by ``n``.

    The forward runs twice, with ``count`` and with ``2 * count``: a loss that halves divides by it, one
    that stays the same ignores it. Eval mode (no dropout, no batch-norm statistics updated), no
    gradients, every global random generator restored after each run, so training draws what it
    would have drawn. None when it cannot tell (no items, no loss, a zero or non-finite loss, another
    ratio): the caller then keeps transformers' assumption.
    """
    model = unwrap_model(model)
    if not accepts_loss_kwargs(model):  # transformers passes it no count (T5 on transformers 4.x): nothing to divide
        return False
    if not counted_by_transformers(batch) or not (isinstance(count, torch.Tensor) or count):
        return None
    count = torch.as_tensor(count, device=_labels_of(batch).device)
    if int(count) <= 0:
        return None
    was_training = model.training
    losses = []
    try:
        model.eval()
        for items in (count, count * 2):
            states = rng_state()
            try:
                with torch.no_grad():
                    losses.append(_loss_of(model(**batch, num_items_in_batch=items)))
            finally:
                set_rng_state(states)
    finally:
        model.train(was_training)
    if any(loss is None for loss in losses):
        return None
    once, twice = (float(loss.detach().float().sum()) for loss in losses)  # type: ignore[union-attr]
    if not (math.isfinite(once) and math.isfinite(twice)) or once == 0.0:
        return None
    ratio = twice / once
    if abs(ratio - 0.5) < 1e-3:
        return True
    return False if abs(ratio - 1.0) < 1e-3 else None


def _labels_of(batch: Mapping[str, Any]) -> torch.Tensor:
    return batch["shift_labels"] if "shift_labels" in batch else batch["labels"]  # type: ignore[no-any-return]


def _loss_of(outputs: Any) -> torch.Tensor | None:
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, tuple | list) and outputs:
        loss = outputs[0]
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def default_label_names(model: Any) -> list[str]:
    """transformers' default ``label_names``: ``find_labels`` of the model's class (its forward's parameters
    naming a label; a question-answering model's start / end positions). A CLIP-like model has none."""
    model = unwrap_model(model)
    if "transformers" in sys.modules:
        from transformers.utils import find_labels

        return list(find_labels(type(model)))
    # the same rule without importing transformers (a script that never did keeps its start-up light)
    parameters = inspect.signature(type(model).forward).parameters
    qa = "QuestionAnswering" in type(model).__name__
    return [p for p in parameters if "label" in p or (qa and p in ("start_positions", "end_positions"))]


def loss_shifts_labels(model: Any) -> bool:
    """Whether the model's loss averages over ``labels[..., 1:]``: a transformers decoder-only causal LM."""
    model = unwrap_model(model)
    if "transformers" not in sys.modules or getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return False
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:  # pragma: no cover - every supported transformers has it
        return False
    return type(model).__name__ in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) or (
        getattr(model, "loss_type", None) == "ForCausalLM"
    )


def item_counter(model: Any, label_names: Sequence[str]) -> CountItems:
    """``fn(batch) -> items`` counting what the model's loss averages over (see the module docstring)."""
    names = tuple(label_names)
    if not loss_shifts_labels(model):
        return functools.partial(count_items, label_names=names)
    return functools.partial(count_shifted_items, label_names=names)


def count_shifted_items(batch: Any, label_names: tuple[str, ...] = ("labels",)) -> Count:
    """A causal LM's items: ``shift_labels`` when the collator made them, else ``labels[..., 1:]``, not -100.

    Host labels are counted on the host into an int (no kernel, no sync), device labels on the device.
    """
    labels = batch.get("shift_labels") if isinstance(batch, Mapping) else None
    if labels is None:
        labels = get_labels(batch, label_names)
        if isinstance(labels, tuple):
            labels = labels[0]
        if not isinstance(labels, torch.Tensor) or labels.dim() == 0:
            return count_items(batch, label_names)
        labels = labels[..., 1:]
    if labels.device.type == "cpu":
        return int(np.count_nonzero(labels.numpy() != IGNORE_INDEX))
    return labels.ne(IGNORE_INDEX).sum()
