"""DataLoader workers forked while Preemption runs ignore SIGTERM and SIGINT: the main process alone stops.

A cluster (SLURM's ``scancel``, a time limit) or a terminal's Ctrl-C signals the whole process group. A
DataLoader worker dies of SIGTERM (torch's worker handler passes on every SIGTERM not sent by its parent)
and leaves on SIGINT, and the main process then fails with "DataLoader worker exited unexpectedly" before
the step boundary where Preemption would save: no stop checkpoint. So, while a Preemption plugin has its
handlers installed (``active``), a worker forked by a DataLoader ignores both signals; the main process
stops at the next step boundary, saves, and shuts its workers down the usual way (a worker also exits by
itself within seconds when the main process dies).

How, without touching the loaders: at fork (``os.register_at_fork``) from inside torch's DataLoader code,
the parent blocks both signals around the fork; the child keeps them blocked and wraps torch's
``_set_worker_signal_handlers`` (which the worker calls first thing, installing its own SIGTERM
handler), so that right after it both signals go to a handler that ignores them while training runs (a
count in memory shared with the parent) and then unblocked: none kills the worker during training, and a
worker that outlives it (a persistent pool) stops on SIGTERM again, as multiprocessing's exit expects.
Any other fork (a subprocess, a multiprocessing pool of the
user's) is left alone. A worker hung in user code no longer stops on SIGTERM during training (SIGKILL
still ends it); outside training nothing changes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

__all__ = ["active", "activate", "deactivate"]

STOPS = {signal.SIGTERM, signal.SIGINT}
_DATALOADER = os.path.join("torch", "utils", "data", "")  # where a DataLoader forks its workers from

_state = threading.local()
_active = [0]  # Preemption plugins with their handlers installed, in this process
# the same count in memory shared with the forked workers (made at the first activate, before any fork):
# a worker of a persistent pool outlives training, and must stop on SIGTERM again once it is over (at exit
# multiprocessing ends its workers with SIGTERM and waits for them)
_shared: Any = None


def active() -> bool:
    return _active[0] > 0


def _publish() -> None:
    global _shared
    if _shared is None:
        import multiprocessing

        _shared = multiprocessing.RawValue("i", 0)
    _shared.value = _active[0]


def activate() -> None:
    _active[0] += 1
    _publish()


def deactivate() -> None:
    _active[0] = max(0, _active[0] - 1)
    _publish()


def _from_dataloader(frame: FrameType | None) -> bool:
    while frame is not None:
        if _DATALOADER in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _before_fork() -> None:
    _state.mask = None
    if active() and _from_dataloader(sys._getframe(1)):
        _state.mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # no stop between fork and the child's wrap


def _after_fork_in_parent() -> None:
    mask = getattr(_state, "mask", None)
    if mask is not None:
        _state.mask = None
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a signal that came meanwhile reaches the parent now


def _after_fork_in_child() -> None:
    mask = getattr(_state, "mask", None)
    if mask is None:
        return
    _state.mask = None
    _active[0] = 0  # the worker runs no training of its own
    try:
        from torch.utils.data._utils import signal_handling
    except ImportError:  # pragma: no cover - torch moved it: ignore now (its handler may not come)
        _ignore_stops(mask)
        return
    name = "_set_worker_signal_handlers"  # the worker loop calls it first thing (torch/utils/data/_utils/worker.py)
    original = getattr(signal_handling, name, None)
    if original is None:  # pragma: no cover - torch renamed it: ignore now (its handler may not come)
        _ignore_stops(mask)
        return

    def set_worker_signal_handlers(*args: Any) -> None:
        original(*args)
        setattr(signal_handling, name, original)
        _ignore_stops(mask)

    setattr(signal_handling, name, set_worker_signal_handlers)


def _ignore_stops(mask: Any) -> None:
    shared = _shared
    for signum in STOPS:
        if shared is None:  # pragma: no cover - forked before any activate: nothing to follow
            signal.signal(signum, signal.SIG_IGN)
        else:
            signal.signal(signum, _while_training(shared))
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending one now meets the handler


# what a worker does with a stop once training is over: what a worker forked outside training does (the
# handlers it inherited are the parent's Preemption's, which only set a flag nobody reads in a worker)
_AFTER_TRAINING: dict[signal.Signals, Any] = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}


def _while_training(shared: Any) -> Any:
    """A worker's handler: ignore the stop while the parent trains; after that, the default (SIGTERM ends it)."""

    def stop_unless_training(signum: int, frame: FrameType | None) -> None:
        if shared.value > 0:
            return  # the main process stops at its next step boundary and shuts the workers down
        after = _AFTER_TRAINING[signal.Signals(signum)]
        signal.signal(signum, after)
        if callable(after):
            after(signum, frame)
        else:
            os.kill(os.getpid(), signum)  # delivered again, now to the default action

    return stop_unless_training


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
