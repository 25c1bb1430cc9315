"""Check a plugin for resume: a run saved at step k, loaded into a fresh engine and continued, must
equal the run that was never interrupted (part of the testing kit: ``trainbus.engine.testing``).

What is saved is what a checkpoint holds, copied in memory: the model's and the optimizer's
``state_dict()``, ``engine.state_dict()`` (State and every plugin's ``state_dict()``, checked with
the checkpoint codec's rules) and the RNG states (python, numpy when loaded, torch CPU and CUDA).
The save happens where a checkpoint would: at SAVE after step k's other side effects, and the
interrupted run then crashes. The RNG states are set again at the resumed run's first STEP_START or
fresh EPOCH_START, as the Checkpointing plugin does (creating the DataLoader's iterator draws from
the torch RNG). Data must come in the same order in every run (a fixed order, or a sampler seeded
per epoch).

Compared, at every STEP_START from the resume on and at TRAIN_END (before its handlers): State
(except ``event_counts``: a resume replays an EPOCH_START), every plugin's ``state_dict()``, the
model's and the optimizer's ``state_dict()``, then every plugin's public plain-data attributes
(``vars`` without a leading underscore: numbers, strings, tensors by value, containers of them), bit
for bit (NaN equals NaN); so a counter a ``state_dict()`` leaves out is named even when it changes no
weight. Attributes that differ on purpose (a start time, a path) are listed in the plugin's
``not_resumed`` or passed as ``ignore_attributes``. Private attributes (``_window``) are the plugin's
own representation, which a save may legitimately fold elsewhere: they only appear as a hint when
something compared differs. Then the window of batches each step starts with: when the resumed run sees
other batches than the uninterrupted one, the message says the data order differs, at the first
such step (a loader drawing its order from an RNG the save does not hold, say).
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ..bus import Handle, Priority
from ..errors import ConfigError
from ..events import Event, StepStartEvent, TrainEndEvent
from ..loop import Engine
from ..plugin import check_state
from .remedy import LENGTH_REMEDY, name_of, remedy

Snapshot = dict[str, Any]


class ResumeMismatch(AssertionError):
    """A resumed run differs from the uninterrupted one; ``step``, ``path`` name the first divergence."""

    def __init__(self, message: str, step: int | str, path: str) -> None:
        super().__init__(message)
        self.step = step
        self.path = path


class _Interrupt(Exception):
    """The simulated crash right after the save."""


def check_resume_equivalence(
    make_engine: Callable[[], Engine],
    *,
    at: int | None = None,
    max_examples: int = 10,
    ignore_attributes: Iterable[str] = (),
) -> None:
    """Assert that saving at a step, loading into a fresh engine and continuing equals never stopping.

    Args:
        make_engine: builds the engine with the plugins under test, the same run every time (seed
            inside it). Called once for the uninterrupted run and twice per step checked.
        at: the step to save at. None: hypothesis draws it from 1 .. last step - 1 (``max_examples``
            draws, shrunk to the earliest failing step). Inside your own ``@given`` test, draw it
            yourself and pass it (hypothesis does not nest).
        ignore_attributes: ``"Plugin.attribute"`` names not to compare (beside each plugin's ``not_resumed``).

    Raises:
        ResumeMismatch: naming the step and the path of the first divergence.

    Example::

        check_resume_equivalence(lambda: toy_engine(config, plugins=[MyPlugin()]))
    """
    ignored = frozenset(ignore_attributes)
    reference = _record(make_engine(), resume=None, ignored=ignored)
    steps = [key for key in reference if isinstance(key, int)]
    last = max(steps, default=0) + 1  # the STEP_START snapshot of step n is taken at global_step n - 1
    if at is not None:
        if not 1 <= at < last:
            raise ConfigError(f"at must be a step between 1 and {last - 1} (the run has {last} steps), got {at}")
        _check_at(make_engine, at, reference, ignored)
        return
    if last < 2:
        raise ConfigError(f"the run has {last} step(s): resuming needs at least 2; give make_engine a longer run "
                          "(more data, epochs or max_steps)")  # fmt: skip
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=max_examples, deadline=None, database=None)
    @given(st.integers(1, last - 1))
    def save_at(step: int) -> None:
        _check_at(make_engine, step, reference, ignored)

    save_at()


def _check_at(
    make_engine: Callable[[], Engine], at: int, reference: dict[int | str, Snapshot], ignored: frozenset[str]
) -> None:
    saved = _interrupted(make_engine(), at)
    resumed = _record(make_engine(), resume=saved, ignored=ignored)
    for key, snapshot in resumed.items():
        expected = reference.get(key)
        if expected is None:
            raise ResumeMismatch(f"the resumed run reached {_where(key, at)}, which the uninterrupted one never did. "
                                 f"{LENGTH_REMEDY}", key, "")  # fmt: skip
        found = first_difference(_compared(snapshot), _compared(expected))
        if found is not None:
            path, got, want = found
            hint = "" if path.startswith("/attributes/") else _attribute_hint(resumed.get(at), reference.get(at))
            raise ResumeMismatch(
                f"resuming from a save at step {at} diverges from the uninterrupted run {_where(key, at)}: "
                f"{name_of(path, snapshot)}: resumed {_show(got)}, uninterrupted {_show(want)}{hint}. "
                f"{remedy(path, snapshot)}",
                key,
                path,
            )
        found = first_difference(snapshot.get("batches"), expected.get("batches"), "/batches")
        if found is not None:
            path, got, want = found
            raise ResumeMismatch(
                f"resuming from a save at step {at}: the data order differs: step {int(key) + 1} starts with other "
                f"batches than in the uninterrupted run ({path}: resumed {_show(got)}, uninterrupted {_show(want)}). "
                "A resumed run must see the batches the uninterrupted one saw: a fixed order, or a sampler whose "
                "order comes from a seed and the epoch (not from an RNG drawn at the iterator's creation)",
                key,
                path,
            )
    if resumed.keys() != {k for k in reference if k == "end" or (isinstance(k, int) and k >= at)}:
        raise ResumeMismatch(f"the resumed run stopped early: it reached {sorted(map(str, resumed))}. {LENGTH_REMEDY}",
                             "end", "")  # fmt: skip


def _compared(snapshot: Snapshot) -> Snapshot:
    """What must be equal before the batches: State, plugin states, model, optimizer, then plugin attributes."""
    return {k: v for k, v in snapshot.items() if k not in ("batches", "private", "classes")}


def _where(key: int | str, at: int) -> str:
    if key == "end":
        return "at the end of the run"
    return "right after loading (before any step)" if key == at else f"before step {int(key) + 1}"


def _record(engine: Engine, resume: Snapshot | None, ignored: frozenset[str]) -> dict[int | str, Snapshot]:
    """Run ``engine`` (resumed from ``resume``); its snapshots by steps done, and "end"."""
    snapshots: dict[int | str, Snapshot] = {}
    if resume is not None:
        assert engine.optimizer is not None
        engine.model.load_state_dict(copy.deepcopy(resume["model"]))
        engine.optimizer.load_state_dict(copy.deepcopy(resume["optimizer"]))
        engine.load_state_dict(copy.deepcopy(resume["engine"]))
        _set_rng(resume["rng"])
        handles: list[Handle] = []

        def set_rng_once(ev: Any) -> None:
            if isinstance(ev, StepStartEvent) or ev.engine.state.batches_in_epoch == 0:  # a fresh epoch
                _set_rng(resume["rng"])
                for handle in handles:
                    handle.remove()

        first = Priority.FIRST + 200  # before anything that draws random numbers
        handles = [engine.on(Event.EPOCH_START, set_rng_once, priority=first, name="resume_check.set_rng"),
                   engine.on(Event.STEP_START, set_rng_once, priority=first, name="resume_check.set_rng")]  # fmt: skip

    def snapshot(ev: Any) -> None:  # before the step's handlers: the state the previous step left
        key = "end" if isinstance(ev, TrainEndEvent) else engine.state.global_step
        if key not in snapshots:
            snapshots[key] = _snapshot(engine, ignored)
            if isinstance(ev, StepStartEvent):  # the window this step starts with, as the data gave it
                snapshots[key]["batches"] = _detached(ev.batches)

    engine.on(Event.STEP_START, snapshot, priority=Priority.FIRST + 100, name="resume_check.snapshot")
    engine.on(Event.TRAIN_END, snapshot, priority=Priority.FIRST + 100, name="resume_check.snapshot")
    engine.fit()
    return snapshots


def _interrupted(engine: Engine, at: int) -> Snapshot:
    """Run until step ``at``, save at its SAVE (after the other side effects), then crash; the save."""
    saved: Snapshot = {}

    def request(ev: Any) -> None:
        if ev.engine.state.global_step == at:
            ev.engine.control.should_save = True

    def save(ev: Any) -> None:
        if ev.engine.state.global_step != at:
            return
        state = engine.state_dict()
        check_state(state["plugins"], "plugins")
        assert engine.optimizer is not None
        saved.update(engine=copy.deepcopy(state), model=copy.deepcopy(engine.model.state_dict()),
                     optimizer=copy.deepcopy(engine.optimizer.state_dict()), rng=_get_rng())  # fmt: skip
        raise _Interrupt(f"simulated crash right after the save at step {at}")

    engine.on(Event.STEP_END, request, priority=Priority.LAST - 100, name="resume_check.request_save")
    engine.on(Event.SAVE, save, priority=Priority.LAST - 100, name="resume_check.save")
    with contextlib.suppress(_Interrupt):  # a handler's exception reaches the caller as itself
        engine.fit()
    if not saved:
        raise ConfigError(f"the run never reached step {at}, so nothing was saved; pass an at= the run reaches "
                          "(or leave it out: hypothesis then draws one)")  # fmt: skip
    return saved


def _detached(value: Any) -> Any:
    """A copy of a window of batches: tensors detached to the CPU, containers rebuilt, other values as they are."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {key: _detached(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return (
            type(value)(_detached(item) for item in value)
            if type(value) in (list, tuple)
            else list(map(_detached, value))
        )
    return copy.deepcopy(value)


def _snapshot(engine: Engine, ignored: frozenset[str] = frozenset()) -> Snapshot:
    assert engine.optimizer is not None
    state = engine.state.to_dict()
    state.pop("event_counts")
    state.pop("run_id", None)  # the run's identity (set when a plugin needs one), not part of its trajectory
    return copy.deepcopy({
        "state": state,
        "plugins": {p.name: p.state_dict() for p in engine.plugins},
        "model": engine.model.state_dict(),
        "optimizer": engine.optimizer.state_dict(),
        "attributes": {p.name: _data_attributes(p, ignored, private=False) for p in engine.plugins},
        "private": {p.name: _data_attributes(p, ignored, private=True) for p in engine.plugins},
        "classes": {p.name: type(p).__name__ for p in engine.plugins},
    })  # fmt: skip


def _data_attributes(plugin: Any, ignored: frozenset[str], private: bool) -> dict[str, Any]:
    """The plugin's public (or private) attributes that hold plain data (what a forgotten state field
    looks like), less the ones it declares ``not_resumed`` and those in ``ignored`` (``"Plugin.attribute"``)."""
    skip = set(getattr(plugin, "not_resumed", ()))
    return {
        k: v
        for k, v in vars(plugin).items()
        if k.startswith("_") == private
        and not k.startswith("_plugin")
        and k not in skip
        and f"{plugin.name}.{k}" not in ignored
        and _is_data(v)
    }


def _is_data(value: Any, depth: int = 0) -> bool:
    if isinstance(value, bool | int | float | str | torch.Tensor) or value is None:
        return True
    if depth > 3:
        return False
    if isinstance(value, Mapping):
        return all(_is_data(v, depth + 1) for v in value.values())
    if isinstance(value, list | tuple | set):
        return all(_is_data(v, depth + 1) for v in value)
    return False


def _attribute_hint(resumed: Snapshot | None, reference: Snapshot | None) -> str:
    if resumed is None or reference is None:
        return ""
    lines = []
    for plugin, attributes in resumed["private"].items():
        state = resumed["plugins"].get(plugin, {})
        for name, value in attributes.items():
            want = reference["private"].get(plugin, {}).get(name, value)
            if name not in state and first_difference(value, want) is not None:
                lines.append(f"{plugin}.{name} (resumed {_show(value)}, uninterrupted {_show(want)})")
    if not lines:
        return ""
    return ("; plugin attributes not in a state_dict that differed right after loading: " + ", ".join(lines)
            + " (add each to its plugin's state_dict() and load_state_dict())")  # fmt: skip


def first_difference(a: Any, b: Any, path: str = "") -> tuple[str, Any, Any] | None:
    """``(path, a's value, b's value)`` at the first place two nested values differ, else None.

    Tensors compare bit for bit (dtype and shape too; NaN equals NaN), floats with NaN equal to NaN.
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_tensor(a, b)
        return None if same else (path or "/", a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for key in [*a, *(k for k in b if k not in a)]:
            if key not in a or key not in b:
                return (f"{path}/{key}", a.get(key, "<missing>"), b.get(key, "<missing>"))
            found = first_difference(a[key], b[key], f"{path}/{key}")
            if found is not None:
                return found
        return None
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and type(a) is type(b):
        if len(a) != len(b):
            return (f"{path} (length)", len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}/{i}")
            if found is not None:
                return found
        return None
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if type(a) is type(b) and a == b else (path or "/", a, b)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if torch.equal(a, b):
        return True
    if not a.is_floating_point():
        return False
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))


def _show(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten()
        shown = ", ".join(f"{v:.6g}" for v in flat[:4].tolist())
        return f"tensor({shown}{', ...' if flat.numel() > 4 else ''}; {tuple(value.shape)} {value.dtype})"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _get_rng() -> Snapshot:
    numpy = sys.modules.get("numpy")
    return {
        "python": random.getstate(),
        "numpy": numpy.random.get_state() if numpy is not None else None,
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set_rng(rng: Snapshot) -> None:
    random.setstate(rng["python"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and rng["numpy"] is not None:
        numpy.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None:
        torch.cuda.set_rng_state_all(rng["cuda"])
