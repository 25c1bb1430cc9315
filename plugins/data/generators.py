"""Random generators of their own that data loading objects (a dataset, a collator, a sampler) keep.

A dataset drawing from ``self.rng = np.random.default_rng(0)``, a collator drawing from its own
``torch.Generator`` (transformers' ``DataCollatorForLanguageModeling(seed=...)``), a sampler keeping a
``random.Random``: their states are not the global generators', so checkpoints would not carry them and a
resume would draw from their first state again. ``find_generators`` finds them among an object's
attributes (a few levels down: a wrapper's wrapped dataset, a column-removing collator's collator),
``generator_state`` / ``set_generator_state`` read and set them as values a checkpoint holds, and
``reseed`` gives one a seed (a worker does, per batch: ``seeded.py``).

The kinds: ``torch.Generator``, numpy's ``Generator`` and ``RandomState``, ``random.Random``.
"""

from __future__ import annotations

import collections
import os
import random
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["find_generators", "generator_state", "lazy_generator_owners", "reseed", "set_generator_state"]

KINDS = (torch.Generator, np.random.Generator, np.random.RandomState, random.Random)
#: how far below an object its generators are looked for (``loader.dataset.dataset.rng``)
DEPTH = 3
#: longer lists and dicts are data (rows), not parts of a loading object: not looked into
SMALL = 16
#: objects looked at per walk (a dataset with deep internals costs no more than this)
LIMIT = 512
_SKIP = (torch.Tensor, torch.nn.Module, types.ModuleType, type, str, bytes, int, float, bool, np.ndarray)


def find_generators(roots: dict[str, Any]) -> dict[str, Any]:
    """``{path: generator}`` for the generators found under each root (``"collate_fn.generator"``), each once."""
    return {path: value for path, value in _objects(roots) if isinstance(value, KINDS)}


def _objects(roots: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Every object under the roots, by path, each once, at most ``LIMIT`` of them (a breadth-first walk)."""
    seen: set[int] = set()
    queue = collections.deque((name, root, DEPTH) for name, root in roots.items())
    visited = 0
    while queue and visited < LIMIT:
        path, value, depth = queue.popleft()
        if value is None or id(value) in seen:
            continue
        seen.add(id(value))
        visited += 1
        yield path, value
        if isinstance(value, KINDS) or depth == 0 or isinstance(value, _SKIP):
            continue
        if callable(getattr(type(value), "__array__", None)):
            continue
        queue.extend((f"{path}.{key}", item, depth - 1) for key, item in _children(value))


def _children(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, list | tuple):
        return [(str(i), v) for i, v in enumerate(value)] if len(value) <= SMALL else []
    if isinstance(value, dict):
        return [(str(k), v) for k, v in value.items()] if len(value) <= SMALL else []
    attributes = getattr(value, "__dict__", None)
    if not isinstance(attributes, dict) or len(attributes) > 4 * SMALL:
        return []
    return list(attributes.items())


def generator_state(generator: Any) -> dict[str, Any]:
    """The generator's state as a checkpoint holds it: ``{"kind": ..., "state": ...}``."""
    if isinstance(generator, torch.Generator):
        return {"kind": "torch", "state": generator.get_state()}
    if isinstance(generator, np.random.Generator):
        state = generator.bit_generator.state
        return {"kind": "numpy", "state": _ints_as_strings(state)}
    if isinstance(generator, np.random.RandomState):
        return {"kind": "numpy-legacy", "state": generator.get_state()}
    return {"kind": "python", "state": generator.getstate()}


def _ints_as_strings(value: Any) -> Any:
    """numpy's bit generators keep 128-bit integers: written as strings (JSON readers differ past 64 bits)."""
    if isinstance(value, dict):
        return {k: _ints_as_strings(v) for k, v in value.items()}
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**53:
        return f"int:{value}"
    return value


def _strings_as_ints(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strings_as_ints(v) for k, v in value.items()}
    if isinstance(value, str) and value.startswith("int:"):
        return int(value[4:])
    return value


def make_generator(kind: str) -> Any:
    """A new generator of that kind (its state is set next)."""
    return {"torch": torch.Generator, "numpy": np.random.default_rng, "numpy-legacy": np.random.RandomState,
            "python": random.Random}[kind]()  # fmt: skip


def set_generator_state(generator: Any, saved: dict[str, Any]) -> None:
    """Set what ``generator_state`` read; raises ValueError when the kinds differ (another object's state)."""
    kind, state = saved["kind"], saved["state"]
    if generator_state_kind(generator) != kind:
        raise ValueError(f"a {kind} generator's state cannot be set into a {type(generator).__name__}")
    if kind == "torch":
        generator.set_state(state)
    elif kind == "numpy":
        generator.bit_generator.state = _strings_as_ints(state)
    elif kind == "numpy-legacy":
        generator.set_state(tuple(state))
    else:
        generator.setstate(_as_tuples(state))


def _as_tuples(value: Any) -> Any:
    return tuple(_as_tuples(v) for v in value) if isinstance(value, list | tuple) else value


def generator_state_kind(generator: Any) -> str:
    if isinstance(generator, torch.Generator):
        return "torch"
    if isinstance(generator, np.random.Generator):
        return "numpy"
    return "numpy-legacy" if isinstance(generator, np.random.RandomState) else "python"


def restore_generators(roots: dict[str, Any], saved: dict[str, Any]) -> None:
    """Set each saved state into the generator at its path under ``roots``.

    A path whose attribute is None now (a generator made at the first call, as transformers' collators
    make theirs) gets a new generator of the saved kind; one that made its generator in this process is
    told so (``_generator_pid``, transformers' mark), so it does not make another. Paths not found are
    left alone (another loader than the checkpoint's).
    """
    found = find_generators(roots)
    for path, state in saved.items():
        generator = found.get(path)
        if generator is None:
            generator = _make_missing(roots, path, state["kind"])
        elif generator_state_kind(generator) != state["kind"]:
            continue  # another object at that path than the checkpoint's: its generator stays
        if generator is not None:
            set_generator_state(generator, state)


def _make_missing(roots: dict[str, Any], path: str, kind: str) -> Any:
    owners = dict(_objects(roots))
    parent, _, attribute = path.rpartition(".")
    owner = owners.get(parent)
    if attribute != "generator" or owner is None or not _makes_generator_lazily(owner):
        return None  # only where an object makes its generator when first called
    generator = make_generator(kind)
    setattr(owner, attribute, generator)
    if hasattr(owner, "_generator_pid"):
        owner._generator_pid = os.getpid()
    return generator


def reseed(generator: Any, seed: int) -> None:
    """Give ``generator`` the seed ``seed`` (a 63-bit integer)."""
    if isinstance(generator, torch.Generator):
        generator.manual_seed(seed)
    elif isinstance(generator, np.random.Generator):
        generator.bit_generator.state = type(generator.bit_generator)(seed).state
    elif isinstance(generator, np.random.RandomState):
        generator.seed(seed % 2**32)
    else:
        generator.seed(seed)


def lazy_generator_owners(roots: dict[str, Any]) -> list[tuple[str, Any]]:
    """``(path, object)`` of objects that make a generator of their own at their first call (``generator``
    None, a ``seed`` set: transformers' collators): in each worker process they make it again, seeded by
    the worker's id."""
    return [(path, value) for path, value in _objects(roots) if _makes_generator_lazily(value)]


def _makes_generator_lazily(value: Any) -> bool:
    attributes = getattr(value, "__dict__", None)
    return (
        isinstance(attributes, dict)
        and "generator" in attributes
        and attributes["generator"] is None
        and attributes.get("seed") is not None
    )
