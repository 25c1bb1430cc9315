"""The model part of a checkpoint: trainbus's resume weights, and the model folder written next to them.

A checkpoint is a model folder (``from_pretrained`` loads it) and a resumable state. Its model files
are what transformers' ``save_model`` would write there; trainbus's resume reads the weights it wrote
itself, verified, by the model's own parameter names. Usually the two are one file, ``model.safetensors``.
They part in two cases, and then the resume weights are ``trainbus_weights.safetensors`` (the manifest
names the file under ``"weights"``; without that key it is ``model.safetensors``, as in every older
checkpoint):

- an adapter (peft) model: its model folder is peft's (``adapter_model.safetensors``); trainbus's
  weights are what trains, by the model's names, which as ``model.safetensors`` would be a second
  copy of the adapter that ``from_pretrained`` mistakes for a model;
- a Trainer subclass whose ``save_model`` / ``_save`` override writes the model files (only an
  adapter, a value head, a ``state_dict`` of its choosing) and leaves no ``model.safetensors`` of
  trainbus's, unchanged, behind: the override's files are the model folder, as under transformers,
  and the resume still gets every weight.

An override writes into the checkpoint's temporary folder (``checkpoint-N.tmp-PID``) before the
manifest: what it writes is listed, hashed and published with the checkpoint, atomically. Its
``super()._save(output_dir)`` finds the part being written (``active_part``) and writes trainbus's
weights through it.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from . import io as cio
from .frozen import adapter_model, trainable_state_dict, write_adapter_folder
from .weights import state_to_save
from .weights_name import MANIFEST_KEY, OWN_WEIGHTS, WEIGHTS, weights_file

__all__ = ["MANIFEST_KEY", "OWN_WEIGHTS", "WEIGHTS", "weights_file"]  # weights_file's users import it from here
_ACTIVE: contextvars.ContextVar[ModelPart | None] = contextvars.ContextVar("trainbus_model_part", default=None)


def active_part(directory: str | os.PathLike[str] | None) -> ModelPart | None:
    """The checkpoint model part being written into ``directory`` right now, else None (a final save)."""
    part = _ACTIVE.get()
    if part is None or directory is None or os.path.abspath(directory) != os.path.abspath(part.directory):
        return None
    return part


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        info = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


class ModelPart:
    """The weights trainbus writes into one checkpoint folder and the files an override adds beside them."""

    def __init__(self, model: torch.nn.Module, directory: Path, frozen_base: Any) -> None:
        self.model = model
        self.directory = directory
        self.frozen_base = frozen_base
        self.adapter = adapter_model(model)
        self._entries: dict[str, dict[str, Any]] = {}  # file -> manifest entry, taken as trainbus wrote it
        self._stamps: dict[str, tuple[int, int, int] | None] = {}
        self._weights: str | None = None

    def write_weights(self) -> None:
        """trainbus's weights (of an adapter model only what trains, with peft's folder beside them)."""
        self.write_taken(self.weights_to_write())
        self.write_adapter_folder()

    def weights_to_write(self) -> tuple[str, dict[str, torch.Tensor]]:
        """The weights file's name and its tensors (the model's own, not copies): of an adapter model only what
        trains, the base known by its fingerprint; else the state dict, tied weights once."""
        name = OWN_WEIGHTS if self.adapter is not None else WEIGHTS
        tensors = state_to_save(self.model) if self.frozen_base is None else trainable_state_dict(self.model)
        return name, tensors

    def write_taken(self, taken: tuple[str, dict[str, torch.Tensor]]) -> None:
        """Write the weights file ``weights_to_write`` gave (or host copies of its tensors: a background save)."""
        name, tensors = taken
        self._record(name, cio.write_tensors(self.directory / name, tensors))
        self._weights = name

    def write_adapter_folder(self) -> None:
        """peft's own folder of an adapter model, as transformers writes it (``frozen.py``); finish() hashes it."""
        if self.adapter is not None:
            write_adapter_folder(self.adapter, self.directory)

    def _record(self, name: str, entry: dict[str, Any]) -> None:
        self._entries[name] = entry
        self._stamps[name] = _stamp(self.directory / name)

    def _intact(self, name: str) -> bool:
        return name in self._entries and _stamp(self.directory / name) == self._stamps[name]

    @contextlib.contextmanager
    def open(self) -> Iterator[ModelPart]:
        """While the model folder is written: an override's ``super()._save(directory)`` finds this part."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def finish(self) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
        """Every plain file of the folder with its manifest entry, and what the manifest records.

        When trainbus's weights are not there as it wrote them (an override wrote the model files), they
        are written now as ``trainbus_weights.safetensors``, which a resume reads instead.
        """
        if self._weights is None or not self._intact(self._weights):
            if self.frozen_base is None:
                entry = cio.save_weights(self.model, self.directory / OWN_WEIGHTS)
            else:
                entry = cio.write_tensors(self.directory / OWN_WEIGHTS, trainable_state_dict(self.model))
            self._record(OWN_WEIGHTS, entry)
            self._weights = OWN_WEIGHTS
        files = {
            name: self._entries[name] if self._intact(name) else cio.file_entry(self.directory / name)
            for name in sorted(os.listdir(self.directory))
            if (self.directory / name).is_file() and not (self.directory / name).is_symlink()
        }
        listed = {MANIFEST_KEY: self._weights} if self._weights != WEIGHTS else {}
        return files, listed


def added_files(directory: Path, write: Callable[[Path], None]) -> list[str]:
    """Run ``write(directory)`` and return the names it added."""
    before = set(os.listdir(directory))
    write(directory)
    return sorted(set(os.listdir(directory)) - before)
