"""Preemption: SIGTERM, or a first Ctrl-C, stops training at the next step boundary with a checkpoint.

A cluster's time limit or a preempted job sends SIGTERM and kills the process a little later; without
this plugin everything since the last save is lost (transformers' Trainer does not save on SIGTERM,
Lightning does). ``Preemption`` installs handlers for SIGTERM and SIGINT at TRAIN_START, in the main
thread only, and puts the previous handlers back at TRAIN_END (also when training fails); importing or
attaching it changes nothing. A signal only sets a flag; at the next checked STEP_END the plugin sets
``should_save`` and ``should_training_stop``, so the Checkpointing plugin writes ``checkpoint-{step}``
and the loop ends after that step. Then train() / fit() raises ``TrainingInterrupted``, a
``SystemExit`` whose code is 128 + the signal number (143 for SIGTERM, 130 for SIGINT), after the main
process printed what happened and where the checkpoint is: an unhandled one ends the script with that
status, and a script that wants to go on catches it. A second Ctrl-C while the stop is pending raises
KeyboardInterrupt at once (no checkpoint). The resumed run is bit-exact (the checkpoint is an ordinary
one taken at a step boundary).

Across processes the ranks must stop at the same step, and a signal may reach only some of them. The
ranks agree with a MAX all-reduce of the pending signal number every ``check_every`` steps and at the
last step (an integer on the CPU, over a gloo group: a gloo default group, or a gloo group made
once for this when the default group is NCCL, so the check never waits for the GPU). One process
checks its flag at every step: no collective, no host read. The default ``check_every`` under several
processes is 10: one check (a one-integer gloo all-reduce and its read) took 117 us between 2 CPU
processes on the shared 2-core test machine, about 12 us per step spread over ten steps, and a stop
lands at most nine steps after the signal, inside the usual grace period before SIGKILL.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import ConfigTypeError, check_flag

from ..distributed.processes import world_size
from . import worker_signals

if TYPE_CHECKING:
    from trainbus.engine import Engine, StepEndEvent, TrainEndEvent, TrainStartEvent

logger = logging.getLogger("trainbus")

#: steps between agreements across processes (one process checks every step)
DEFAULT_CHECK_EVERY = 10
#: how the exit message says to resume, in the Engine's words (the Trainer passes its own: ``resume_hint``)
ENGINE_RESUME = "resume(engine, True) before engine.fit() (trainbus.plugins.checkpoints.checkpoint.resume)"


class TrainingInterrupted(SystemExit):
    """Training stopped at a step boundary after a signal, and saved a checkpoint (when one is configured).

    A ``SystemExit``: unhandled, the script ends with ``code`` = 128 + the signal number (143 for
    SIGTERM, 130 for SIGINT), as a shell reports a process ended by that signal. ``except Exception``
    does not swallow it; catch ``TrainingInterrupted`` to go on.

    Attributes:
        signal: the signal number (the one agreed across processes).
        step: the global step training stopped at.
        checkpoint: the checkpoint written at that step (None without a Checkpointing plugin).
    """

    def __init__(
        self, signum: int, step: int, checkpoint: str | None, resume_hint: str = ENGINE_RESUME, resumable: bool = True
    ) -> None:
        super().__init__(128 + signum)
        self.signal = signum
        self.step = step
        self.checkpoint = checkpoint
        self.resume_hint = resume_hint
        self.resumable = resumable

    def __str__(self) -> str:
        name = signal.Signals(self.signal).name
        if self.checkpoint is None:
            where = "no checkpoint was written (no Checkpointing plugin is attached)"
        elif self.resumable:
            where = f"checkpoint saved: {self.checkpoint}; resume with {self.resume_hint}"
        else:  # written by a saver that keeps the model only: say so, never promise a resume
            where = f"checkpoint saved: {self.checkpoint}, with the model only: it cannot be resumed from"
        return f"training stopped by {name} at step {self.step} (the step boundary after the signal); {where}"


def _named(signum: int) -> int:
    try:
        return signal.Signals(signum)
    except ValueError:  # a real-time signal: a number without a name
        return int(signum)


def catchable_signals(signals: object) -> tuple[int, ...]:
    """``signals`` as a tuple (``signal.Signals`` where named); a ConfigError naming any this process cannot catch."""
    catchable = {int(s) for s in signal.valid_signals()} - {signal.SIGKILL, signal.SIGSTOP}
    allowed = (
        "signals this process can catch, such as signal.SIGTERM, signal.SIGINT or signal.SIGUSR1 (not SIGKILL, SIGSTOP)"
    )
    if isinstance(signals, int | str) or not isinstance(signals, Iterable):
        raise ConfigTypeError(f"signals must be a list of {allowed}, got {signals!r:.80}")
    found = []
    for value in signals:
        if isinstance(value, str) and hasattr(signal, "SIG" + value.upper().removeprefix("SIG")):
            hint = f": write signal.SIG{value.upper().removeprefix('SIG')}"
            raise ConfigTypeError(f"signals holds the str {value!r}{hint} (allowed are {allowed})")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigTypeError(f"signals holds {value!r:.80} ({type(value).__name__}): allowed are {allowed}")
        if value not in catchable:
            raise ConfigError(f"signals holds {value!r}, which this process cannot catch: allowed are {allowed}")
        found.append(_named(value))
    if not found:
        raise ConfigError(f"signals is empty, so nothing could stop the run: give {allowed}, or leave Preemption out")
    return tuple(found)


class Preemption(Plugin):
    """Stop at the next step boundary on SIGTERM / a first SIGINT, save, raise ``TrainingInterrupted``.

    Args:
        check_every: steps between checks across processes (default 10; one process checks every step).
        signals: the signals that request the stop (default SIGTERM and SIGINT).
        resume_hint: how the exit message says to resume (default the Engine's ``resume(engine, True)``;
            the Trainer says ``trainer.train(resume_from_checkpoint=True)``).
        return_after_stop: after the stop checkpoint, return from ``fit()`` instead of raising
            ``TrainingInterrupted`` (transformers' ``enable_jit_checkpoint``: the script goes on).

    The stop checkpoint is always resumable: a Checkpointing plugin with ``save_only_model=True``
    writes this one whole (it is what the next run resumes from). While the handlers are installed,
    DataLoader workers forked by this process ignore SIGTERM and SIGINT (``worker_signals.py``), so a
    signal to the whole process group (SLURM, a terminal) stops the run here, not in its workers.

    Example:
        >>> import signal, torch
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(2, 1)
        >>> engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), max_steps=2,
        ...                 train_data=[(torch.ones(2, 2), torch.ones(2, 1))] * 2, loss_fn=torch.nn.MSELoss(),
        ...                 plugins=[Preemption()])
        >>> before = signal.getsignal(signal.SIGTERM)
        >>> _ = engine.fit()
        >>> signal.getsignal(signal.SIGTERM) is before  # handlers are installed only while training
        True
    """

    priority = Priority.CONSUMER  # after FlowControl (PRODUCER) set this step's flags

    def __init__(
        self,
        check_every: int | None = None,
        signals: Sequence[int] = (signal.SIGTERM, signal.SIGINT),
        *,
        resume_hint: str = ENGINE_RESUME,
        return_after_stop: bool = False,
    ) -> None:
        if check_every is not None and (isinstance(check_every, bool) or not isinstance(check_every, int)):
            raise ConfigError(f"check_every must be a positive int or None, got {check_every!r}")
        if check_every is not None and check_every < 1:
            raise ConfigError(f"check_every must be a positive int or None, got {check_every!r}")
        if not isinstance(resume_hint, str):
            raise ConfigTypeError(
                f"resume_hint must be a str (how the exit message says to resume), got {resume_hint!r}"
            )
        check_flag("return_after_stop", return_after_stop)
        self.check_every = check_every
        self.signals = catchable_signals(signals)
        self.resume_hint = resume_hint
        #: transformers' enable_jit_checkpoint: after the stop checkpoint, fit() returns (the script goes on)
        self.return_after_stop = return_after_stop
        self.received: int | None = None  # the signal that asked for the stop (this process)
        self.stopped_at: int | None = None  # the step training stopped at, once it did
        self._previous: dict[int, Any] = {}
        self._every = 1
        self._group: Any = None
        self._group_made = False
        self._engine: Engine | None = None
        self._agreeing: Any = None  # the STEP_END handler's handle, several processes only

    def schedules(self) -> set[str]:
        """On a signal it asks for a save and a stop (so a Checkpointing with no schedule of its own is not idle)."""
        return {"save", "stop"}

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_START, self.install, priority=Priority.FIRST)
        # STEP_END only under several processes, where the ranks must agree on the step (install): in
        # one process the signal handler sets the Control flags itself, and no step pays for a handler
        # the very last TRAIN_END handler (after the output_dir lock is released), also on failure
        self.on(engine, Event.TRAIN_END, self.finish, priority=Priority.LAST.after("*", "Checkpointing"), cleanup=True)

    # -- handlers ----------------------------------------------------------------------------------
    def install(self, ev: TrainStartEvent) -> None:
        """Take SIGTERM / SIGINT for this run (main thread only: Python runs signal handlers there)."""
        self.received = self.stopped_at = None
        self._engine = ev.engine
        processes = world_size()
        self._every = 1 if processes == 1 else (self.check_every or DEFAULT_CHECK_EVERY)
        if processes > 1 and self._agreeing is None:
            self._agreeing = self.on(ev.engine, Event.STEP_END, self.step_end)
        if processes > 1 and not self._group_made:
            self._group = _cpu_group()
            self._group_made = True
        if threading.current_thread() is not threading.main_thread():
            logger.debug("Preemption: training runs outside the main thread; no signal handlers installed")
            return
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        worker_signals.activate()  # DataLoader workers forked from now on ignore the stop (the group's SIGTERM)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == signal.SIGINT:
            self.restore()  # a second Ctrl-C: stop now, the default way
            raise KeyboardInterrupt
        if self.received is None:
            self.received = signum
            if self._every == 1 and self._engine is not None:  # one process: stop after this step, saving
                _want_resumable_save(self._engine)
                self._engine.control.should_save = True
                self._engine.control.should_training_stop = True
            hint = " (press Ctrl-C again to stop at once, without a checkpoint)" if signum == signal.SIGINT else ""
            _say(f"trainbus: {signal.Signals(signum).name} received; training stops at the next step boundary and "
                 f"saves a checkpoint{hint}")  # fmt: skip

    def step_end(self, ev: StepEndEvent) -> None:
        """Stop here when a signal arrived (on any rank, agreed every ``check_every`` steps)."""
        state = ev.engine.state
        if self._every == 1:
            agreed = self.received
        elif state.global_step % self._every == 0 or state.global_step >= state.max_steps > 0:
            agreed = self._agree(self.received)
        else:
            return
        if agreed is None:
            return
        self.received = agreed
        self.stopped_at = state.global_step
        _want_resumable_save(ev.engine)
        control = ev.engine.control
        control.should_save = True
        control.should_training_stop = True

    def finish(self, ev: TrainEndEvent) -> None:
        """Put the previous handlers back; after a stop, say where the checkpoint is and raise."""
        self.restore()
        if getattr(ev, "error", None) is not None:
            return  # training failed: the failure propagates, nothing to add
        if self._agreeing is None and self.received is not None and self._stopped_by_signal(ev.engine):
            self.stopped_at = ev.engine.state.global_step  # one process: the flags the handler set were acted on
        if self.stopped_at is not None and self.received is not None:
            checkpoint = _checkpoint_of(ev.engine)
            interrupted = TrainingInterrupted(
                self.received,
                self.stopped_at,
                checkpoint,
                self.resume_hint,
                checkpoint is None or _resumable(checkpoint),
            )
            if self.return_after_stop:
                if ev.engine.state.is_world_process_zero:
                    _say(f"trainbus: {interrupted}; training returns (enable_jit_checkpoint)")
                return
            if ev.engine.state.is_world_process_zero:
                _say(f"trainbus: {interrupted}; exiting with status {interrupted.code}")
            raise interrupted
        if self.received is not None:  # after the last check: training had finished; the signal still counts
            logger.warning("trainbus: %s arrived after the last step; passing it on", signal.Signals(self.received))
            signal.raise_signal(self.received)

    @staticmethod
    def _stopped_by_signal(engine: Engine) -> bool:
        """Whether the run stopped for the signal (before its planned end, or with this step's checkpoint
        written after it), not because it had finished anyway."""
        state = engine.state
        return state.global_step < state.max_steps or _checkpoint_of(engine) is not None

    def restore(self) -> None:
        """The handlers from before TRAIN_START, back in place (idempotent)."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        if previous:
            worker_signals.deactivate()

    def _agree(self, received: int | None) -> int | None:
        """The largest pending signal number over all ranks (None when no rank has one): one CPU all-reduce."""
        import torch.distributed as dist

        flag = torch.tensor([received or 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        value = int(flag[0])  # a CPU tensor: no device sync
        return value or None


def _cpu_group() -> Any:
    """A process group whose collectives run on CPU tensors: the default one under gloo, else a new gloo group
    (made by every rank at the same TRAIN_START, as new_group requires)."""
    import torch.distributed as dist

    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def _checkpoint_of(engine: Engine) -> str | None:
    """The checkpoint written at this step, from the plugin that wrote it (Checkpointing's ``last_saved``)."""
    for plugin in engine.plugins:
        saved = getattr(plugin, "last_saved", None)
        if isinstance(saved, str | Path) and Path(saved).name.endswith(f"-{engine.state.global_step}"):
            return str(saved)
    return None


def _want_resumable_save(engine: Engine) -> None:
    """Tell the savers (Checkpointing's ``resumable_next``) that the coming save is a stop's: whole, resumable."""
    for plugin in engine.plugins:
        if hasattr(plugin, "resumable_next"):
            plugin.resumable_next = True


def _resumable(checkpoint: str) -> bool:
    """Whether the checkpoint holds the training state (its manifest does not mark it model-only)."""
    try:
        manifest = json.loads((Path(checkpoint) / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True  # unreadable here: the resume will say what is wrong with it
    return not (isinstance(manifest, dict) and manifest.get("model_only"))


def _say(text: str) -> None:
    """To stderr (a killed job's user reads it there, whatever logging is set up) and to the log."""
    print(text, file=sys.stderr, flush=True)
    logger.info(text)
