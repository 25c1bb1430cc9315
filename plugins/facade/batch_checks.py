"""What is wrong with a batch's samples, said at the first batch instead of by the collator's internals.

A data set of ``None`` items failed in ``default_collate`` ("batch must contain tensors ... found
NoneType"), tensors of different lengths in ``torch.stack`` ("stack expects each tensor to be equal
size"), and string labels were dropped by the default collator (as transformers' drops strings) so the
model got no labels and the run stopped with "the model returned no loss". ``CheckedCollator`` wraps the
loader's collator: when the collator raises it looks at the samples and, if it can say which sample or
field is wrong, raises a ``ConfigError`` naming it (the collator's own error chained); on its first batch
it refuses label fields that hold strings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from trainbus.engine import ConfigError


class CheckedCollator:
    """``collate(samples)``, with bad samples named. A class (not a closure) so worker processes can pickle it."""

    def __init__(self, collate: Callable[[list[Any]], Any], label_names: Sequence[str]) -> None:
        self.collate = collate
        self.label_names = tuple(label_names)
        self._first = True

    def __call__(self, samples: list[Any]) -> Any:
        if self._first:
            self._first = False
            check_label_values(samples, self.label_names)
        try:
            return self.collate(samples)
        except (TypeError, RuntimeError, ValueError) as exc:
            problem = describe_bad_samples(samples)
            if problem is None:
                raise
            raise ConfigError(f"{problem} (the collator failed: {type(exc).__name__}: {exc})") from exc


def check_label_values(samples: list[Any], label_names: Sequence[str]) -> None:
    """Label fields of dict samples hold numbers (or tensors / arrays of them), not strings."""
    for position, sample in enumerate(samples):
        if not isinstance(sample, Mapping):
            return
        for name in (*label_names, "label", "label_ids"):
            value = sample.get(name)
            if isinstance(value, str) or (isinstance(value, list | tuple) and value and isinstance(value[0], str)):
                raise ConfigError(
                    f"the samples' {name!r} holds strings ({value!r} in the batch's sample {position}): the model "
                    "needs numbers to compute a loss (the default collator drops strings, as transformers' does). "
                    "Map the labels to class ids first (e.g. with a label2id dict, or datasets' class_encode_column)"
                )


def describe_bad_samples(samples: list[Any]) -> str | None:
    """What makes these samples impossible to collate, in words; None when nothing is seen."""
    for position, sample in enumerate(samples):
        if sample is None:
            return (
                f"sample {position} of the batch is None: a data set must give a sample (a dict of tensors, "
                "numbers or lists, or a tuple) for every index; filter out the missing ones"
            )
    if not samples or not all(isinstance(s, Mapping) for s in samples):
        return None
    for key in samples[0]:
        shapes = {shape for shape in (_shape(s.get(key)) for s in samples) if shape is not None}
        if len(shapes) > 1:
            listed = ", ".join(str(shape) for shape in sorted(shapes))
            return (
                f"the samples' {key!r} have different shapes ({listed}) and the collator stacks them: pad them to "
                "one length (pass the tokenizer as processing_class, or data_collator=DataCollatorWithPadding("
                "tokenizer)), or give a data_collator that pads"
            )
        if any(s.get(key) is None for s in samples) and any(s.get(key) is not None for s in samples):
            missing = next(i for i, s in enumerate(samples) if s.get(key) is None)
            return f"the samples' {key!r} is None in sample {missing} of the batch but set in others"
    return None


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, list | tuple) and all(isinstance(v, int | float) for v in value):
        return (len(value),)
    shape = getattr(value, "shape", None)  # numpy arrays
    return tuple(shape) if isinstance(shape, tuple) else None


__all__ = ["CheckedCollator", "check_label_values", "describe_bad_samples"]
