"""The one check of an ``output_dir``, shared by ``TrainingArguments`` and ``Checkpointing``.

``Checkpointing(None)`` failed inside ``pathlib`` ("expected str, bytes or os.PathLike object, not
NoneType"); ``output_dir=''`` was taken and wrote the checkpoints, their lock and the set-aside runs into
the working directory, which transformers also does but nobody means: the working directory is spelt
``'.'``. A file where the directory should be failed only at the first save.
"""

from __future__ import annotations

import os
from typing import Any

from trainbus.engine import ConfigError
from trainbus.engine.errors import ConfigTypeError


def check_output_dir(value: Any, name: str = "output_dir") -> None:
    """Raise unless ``value`` is a non-empty path (str or ``os.PathLike``) that is a directory or does not exist."""
    if isinstance(value, bytes) or not isinstance(value, str | os.PathLike):
        raise ConfigTypeError(
            f"{name} must be a path (a str or pathlib.Path) naming the run's directory, got {value!r} "
            f"({type(value).__name__})"
        )
    path = os.fspath(value)
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(
            f"{name} must name a directory, got {path!r}: an empty name would write the checkpoints into the "
            "working directory; pass '.' if that is what you mean"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{name} {path!r} exists and is not a directory; pass a directory (new or existing)")


__all__ = ["check_output_dir"]
