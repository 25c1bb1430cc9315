"""``auto_find_batch_size``: on an out-of-memory error, halve the per-device batch and train again.

accelerate's ``find_executable_batch_size`` runs the attempts and its ``should_reduce_batch_size``
decides which errors mean "out of memory" (CUDA, XPU, MPS, CPU allocator messages). Each attempt
starts from the weights, optimizer state and RNG states the run had before the first one, so the
run that completes is the run that would have been started with that batch size (transformers
keeps whatever the failed attempt left in the model). Every plugin starts afresh too: its
``state_dict()`` from before the first attempt is loaded back, the way a checkpoint restores it, so
an EMA's averages, counters and logging windows forget the failed attempt. An out-of-memory error
during evaluation is not the train batch's fault and is raised as transformers raises it.

Resuming from a checkpoint starts from the batch size the checkpoint trained with (its
``trainer_state.json``'s ``train_batch_size``), as transformers does under ``auto_find_batch_size``.

Across processes every rank must see the error at the same step: an error on one rank leaves the
others waiting in a collective (as in transformers).
"""

from __future__ import annotations

import copy
import logging
import math
import random
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

from trainbus.engine import Event

logger = logging.getLogger("trainbus.batch_size")

T = TypeVar("T")

EVAL_OOM = (
    "Evaluation hit an out-of-memory error. `auto_find_batch_size` only adjusts the training batch size, "
    "reduce `per_device_eval_batch_size` instead."
)


class _Start:
    """The model's tensors, the optimizer's state, the RNG states and every plugin's state before the first attempt."""

    def __init__(self, engine: Any) -> None:
        model, optimizer = engine.model, engine.optimizer
        self.engine = engine
        self.tensors = [(t, t.detach().clone()) for t in model.state_dict(keep_vars=True).values()]
        self.optimizer = optimizer
        self.optimizer_state = copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None
        self.rng = (random.getstate(), np.random.get_state(), torch.get_rng_state())
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        # what a checkpoint saves of the plugins (engine.state_dict()), copied: live tensors move on
        self.plugins: dict[str, Any] = copy.deepcopy(engine.state_dict()["plugins"])

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.tensors:
                live.copy_(saved)
        if self.optimizer is not None and self.optimizer_state is not None:
            self.optimizer.load_state_dict(copy.deepcopy(self.optimizer_state))
        random.setstate(self.rng[0])
        np.random.set_state(self.rng[1])
        torch.set_rng_state(self.rng[2])
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)

    def restore_plugins(self) -> list[str]:
        """Load every plugin's starting state back; the names of those whose state did not come back.

        Runs after the Trainer took the new batch size, which drops what depends on it (a named LR
        schedule is built again at TRAIN_START), so what is compared is what the next attempt starts with.
        """
        stuck = []
        for name, saved in self.plugins.items():
            plugin = self.engine.get_plugin(name, None)
            if plugin is None:  # removed since: nothing to restart
                continue
            plugin.load_state_dict(copy.deepcopy(saved))
            if not same_state(plugin.state_dict(), saved):
                stuck.append(name)
        return stuck


def same_state(a: Any, b: Any) -> bool:
    """Whether two ``state_dict()`` values are equal.

    Tensors and arrays compare element for element (NaN equal to NaN; dtype and shape must agree),
    containers item for item.
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        a, b = a.detach().cpu(), b.detach().cpu()
        both_nan = a.isnan() & b.isnan() if a.is_floating_point() else torch.zeros_like(a, dtype=torch.bool)
        return bool(((a == b) | both_nan).all())
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b, equal_nan=np.asarray(a).dtype.kind == "f"))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    try:
        return bool(a == b)
    except Exception:  # no plain equality: only the very same object counts as equal
        return a is b


def halve(batch_size: int) -> int:
    """The next batch size to try: half (accelerate 1.15's default, which transformers 5 uses, is x0.9).

    Halving reaches a size that fits in log2 steps, each a restarted run; x0.9 wastes less memory
    but needs about 7 times as many restarts to halve.
    """
    return batch_size // 2


def train_with_executable_batch_size(
    engine: Any, starting_batch_size: int, use_batch_size: Callable[[int], None], train: Callable[[], T]
) -> T:
    """Run ``train()`` after ``use_batch_size(b)``, from ``starting_batch_size`` down, halving on out-of-memory.

    ``engine.optimizer`` should exist already, so that every attempt starts from its state.
    Raises accelerate's RuntimeError when even batch size 1 runs out of memory. A plugin whose
    ``load_state_dict`` does not give its starting ``state_dict()`` back is named in a warning: the
    attempt after an out-of-memory error keeps some of its state from the failed one.
    """
    from accelerate.utils.memory import find_executable_batch_size, should_reduce_batch_size

    start = _Start(engine)
    size = {"now": starting_batch_size}
    failed: list[tuple[int, BaseException]] = []
    evaluating = {"now": False}

    def eval_start(ev: Any) -> None:
        evaluating["now"] = True

    def eval_end(ev: Any) -> None:
        evaluating["now"] = False

    def next_size() -> int:
        size["now"] = halve(size["now"])
        return size["now"]

    def attempt(batch_size: int) -> T:
        if failed:
            _warn_retry(*failed[-1], batch_size)
            start.restore()
        use_batch_size(batch_size)
        if failed:
            _warn_stuck(start.restore_plugins(), batch_size)
        evaluating["now"] = False
        try:
            return train()
        except Exception as exc:
            if not should_reduce_batch_size(exc):
                raise
            if evaluating["now"]:
                raise RuntimeError(EVAL_OOM) from exc
            failed.append((batch_size, exc))
            raise

    handles = [
        engine.on(Event.EVAL_START, eval_start, name="auto_find_batch_size.eval_start"),
        engine.on(Event.EVAL_END, eval_end, name="auto_find_batch_size.eval_end"),
    ]
    try:
        run = find_executable_batch_size(
            attempt, starting_batch_size=starting_batch_size, reduce_batch_size_fn=next_size
        )
        return run()  # type: ignore[no-any-return]
    finally:
        for handle in handles:
            handle.remove()


def _warn_retry(previous: int, error: BaseException, batch_size: int) -> None:
    logger.warning(
        "auto_find_batch_size: out of memory at per-device train batch size %d (%s); "
        "training again from the start with per-device train batch size %d",
        previous,
        str(error).splitlines()[0],
        batch_size,
    )


def _warn_stuck(stuck: list[str], batch_size: int) -> None:
    if stuck:
        logger.warning(
            "auto_find_batch_size: plugins %s do not return to their starting state (their "
            "load_state_dict does not restore what state_dict gave before training), so this attempt "
            "is not the run a fresh start with per-device train batch size %d would give",
            stuck,
            batch_size,
        )


__all__ = ["EVAL_OOM", "halve", "same_state", "train_with_executable_batch_size"]
