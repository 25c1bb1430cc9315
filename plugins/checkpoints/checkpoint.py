"""Checkpoints: save on SAVE, rotate, resume bit-exactly, load the best model, save a final model.

A checkpoint is a directory ``output_dir/checkpoint-{global_step}`` holding, with no pickle:

- ``model.safetensors``: the model's weights (tied weights once, under transformers' name: ``weights.py``),
  frozen ones included; of an adapter (peft) model only what trains and the buffers, as
  ``trainbus_weights.safetensors``, with the frozen base's fingerprint in the manifest (``frozen.py``),
  checked when the checkpoint is loaded, next to peft's own folder files; where a Trainer subclass's
  ``save_model`` / ``_save`` writes the model files, they are its, and trainbus's weights are
  ``trainbus_weights.safetensors`` unless its ``super()._save`` wrote them (``model_part.py``);
- ``optimizer.json`` + ``optimizer.safetensors``: ``optimizer.state_dict()``;
- ``plugins.json`` + ``plugins.safetensors``: every plugin's ``state_dict()`` (scheduler,
  scaler, early stopping, ...), keyed by plugin name;
- ``rng.json`` + ``rng.safetensors``: Python, numpy, torch CPU (and CUDA) generator states; with
  W processes one pair per rank, ``rng-{rank}.*`` (all written by rank 0, which gathers them);
- ``trainer_state.json``: ``engine.state.to_json()``;
- ``manifest.json``, written last: every file's size and hash (xxh3_128; sha256 in older checkpoints).

It is written into ``checkpoint-{step}.tmp-{pid}``, fsynced and renamed, so a crash leaves
either the complete checkpoint or a temporary directory that nothing reads (K3). Across processes
only rank 0 writes (and rotates), every rank waits at a barrier until the checkpoint is complete,
and a resume takes the checkpoint rank 0 chose, refusing one written by another number of processes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import Composition, Engine, Event, Plugin, Priority
from trainbus.engine.events import (
    EpochEndEvent,
    EvalEndEvent,
    EvalStartEvent,
    Payload,
    SaveEvent,
    StepEndEvent,
    TrainEndEvent,
    TrainStartEvent,
)

from ..control.flow import SaveSchedule, interval
from ..control.strategies import SaveStrategy
from ..data.loading import ensure_resumable_data
from ..distributed.processes import barrier, gather_to_main, rank
from .async_saves import AsyncSaves
from .background import BackgroundWriter, CheckpointWriteError
from .checkpoint_checks import check_checkpointing_arguments, check_checkpointing_options, unscheduled_saves
from .directory import PREFIX, latest_checkpoint, list_checkpoints
from .final_model import save_model
from .io import load_model_weights
from .lineage import RunClaim, claim_run
from .load_best import LoadBestModelAtEnd
from .resuming import (
    chosen_by_main,
    load_checkpoint,
    resolve_checkpoint,
    resume,
    resumed_batch_size,
    rng_file_stems,
)
from .rng import checkpoint_rng_state
from .rotation import checkpoints_to_keep, delete_or_warn, rotate_checkpoints, same_path
from .sharded import saved_by_every_rank
from .sharded_async import ShardedSaves
from .writing import PendingCheckpoint, claim_best, take_checkpoint

logger = logging.getLogger("trainbus.checkpoint")


__all__ = [
    "PREFIX",
    "CheckpointWriteError",
    "Checkpointing",
    "LoadBestModelAtEnd",
    "checkpoints_to_keep",
    "chosen_by_main",
    "claim_run",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_weights",
    "resolve_checkpoint",
    "resume",
    "resumed_batch_size",
    "rng_file_stems",
    "rotate_checkpoints",
    "save_checkpoint",
    "save_model",
]


# -- save -----------------------------------------------------------------------------------------
def save_checkpoint(
    engine: Engine,
    output_dir: str | Path,
    *,
    info: dict[str, Any] | None = None,
    rng_states: Sequence[dict[str, Any]] | None = None,
    model_only: bool = False,
    model_folder: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``output_dir/checkpoint-{global_step}`` atomically and return its path.

    ``model_folder(directory)`` writes the files that make the checkpoint a model folder (config.json, the
    tokenizer's files, ...: the facade's ``checkpoint_extras``), listed in the manifest like trainbus's own.

    ``model_only`` (HF's save_only_model) writes the model and the trainer state but no optimizer,
    plugin or RNG state: smaller, and it cannot be resumed from (loading one says so).

    When this step is the best one (``state.best_global_step == state.global_step``), sets
    ``state.best_model_checkpoint`` to it before writing the state. On failure nothing is left
    that looks complete, the previous checkpoints are untouched and the state is unchanged.
    ``rng_states`` holds every rank's RNG states in rank order (default: this process's only).
    """
    rng_states = [checkpoint_rng_state(engine)] if rng_states is None else list(rng_states)
    pending = take_checkpoint(
        engine, output_dir, info=info, rng_states=rng_states, model_only=model_only, model_folder=model_folder
    )
    return _write_now(pending, engine)


# -- plugins --------------------------------------------------------------------------------------
class Checkpointing(Plugin):
    """Writes a checkpoint at every SAVE event, then rotates old ones.

    From TRAIN_START to TRAIN_END it holds output_dir's lock (one run per directory), and a new run
    (a fresh ``fit()``, or one resumed from a checkpoint outside output_dir) first moves the earlier
    run's checkpoints into ``output_dir/previous-runs/<time>/`` with a warning: never deleted by
    rotation, never resumed by ``resume(engine, True)`` (``lock.py``, ``lineage.py``).

    Args:
        output_dir: where ``checkpoint-{step}`` directories go.
        save_total_limit: keep at most this many complete checkpoints (None keeps all); the best
            (``state.best_model_checkpoint``) and the newest are never deleted.
        best_metric_key: the metric that defines the best checkpoint (HF metric_for_best_model);
            its last evaluated value is recorded in each manifest. The best step itself comes
            from ``state.best_global_step`` (the BestMetric plugin).
        save_safetensors: must be True: trainbus never writes pickle.
        save_strategy: for an Engine without FlowControl, when to request saves: "no" / None (only
            act on SAVE set by others), "steps" (every ``save_steps`` and at the last step), "epoch",
            "best" (after an evaluation that found a new best). The decision is control's
            ``SaveSchedule`` (control/flow.py), the one owner of when to save; this plugin only writes.
        save_steps: an int, or a float in (0, 1) as a fraction of max_steps (as HF).
        save_only_model: checkpoints hold the model and trainer state only (HF); they cannot be resumed.
        only_best_at_end: with ``save_total_limit=1``, a finished run deletes every checkpoint but
            the best (HF's Trainer); during the run the newest stays too, for resuming.
        save_async: the step that saves only copies the state into host buffers (pinned, for a GPU's
            tensors) and training goes on while a background thread writes, publishes and rotates
            (``background.py``): one write in flight, every promise of a synchronous save kept, the end of
            training and a stop's checkpoint wait for it, a failed write raises at the next step. It holds one
            host copy of the checkpoint's tensors from the run's first step to its end.

    Example:
        >>> import torch, tempfile
        >>> from trainbus.engine import Engine
        >>> from trainbus.plugins.checkpoints.checkpoint import Checkpointing, list_checkpoints
        >>> model = torch.nn.Linear(2, 1)
        >>> out = tempfile.mkdtemp()
        >>> engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), max_steps=4,
        ...                 train_data=[(torch.ones(2, 2), torch.ones(2, 1))] * 4, loss_fn=torch.nn.MSELoss(),
        ...                 plugins=[Checkpointing(out, save_total_limit=2, save_strategy="steps", save_steps=1)])
        >>> _ = engine.fit()
        >>> [step for step, _ in list_checkpoints(out)]
        [3, 4]
    """

    priority = Priority.CONSUMER

    def __init__(
        self,
        output_dir: str | Path,
        save_total_limit: int | None = None,
        best_metric_key: str | None = None,
        save_safetensors: bool = True,
        *,
        save_strategy: str | None = None,
        save_steps: int | float = 500,
        only_best_at_end: bool = False,
        save_only_model: bool = False,
        model_folder: Callable[[Path], None] | None = None,
        save_async: bool = False,
    ) -> None:
        strategy = check_checkpointing_arguments(output_dir, save_total_limit, save_safetensors, save_strategy,
                                                  save_steps)
        check_checkpointing_options(best_metric_key, only_best_at_end, save_only_model, model_folder, save_async)
        self.output_dir = Path(output_dir)
        self.save_total_limit = save_total_limit
        self.best_metric_key = best_metric_key
        self.save_strategy = strategy
        self.save_steps = save_steps
        # when to save is control's decision (the one SaveSchedule rules); "no": only SAVE set by others
        self._schedule = None if strategy == "no" else SaveSchedule(SaveStrategy(strategy))
        self.only_best_at_end = only_best_at_end and save_total_limit == 1
        self.save_only_model = save_only_model
        self.model_folder = model_folder  # writes config.json, tokenizer files, ... into each checkpoint
        self.last_metric: float | None = None
        self.resumable_next = False  # the next save is a stop's (Preemption): whole, whatever save_only_model says
        self.last_saved: Path | None = None
        self._written: list[Path] = []  # checkpoints this run wrote, oldest first (rotation order)
        self.claim = RunClaim(self.output_dir)  # the output_dir lock and which checkpoints are this run's
        self.save_async = save_async
        # the writer, its buffers, the waits (async_saves.py)
        self._async = AsyncSaves(self.output_dir, model_only=save_only_model) if save_async else None
        self._whole_step: int | None = None  # the step of this run's last whole (resumable) checkpoint
        self._stop_step: int | None = None  # the step of the stop's save (Preemption's), written synchronously
        self._sharded = ShardedSaves(self)  # FSDP2 / DeepSpeed: every rank writes its part (sharded_async.py)

    def schedules(self) -> set[str]:
        """Its own save_strategy schedules saves (the bare Engine's shortcut); "no" leaves them to others."""
        return set() if self._schedule is None else {"save"}

    def check_composition(self, composition: Composition) -> list[str] | None:
        return unscheduled_saves(composition)

    @property
    def written(self) -> list[Path]:
        """The checkpoints this plugin wrote, oldest first: the run's own (``lineage.RunClaim``)."""
        return list(self._written)

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.SAVE, self.save)
        ensure_resumable_data(engine)  # exact mid-epoch resumes: each epoch's data order is kept (data/replay.py)
        # one run per output_dir (lock.py): held from the start of training to its end, also after an error;
        # a new run sets the earlier run's checkpoints aside first (lineage.py), whatever the composition
        self.on(engine, Event.TRAIN_START, self._claim_run, priority=Priority.FIRST, before="*")
        self.on(engine, Event.TRAIN_END, self._release_lock, priority=Priority.LAST, after="*", cleanup=True)
        if self._async is not None:  # a write in flight ends before anything reads checkpoints at TRAIN_END
            self.on(engine, Event.TRAIN_END, self._end_writes, priority=Priority.FIRST, before="*", cleanup=True)
            self.on(engine, Event.STEP_END, self._raise_write_error, priority=Priority.FIRST)
        if self.only_best_at_end:
            # after LoadBestModelAtEnd (FIRST) has read the best checkpoint
            self.on(engine, Event.TRAIN_END, self._keep_only_best, priority=Priority.LAST)
        if self.save_strategy == "steps":
            self.on(engine, Event.STEP_END, self._step_end, priority=Priority.DEFAULT)
        elif self.save_strategy == "epoch":
            self.on(engine, Event.EPOCH_END, self._epoch_end, priority=Priority.DEFAULT)
        elif self.save_strategy == "best":
            self.on(engine, Event.EVAL_START, self._eval_start)
        if self.best_metric_key is not None or self.save_strategy == "best":
            # after BestMetric (which updates state.best_global_step at a higher priority)
            self.on(engine, Event.EVAL_END, self._eval_end, priority=Priority.CONSUMER)

    # -- the save_strategy shortcut: control's SaveSchedule decides -------------------------------
    def _step_end(self, ev: StepEndEvent) -> None:
        state = ev.engine.state
        assert self._schedule is not None
        self._schedule.step_end(state, ev.engine.control, interval(self.save_steps, state.max_steps))

    def _epoch_end(self, ev: EpochEndEvent) -> None:
        assert self._schedule is not None
        self._schedule.epoch_end(ev.engine.control)

    def _eval_start(self, ev: EvalStartEvent) -> None:
        assert self._schedule is not None
        self._schedule.eval_start(ev.engine.state)

    def _eval_end(self, ev: EvalEndEvent) -> None:
        engine = ev.engine
        key = self.best_metric_key
        if key is not None:
            value = ev.metrics.get(key, ev.metrics.get(f"{ev.prefix}_{key}"))
            if isinstance(value, int | float) or (isinstance(value, torch.Tensor) and value.numel() == 1):
                self.last_metric = float(value)  # once per evaluation, not per step
        if self._schedule is not None:
            self._schedule.eval_end(engine.state, engine.control)  # "best": after a new best

    def _claim_run(self, ev: TrainStartEvent) -> None:
        if self._async is not None:
            self._async.training = True  # saves go to the background until TRAIN_END waits for them
        self._whole_step = None
        if self.claim.start(ev.engine):
            self._written = []  # a new run: the checkpoints it writes are its own

    def _release_lock(self, ev: Payload) -> None:
        self._whole_step = None  # a save after fit() (a direct _save_checkpoint) writes again
        self.claim.release()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A resume: the coming fit() decides whether it continues output_dir's run (``lineage.py``)."""
        self.claim.loaded, self.claim.wrote = True, False

    def _keep_only_best(self, ev: TrainEndEvent) -> None:
        """HF: with ``save_total_limit=1`` a finished run keeps only the best checkpoint, not also the newest."""
        best = ev.engine.state.best_model_checkpoint
        if best is None or rank() != 0 or not ev.engine.state.is_world_process_zero:
            return
        for _, path in list_checkpoints(self.output_dir):
            if not same_path(best, path) and delete_or_warn(path):
                logger.info("deleted %s: save_total_limit=1 keeps only the best checkpoint", path)

    def save(self, ev: SaveEvent) -> None:
        """The SAVE handler: write the checkpoint (main process only; every rank its slices under FSDP) and rotate.

        An engine offering ``around_checkpoint_save(write)`` (the facade: a subclass's ``_save_checkpoint``,
        whose ``super()`` writes) runs the write itself.
        """
        around = getattr(ev.engine, "around_checkpoint_save", None)
        if callable(around):
            around(partial(self.write, ev.engine))
        else:
            self.write(ev.engine)

    def write(self, engine: Engine, *, wait: bool = False) -> None:
        """Write this step's checkpoint (every rank calls it) and rotate; with ``save_async``, in the background
        unless ``wait`` or the save is a stop's (Preemption's: whole and on disk before the process ends)."""
        if self._async is not None:
            self._async.wait(engine, why=f"the save at step {engine.state.global_step}", expected=False)
        step = engine.state.global_step
        if self._whole_step == step and (self.resumable_next or self._stop_step == step):
            self.resumable_next = False  # a stop's save of a step whose whole checkpoint is taken: a signal came while
            return  # it was written and asked again (a save after a new best, at the same step, is written again)
        rng_states = gather_to_main(checkpoint_rng_state(engine))  # every rank's, on rank 0 (all ranks call it)
        final = self.output_dir / f"{PREFIX}{engine.state.global_step}"
        main = rank() == 0 and engine.state.is_world_process_zero
        model_only = self.save_only_model and not self.resumable_next  # a stop's checkpoint is resumed from
        background = self._async is not None and self._async.training and not (wait or self.resumable_next)
        self._stop_step = step if self.resumable_next else None
        self.resumable_next = False  # taken before writing: a signal during this save asks for the next one
        info: dict[str, Any] = {}
        if self.best_metric_key is not None:
            info["metric"] = {"key": self.best_metric_key, "value": self.last_metric}
        try:
            if saved_by_every_rank(engine.model):  # FSDP / DeepSpeed: every rank writes its own part
                kind = self._sharded.save(engine, info, rng_states, model_only, background)
                background = kind == "background"
                if not background:
                    self._published(engine.state.best_model_checkpoint, final, main)
            elif main:
                pending = take_checkpoint(
                    engine, self.output_dir, info=info, rng_states=rng_states, model_only=model_only,
                    model_folder=self.model_folder, buffers=self._async.buffers if self._async and background else None,
                )  # fmt: skip
                best = engine.state.best_model_checkpoint
                if self._async is not None and background:
                    self._async.submit(engine, pending, lambda final: self._published(best, final, main))
                else:
                    self._published(best, _write_now(pending, engine), main)
            else:  # rank 0 writes; the others record what it records
                if self._async is not None and background:
                    self._async.follow(engine)
                claim_best(engine.state, final)
                self._published(engine.state.best_model_checkpoint, final, main)
            self._whole_step = None if model_only else engine.state.global_step
        finally:
            if not background:
                barrier()  # no rank reads (resume, best model) before the checkpoint is complete

    def _published(self, best: str | None, final: Path, main: bool) -> None:
        """After the rename (in the writer, for a background save): this run wrote it; rotation (rank 0)."""
        self.claim.wrote = True
        if main:
            self._written = [path for path in self._written if path != final] + [final]
            rotate_checkpoints(self.output_dir, self.save_total_limit, best, self._written)
        self.last_saved = final

    @property
    def writer(self) -> BackgroundWriter | None:
        """The background writer of ``save_async`` (None without)."""
        return None if self._async is None else self._async.writer

    def wait_for_writes(
        self, engine: Engine, why: str = "", *, raise_error: bool = True, expected: bool = True
    ) -> None:
        """Wait until the background write in flight is on disk (every rank calls it: they meet after it), then
        raise its error if it failed; a handler reading a checkpoint at SAVE calls it first. Without
        ``save_async``: nothing to wait for. A wait not ``expected`` is logged as a warning (``async_saves.py``)."""
        if self._async is not None:
            self._async.wait(engine, why, raise_error=raise_error, expected=expected)

    def _raise_write_error(self, ev: StepEndEvent) -> None:
        if self._async is not None:
            self._async.step_end(ev.engine)

    def _end_writes(self, ev: TrainEndEvent) -> None:
        """TRAIN_END, first: the write in flight ends before the best model is loaded, rotation keeps only the
        best and the lock is released; also when training failed (its error is then logged, not raised)."""
        if self._async is not None:
            self._async.end(ev.engine, failed=ev.error is not None)
        if ev.error is None:
            self._sharded.end()  # the writers' group: its last collective kept (gloo's exit, processes.py)


def _write_now(pending: PendingCheckpoint, engine: Engine) -> Path:
    try:
        return pending.write()
    except BaseException:
        pending.rollback(engine.state)
        raise
