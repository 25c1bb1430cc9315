"""One eval / predict pass's collected state (``EvalPass``) and the collector's per-batch helpers."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .predictions import EvalPrediction
from .tensors import ShardLayout


@dataclass
class EvalPass:
    """What one eval / predict pass has collected so far."""

    prefix: str
    started: float
    layout: ShardLayout | None
    batches: int = 0
    samples: int = 0  # local samples seen (for the shard offset)
    loss_sum: torch.Tensor | None = None  # on device; single-process loss only
    loss_count: int = 0
    rows: tuple[int | None, int | None] = (None, None)  # the loader's rows per batch and dataset rows (loader_rows)
    device: dict[str, list[Any]] = field(default_factory=dict)  # name -> chunks not yet moved to the host
    host: dict[str, list[Any]] = field(default_factory=dict)
    positions: list[torch.Tensor] = field(default_factory=list)  # distributed: global position of every row
    keep_outputs: bool = True  # False: batch_eval_metrics evaluation, predictions are not kept
    pending: EvalPrediction | None = None  # batch_eval_metrics: the latest batch, not yet passed on


def takes_compute_result(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` accepts a ``compute_result`` keyword (named, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read (some builtins): let the call tell
        return True
    return any(p.name == "compute_result" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def inputs_of(batch: Any, input_name: str) -> Any:
    """The model inputs of a batch, as HF's ``include_for_metrics=["inputs"]`` takes them."""
    if isinstance(batch, Mapping):
        return batch.get(input_name)
    if isinstance(batch, list | tuple) and batch:
        return batch[0]
    return batch if isinstance(batch, torch.Tensor) else None
