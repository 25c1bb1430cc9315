"""Which checkpoints in output_dir are this run's, decided by the Checkpointing plugin for any composition.

The rule is ``lock.py``'s (the ``checkpoint-N`` directly in output_dir are one run's: the one that last
started there fresh, and its resumes). The Checkpointing plugin applies it at TRAIN_START, holding the
output_dir lock, so a bare Engine gets what the Trainer gets: a new run first moves the earlier run's
checkpoints into ``previous-runs/`` (``lock.start_fresh``), so rotation never deletes them and a later
``resume(engine, True)`` never loads them.

Whether this fit() starts a new run:

- told by a caller that knows what was resumed (``RunClaim.expect``: the Trainer's
  ``resume_from_checkpoint``, through ``checkpoint.claim_run``, or the path a ``resume(engine, path)`` read):
  a fresh run, or a checkpoint outside output_dir, starts a new run (``lock.starts_a_run``);
- else, nothing loaded into the engine (no ``load_state_dict``) at step 0: a fresh run, new;
- then the run's identity decides (``identity.py``): output_dir's checkpoints are this run's when every one of
  them names this run's ``run_id``; one naming another run makes this a new run, whatever else agrees (a
  checkpoint copied in by hand, another run's directory);
- checkpoints without an id (older releases), the others this run's, are judged as before, conservatively:
  told, the caller's word; the same engine fitted again (nothing loaded since it saved), the same run;
  else the same run only when output_dir's ``checkpoint-{global_step}`` holds what the engine was resumed to
  (the state: step, log history, counters, best metric; and bit for bit a few of its smallest trainable
  tensors, of which at least one must be found by name: nothing to compare is not "the same").

A loaded engine judged a new run (a branch) gets an id of its own: its checkpoints and log records are told
apart from the run it branched from.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from trainbus.engine import ConfigError, Engine, State

from ..distributed.processes import broadcast_from_main, rank
from . import verified
from .directory import PREFIX, checkpoint_dirs, finish_set_aside
from .identity import checkpoint_run_id, new_run_id, run_id
from .lock import OutputDirLock, hold_output_dir, lock_on_main, start_fresh, starts_a_run
from .model_part import weights_file
from .reading import read_trainer_state

logger = logging.getLogger("trainbus.checkpoint")

__all__ = ["UNSET", "RunClaim", "claim_run", "holds_state"]

UNSET: Any = object()  # no caller said what this fit() resumed
ENGINE_RESUME_TRUE = "resume(engine, True)"
TRAINER_RESUME_TRUE = "train(resume_from_checkpoint=True)"


class RunClaim:
    """The Checkpointing plugin's hold on its output_dir for one fit(): the lock, and the lineage decision."""

    def __init__(self, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.lock: OutputDirLock | None = None
        self.loaded = False  # a state was loaded into the plugin since its last save (a resume)
        self.wrote = False  # this plugin saved since it was loaded or started fresh
        self.ran = False  # a fit() of this plugin's engine started here (its run owns output_dir's checkpoints)
        self.expected: Any = UNSET  # the resume_from_checkpoint a caller announced (claim_run)
        self.resume_true = ENGINE_RESUME_TRUE  # how its messages say "resume the newest": the caller's words

    def expect(self, resume_from_checkpoint: Any, resume_true: str = ENGINE_RESUME_TRUE) -> None:
        """What the coming fit() resumed from (a path, True, or None/False for a fresh run), and how the caller's
        users resume the newest checkpoint (for the messages)."""
        self.expected, self.resume_true = resume_from_checkpoint, resume_true

    def start(self, engine: Engine) -> bool:
        """At TRAIN_START: take the lock (every rank raises if it is held), then on rank 0 finish a move a killed
        run left half done and, for a new run, set the earlier run's checkpoints aside; every rank raises if
        that failed. Returns whether this fit() starts a new run."""
        self.release()
        self.lock = lock_on_main(self.output_dir)  # re-entrant: a Trainer's train() holds it already
        error, new, identity = None, False, None
        if rank() == 0:
            try:
                finish_set_aside(self.output_dir)
                new = self._new_run(engine)
                if new:
                    start_fresh(self.output_dir, self.resume_true)
                    if engine.state.global_step > 0:
                        engine.state.run_id = new_run_id()  # a branch from a checkpoint: a run of its own
                identity = run_id(engine.state)
            except (ConfigError, OSError) as exc:
                error = str(exc)
        # this fit()'s: the next one is told (or loaded) anew
        self.expected, self.loaded, self.resume_true = UNSET, False, ENGINE_RESUME_TRUE
        error, new, identity = broadcast_from_main((error, new, identity))
        if error is not None:
            self.release()
            raise ConfigError(error)
        engine.state.run_id = identity  # every rank: the id rank 0's checkpoints and logs carry
        self.ran = True
        if new:
            self.wrote = False
        return bool(new)

    def _new_run(self, engine: Engine) -> bool:
        """Whether this fit() starts a new run in output_dir: its checkpoints' ids decide; without ids, as before."""
        told = self.expected is not UNSET
        if told and starts_a_run(self.expected, self.output_dir):
            return True  # a fresh run, or a resume from a checkpoint outside output_dir
        if not told and engine.state.global_step == 0 and not self.loaded:
            return True  # nothing resumed: a fresh run
        own = engine.state.run_id
        ids = {checkpoint_run_id(path) for _, path in checkpoint_dirs(self.output_dir)}
        if not ids:
            return self.loaded and not told  # nothing to set aside; a state loaded from elsewhere is a branch
        if own is not None and ids == {own}:
            return False  # every checkpoint there is this run's
        if any(found is not None and found != own for found in ids):
            return True  # another run's checkpoint is there: never taken for this run's
        # checkpoints without an id (an older release's), the others this run's: judged as before, conservatively
        if told:
            return False  # the caller resumed one of output_dir's own checkpoints
        if (self.wrote or self.ran) and not self.loaded:
            return False  # this engine going on after its own fit(), also one that failed before it saved
        return not holds_state(self.output_dir / f"{PREFIX}{engine.state.global_step}", engine)

    def release(self) -> None:
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release()


def _lineage(state: State) -> str:
    """What two states of one run at one step share, and two runs' states almost never do."""
    fields = [state.global_step, state.log_history, state.total_flos, state.num_input_tokens_seen,
              state.best_metric, state.best_global_step, state.epochs_completed, state.micro_steps]  # fmt: skip
    return json.dumps(fields, sort_keys=True, default=repr)


def holds_state(checkpoint: Path, engine: Engine) -> bool:
    """Whether ``checkpoint`` is complete and holds what ``engine`` was resumed to: the same state (step, log
    history, counters, best metric) and, bit for bit, the same values of a few of its smallest trainable
    tensors (a run without logging has little state, and two runs differ in every trained weight)."""
    if not verified.is_complete(checkpoint):
        return False
    try:
        saved = read_trainer_state(checkpoint)
        weights = weights_file(verified.read_manifest(checkpoint, verify=False), checkpoint)
    except (ConfigError, OSError, ValueError) as exc:
        logger.info("%s does not read as a trainer state (%s): not this run's checkpoint", checkpoint, exc)
        return False
    return _lineage(saved) == _lineage(engine.state) and _same_weights(checkpoint / weights, engine)


def _same_weights(file: Path, engine: Engine, count: int = 4) -> bool:
    """The ``count`` smallest trainable floating tensors of the model equal the file's (read alone, not the file)."""
    try:
        if not stat.S_ISREG(os.lstat(file).st_mode):
            return True  # a sharded checkpoint has no such file: the state decides
        with safe_open(str(file), framework="pt") as saved:
            names = set(saved.keys())
            own = [(p.numel(), name, p) for name, p in engine.model.named_parameters()
                   if p.requires_grad and p.is_floating_point() and p.numel() > 0 and name in names]  # fmt: skip
            if not own and any(p.requires_grad for p in engine.model.parameters()):
                logger.info("%s holds none of the model's trainable tensors by name: not this run's checkpoint", file)
                return False  # nothing to compare is no evidence of the same run
            for _, name, param in sorted(own, key=lambda item: item[:2])[:count]:
                value = saved.get_tensor(name)
                if value.shape != param.shape or not torch.equal(value, param.detach().to("cpu", value.dtype)):
                    return False
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        logger.info("could not compare the weights of %s (%s): its state decides", file, exc)
    return True


@contextlib.contextmanager
def claim_run(engine: Engine, resume_from_checkpoint: Any, resume_true: str = TRAINER_RESUME_TRUE) -> Iterator[None]:
    """For a caller that resumes before fit() (the Trainer's train()): output_dir's lock held for the block (the
    resume reads under it), and the Checkpointing plugin told what was resumed, so that its TRAIN_START applies
    the lineage rule to ``resume_from_checkpoint`` itself (``lock.starts_a_run``).

    The directory is ``engine.args.output_dir``, else the Checkpointing plugin's. ``resume_true``: how the
    caller's users resume the newest checkpoint, for the plugin's messages (the Trainer's words by default).
    """
    claims = [p.claim for p in engine.plugins if isinstance(getattr(p, "claim", None), RunClaim)]
    output_dir = getattr(getattr(engine, "args", None), "output_dir", None)
    if output_dir is None and claims:
        output_dir = claims[0].output_dir
    if output_dir is None:
        yield
        return
    with hold_output_dir(output_dir):
        for claim in claims:
            claim.expect(resume_from_checkpoint, resume_true)
        try:
            yield
        finally:
            for claim in claims:
                claim.expected, claim.resume_true = UNSET, ENGINE_RESUME_TRUE
