"""Collators and unused-column removal: what turns a data set's examples into a model's batch (HF's rules).

* ``default_data_collator``: HF's rules for dict examples (stack tensors and numbers, ``label`` ->
  ``labels``, skip strings), torch's ``default_collate`` for tuples.
* ``DataCollatorWithPadding``: pads with a tokenizer-like ``processing_class.pad``.
* ``remove_unused_columns`` / ``RemoveColumnsCollator``: drop what the model's forward does not take
  (HF's ``remove_unused_columns``), on a ``datasets.Dataset`` or per batch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from trainbus.engine import ConfigError

Collator = Callable[[list[Any]], Any]


def default_data_collator(features: list[Any]) -> Any:
    """Collate a list of examples into a batch, as HF's ``default_data_collator`` does for dicts.

    Dict examples: tensors are stacked, numbers and lists become tensors, ``label`` / ``label_ids``
    become ``labels`` (long for ints, float otherwise), ``None`` and strings are dropped. Other
    examples (tuples, tensors) go through ``torch.utils.data.default_collate``.
    """
    if not features:
        raise ConfigError("cannot collate an empty list of examples")
    first = features[0]
    if not isinstance(first, Mapping):
        return default_collate(features)
    batch: dict[str, Any] = {}
    for label_key in ("label", "label_ids"):
        if label_key in first and first[label_key] is not None:
            value = first[label_key]
            if isinstance(value, torch.Tensor):
                value = value.item() if value.dim() == 0 else value
            values = [f[label_key] for f in features]
            if isinstance(value, torch.Tensor):
                batch["labels"] = torch.stack(values)
            else:
                dtype = torch.long if isinstance(value, int) or _is_int_list(value) else torch.float
                batch["labels"] = torch.tensor(values, dtype=dtype)
            break
    for key, value in first.items():
        if key in ("label", "label_ids") or value is None or isinstance(value, str):
            continue
        values = [f[key] for f in features]
        if isinstance(value, torch.Tensor):
            batch[key] = torch.stack(values)
        elif hasattr(value, "__array__") and not isinstance(value, list | tuple):
            batch[key] = torch.as_tensor(__import__("numpy").stack(values))
        else:
            batch[key] = torch.tensor(values)
    return batch


def _is_int_list(value: Any) -> bool:
    return isinstance(value, list | tuple) and bool(value) and isinstance(value[0], int)


class DataCollatorWithPadding:
    """Pad dict examples to the longest in the batch with ``tokenizer.pad`` (HF's collator of that name).

    Args:
        tokenizer: anything with ``pad(features, padding=..., return_tensors="pt")`` (a HF tokenizer).
        padding: passed to ``pad`` (``True`` = longest in the batch).
        pad_to_multiple_of: passed to ``pad``.
    """

    def __init__(self, tokenizer: Any, padding: bool | str = True, pad_to_multiple_of: int | None = None) -> None:
        if not callable(getattr(tokenizer, "pad", None)):
            raise ConfigError(f"DataCollatorWithPadding needs an object with a pad() method, got {type(tokenizer)}")
        self.tokenizer = tokenizer
        self.padding = padding
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: list[Mapping[str, Any]]) -> dict[str, Any]:
        batch = dict(
            self.tokenizer.pad(
                [dict(f) for f in features],
                padding=self.padding,
                pad_to_multiple_of=self.pad_to_multiple_of,
                return_tensors="pt",
            )
        )
        for label_key in ("label", "label_ids"):
            if label_key in batch:
                batch["labels"] = batch.pop(label_key)
        return batch


def is_tokenizer_like(obj: Any) -> bool:
    """A processing_class that can pad batches (HF tokenizers and processors with ``pad``)."""
    return obj is not None and callable(getattr(obj, "pad", None))


# -- unused columns -----------------------------------------------------------------------------
def signature_columns(model: torch.nn.Module, label_names: Sequence[str]) -> list[str]:
    """The batch keys the model's forward names, plus label keys (transformers' rule).

    As transformers does, a ``**kwargs`` forward keeps only the arguments it names (a raw ``text``
    column goes, though ``**kwargs`` would take it), and a peft model is read through its base model.
    """
    if callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config"):
        model = model.get_base_model()
    params = inspect.signature(model.forward).parameters
    return list(dict.fromkeys([*params, "label", "label_ids", *label_names]))


def _unused_error(columns: Iterable[str], keep: Sequence[str], model: torch.nn.Module) -> ConfigError:
    return ConfigError(
        f"no column of the dataset ({sorted(columns)}) matches the arguments of {type(model).__name__}.forward "
        f"({[k for k in keep if k not in ('label', 'label_ids')]}); rename the columns or set "
        "remove_unused_columns=False"
    )


def remove_unused_columns(dataset: Any, model: torch.nn.Module, label_names: Sequence[str]) -> Any:
    """For a HF ``datasets.Dataset``: drop columns the model's forward does not take (HF's rule).

    Other datasets are returned unchanged; ``RemoveColumnsCollator`` drops their keys per batch.
    """
    return remove_columns_but(dataset, signature_columns(model, label_names), model)


def is_columnar(dataset: Any) -> bool:
    """Whether ``dataset`` is a HF ``datasets.Dataset`` (or alike): column names and ``remove_columns``."""
    return isinstance(getattr(dataset, "column_names", None), list) and callable(
        getattr(dataset, "remove_columns", None)
    )


def remove_columns_but(dataset: Any, keep: Sequence[str], model: torch.nn.Module) -> Any:
    """``dataset`` without the columns not in ``keep`` (a columnar one; others unchanged); none kept is an error."""
    if not is_columnar(dataset):
        return dataset
    names = dataset.column_names
    drop = [c for c in names if c not in keep]
    if len(drop) == len(names):
        raise _unused_error(names, keep, model)
    return dataset.remove_columns(drop) if drop else dataset


class RemoveColumnsCollator:
    """Drops the keys of dict examples the model's forward does not accept, then collates."""

    def __init__(self, collator: Collator, keep: Sequence[str], model: torch.nn.Module) -> None:
        self.collator = collator
        self.keep = set(keep)
        self.model = model

    def __call__(self, features: list[Any]) -> Any:
        if features and isinstance(features[0], Mapping):
            kept = [{k: v for k, v in f.items() if k in self.keep} for f in features]
            if not kept[0]:
                raise _unused_error(features[0].keys(), sorted(self.keep), self.model)
            features = kept
        return self.collator(features)


# -- seeded shuffling and resumable epochs -------------------------------------------------------
