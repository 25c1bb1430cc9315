"""trainbus: a PyTorch training engine whose features are plugins on a typed event loop.

The names users reach for first, one import away::

    from trainbus import Trainer, TrainingArguments      # the Hugging Face style facade
    from trainbus import Seq2SeqTrainer, Seq2SeqTrainingArguments   # and its sequence-to-sequence pair
    from trainbus import Engine, Plugin, Event           # the engine, to compose or extend

Names resolve on first access (PEP 562), so ``import trainbus.engine`` still loads the engine
only and ``import trainbus`` loads nothing at all. ``trainbus.__version__`` is the installed
distribution's version (``importlib.metadata``), the one ``trainbus --version`` prints.

This folder is mapped to the ``trainbus`` package in setup.cfg (``trainbus = trainbus_root``);
``trainbus.engine``, ``trainbus.hooks`` and ``trainbus.plugins`` are mapped from their own folders.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainbus.engine import Control, Engine, Event, Plugin, Priority, State
    from trainbus.plugins import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Engine": "trainbus.engine",
    "Plugin": "trainbus.engine",
    "Event": "trainbus.engine",
    "Priority": "trainbus.engine",
    "State": "trainbus.engine",
    "Control": "trainbus.engine",
    "Trainer": "trainbus.plugins",
    "TrainingArguments": "trainbus.plugins",
    # the names a transformers script imports for sequence-to-sequence training, so its port is the same one-line change
    "Seq2SeqTrainer": "trainbus.plugins",
    "Seq2SeqTrainingArguments": "trainbus.plugins",
}

__all__ = [
    "Control",
    "Engine",
    "Event",
    "Plugin",
    "Priority",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "State",
    "Trainer",
    "TrainingArguments",
    "__version__",
]


def _installed_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("trainbus")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _installed_version()
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        import difflib

        close = difflib.get_close_matches(name, [*_EXPORTS, "__version__"], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise AttributeError(f"module 'trainbus' has no attribute {name!r}{hint}")
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
