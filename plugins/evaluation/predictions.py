"""What an evaluation returns, as HF users know it, and HF's prediction step.

``EvalPrediction`` (what ``compute_metrics`` gets), ``PredictionOutput`` / ``EvalLoopOutput`` (what
``predict()`` / ``evaluation_loop`` return), the metric checks and prefixes, and ``hf_prediction_step``
(the logits are every model output but the loss and the ignored keys). ``EvalCollector`` (collector.py)
fills them.
"""

from __future__ import annotations

import numbers
import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch

from .tensors import Nested, nested_map


class EvalPrediction:
    """What ``compute_metrics`` receives (HF's ``transformers.EvalPrediction``).

    Unpacks as ``predictions, label_ids`` (plus ``inputs`` / ``losses`` when they were collected).

    Example:
        >>> import numpy as np
        >>> p = EvalPrediction(np.array([[0.1, 0.9]]), np.array([1]))
        >>> preds, labels = p
        >>> int(preds.argmax(-1)[0] == labels[0])
        1
    """

    def __init__(self, predictions: Nested, label_ids: Nested, inputs: Nested = None, losses: Any = None) -> None:
        self.predictions = predictions
        self.label_ids = label_ids
        self.inputs = inputs
        self.losses = losses
        extras = tuple(x for x in (inputs, losses) if x is not None)
        self._elements = (predictions, label_ids, *extras)

    def __iter__(self) -> Any:
        return iter(self._elements)

    def __getitem__(self, index: int) -> Any:
        return self._elements[index]

    def __len__(self) -> int:
        return len(self._elements)


class PredictionOutput(NamedTuple):
    """What ``predict`` returns (HF field names)."""

    predictions: Nested
    label_ids: Nested
    metrics: dict[str, Any] | None


class EvalLoopOutput(NamedTuple):
    """Everything one eval / predict pass collected (HF's ``EvalLoopOutput``)."""

    predictions: Nested
    label_ids: Nested
    metrics: dict[str, Any]
    num_samples: int


MetricsFn = Callable[[EvalPrediction], Mapping[str, Any]]
PreprocessFn = Callable[[Any, Any], Any]


def metric_number(key: str, value: Any) -> float | int:
    """A metric value as a Python number; numpy / tensor scalars are unwrapped, anything else is an error."""
    if isinstance(value, torch.Tensor | np.ndarray | np.generic) and np.size(value) == 1:
        value = value.item()
    if isinstance(value, bool | numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"metric {key!r} is {type(value).__name__} {value!r:.80}; metrics must be numbers "
        "(int, float, a numpy scalar or a one-element tensor)"
    )


def prefix_metrics(metrics: Any, prefix: str, *, source: str = "compute_metrics") -> dict[str, float | int]:
    """Check ``metrics`` is a str -> number mapping and prefix its keys with ``{prefix}_`` (HF rule)."""
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{source} must return a dict of metric name -> number, got {type(metrics).__name__}")
    out: dict[str, float | int] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"{source} returned a non-string metric name {key!r}")
        name = key if key.startswith(f"{prefix}_") else f"{prefix}_{key}"
        out[name] = metric_number(key, value)
    return out


def default_ignore_keys(model: torch.nn.Module, ignore_keys: list[str] | None) -> list[str]:
    """HF's rule for the outputs that are not predictions: the given keys, else the config's, else ``["cache"]``."""
    if ignore_keys is not None:
        return list(ignore_keys)
    config = getattr(model, "config", None)
    if config is None:
        return []
    return list(getattr(config, "keys_to_ignore_at_inference", None) or ["cache"])


def is_cache_object(value: Any) -> bool:
    """Whether ``value`` is a transformers KV cache (``DynamicCache``, ``EncoderDecoderCache``, ...).

    Checked by type, through ``sys.modules`` so that models without transformers never import it.
    """
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_type = getattr(cache_utils, "Cache", None)
    return isinstance(cache_type, type) and isinstance(value, cache_type)


def hf_prediction_step(
    ignore_keys: list[str] | None = None, can_return_loss: bool = False
) -> Callable[..., tuple[Any, Any, Any]]:
    """A ``prediction_step`` hook that picks logits like HF: every output but the loss and ``ignore_keys``.

    Dict / ModelOutput outputs give the tuple of their other entries (one entry: that tensor);
    tuple outputs drop a leading scalar loss. Use with ``engine.set_hook("prediction_step", ...)``.
    ``ignore_keys=None`` means the model's ``config.keys_to_ignore_at_inference`` (``["cache"]`` when the
    config has none, as transformers 5 does). A transformers cache object (a causal or seq2seq LM's
    ``past_key_values``) is never a prediction: it is left out whatever the keys and the version say.
    """

    def prediction_step(model: torch.nn.Module, batch: Any, forward: Any, compute_loss: Any, label_names: Any) -> Any:
        from trainbus.hooks import get_labels

        ignored = {*default_ignore_keys(model, ignore_keys), "loss"}
        labels = get_labels(batch, tuple(label_names))  # before the forward: a compute_loss may pop them (HF)
        if labels is None and not label_names and _returns_loss(batch, can_return_loss):
            labels = ()  # transformers' loss_without_labels: the loss, and no labels
        outputs = forward(model, batch)
        loss = None if labels is None else compute_loss(outputs, batch).detach()
        if isinstance(outputs, Mapping):
            logits: Any = tuple(
                v for k, v in outputs.items() if k not in ignored and v is not None and not is_cache_object(v)
            )
        elif isinstance(outputs, list | tuple):
            has_loss = bool(outputs) and isinstance(outputs[0], torch.Tensor) and outputs[0].dim() == 0
            logits = tuple(outputs[1:] if has_loss else outputs)
        else:
            logits = outputs
        if isinstance(logits, tuple) and len(logits) == 1:
            logits = logits[0]
        return loss, nested_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, logits), labels

    return prediction_step


def _returns_loss(batch: Any, can_return_loss: bool) -> bool:
    """transformers' ``return_loss``: the batch's ``return_loss`` entry, else the model's ``can_return_loss``."""
    asked = batch.get("return_loss") if isinstance(batch, Mapping) else None
    return bool(can_return_loss if asked is None else asked)


def loader_rows(dataloader: Any) -> tuple[int | None, int | None]:
    """``(rows per batch, rows of the dataset)`` of a DataLoader, as transformers' evaluation loop weighs a batch's
    loss: ``eval_batch_size`` copies of it, the last batch's cut to what is left of the dataset (accelerate's
    ``gather_for_metrics``). None where unknown (no batch_size: a batch sampler; a dataset without a length:
    each batch then stands for the rows it has)."""
    per_batch = getattr(dataloader, "batch_size", None)
    try:
        rows = len(dataloader.dataset) if per_batch is not None else None
    except (AttributeError, TypeError):
        rows = None
    return per_batch, rows


def batch_rows(per_batch: int | None, dataset_rows: int | None, rows_before: int, observed: int) -> int:
    """The rows a batch's mean loss stands for (see ``loader_rows``): the observed batch size where the loader
    says nothing. A packed / padding-free batch (one row of many examples) counts as the examples it holds."""
    if per_batch is None or dataset_rows is None:  # an iterable set's batches: accelerate cuts to what came
        return observed
    return max(0, min(per_batch, dataset_rows - rows_before))
