"""What a model's loss averages over, read from the protocol transformers models declare.

Gradient accumulation is exact when every micro-batch's loss is weighted by the share of the
window's items it averages over. Two facts decide that share, and both come from the model:

- **which labels count.** A causal LM predicts token t+1 from token t: its loss averages over
  ``labels[..., 1:]`` (or a collator's ``shift_labels``), not over ``labels``. Counting the unshifted
  labels gives every sequence one item too many, and the gradient of a window of uneven sequences
  is then off (9% in a four-sequence trial). transformers marks causal LMs by listing them in
  ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` or by their ``loss_type``; encoder-decoders shift inside the
  decoder and count every label.
- **whether the model divides by ``num_items_in_batch``.** transformers passes the window's item
  count to a forward that takes loss kwargs (``accepts_loss_kwargs``, else a ``**kwargs``
  parameter). A model whose loss goes through ``self.loss_function(..., **kwargs)`` (GPT-2, Llama)
  then returns ``sum / num_items_in_batch``: already normalised over the window. Many forwards
  take ``**kwargs`` and ignore it (BERT's masked-LM and token-classification heads, T5): they
  return their own mean, and transformers, which assumes the division happened, sums k means
  without dividing. trainbus passes the count as transformers does, and weights the loss itself
  unless the forward visibly uses it.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from trainbus.hooks import get_labels

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
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params) or "num_items_in_batch" in {
        p.name for p in params
    }


def honours_num_items(model: Any) -> bool:
    """Whether the loss the forward returns is divided by the ``num_items_in_batch`` it is given.

    A forward that names ``num_items_in_batch`` uses it; a ``**kwargs`` forward does when its source
    hands the kwargs to ``self.loss_function`` (transformers' loss functions divide by the count).
    Where the source cannot be read, transformers' assumption (it does) holds.
    """
    model = unwrap_model(model)
    if not accepts_loss_kwargs(model):
        return False
    return _forward_uses_num_items(type(model))


@functools.lru_cache(maxsize=64)
def _forward_uses_num_items(cls: type) -> bool:
    forward = cls.forward  # type: ignore[attr-defined]
    if "num_items_in_batch" in inspect.signature(forward).parameters:
        return True
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return True
    return "loss_function(" in source or "num_items_in_batch" in source


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
