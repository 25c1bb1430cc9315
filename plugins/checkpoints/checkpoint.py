"""Checkpoints: save on SAVE, rotate, resume bit-exactly, load the best model, save a final model.

A checkpoint is a directory ``output_dir/checkpoint-{global_step}`` holding, with no pickle:

- ``model.safetensors``: the model's weights (tied weights once); of a model with frozen parameters
  (a peft / LoRA base) only what trains and the buffers, with the base's fingerprint in the manifest
  (``frozen.py``), checked when the checkpoint is loaded;
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

import dataclasses
import logging
import os
import re
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import ConfigError, Engine, Event, Plugin, Priority, State
from trainbus.engine.events import (
    EpochEndEvent,
    EpochStartEvent,
    EvalEndEvent,
    Payload,
    SaveEvent,
    StepEndEvent,
    TrainEndEvent,
)

from ..distributed.processes import barrier, broadcast_from_main, gather_to_main, rank, world_size
from . import io as cio
from . import verified
from .frozen import base_fingerprint, check_base, trainable_state_dict
from .io import load_model_weights, save_model
from .sharded import (
    SHARDED,
    load_model_shards,
    load_shards,
    save_sharded_checkpoint,
    saved_by_every_rank,
    world_size_error,
)

logger = logging.getLogger("trainbus.checkpoint")

PREFIX = "checkpoint-"
_NAME = re.compile(r"^checkpoint-(\d+)$")
_TMP = re.compile(r"^checkpoint-\d+\.(?:tmp|old)-(\d+)$")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")

__all__ = [
    "Checkpointing",
    "LoadBestModelAtEnd",
    "checkpoints_to_keep",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_weights",
    "resume",
    "resumed_batch_size",
    "rotate_checkpoints",
    "save_checkpoint",
    "save_model",
]


# -- listing and rotation -------------------------------------------------------------------------
def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (a readable manifest) in ``output_dir`` as ``(step, path)``, oldest first."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _NAME.match(child.name)
        if match and child.is_dir() and verified.is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    found = list_checkpoints(output_dir)
    return found[-1][1] if found else None


def _same(a: str | Path | None, b: Path) -> bool:
    return a is not None and Path(a).resolve() == b.resolve()


def checkpoints_to_keep(steps: list[int], limit: int, best: int | None) -> set[int]:
    """Which of ``steps`` (ordered oldest to newest) rotation keeps (HF's rule).

    The newest ``limit`` stay; when the best is older than those, it stays instead of the oldest
    of them, except that the newest always stays (so ``limit=1`` keeps best and newest: 2).
    """
    if limit < 1:
        raise ConfigError(f"save_total_limit must be an integer >= 1 or None, got {limit!r}")
    if best is None or best not in steps or best in steps[-limit:]:
        return set(steps[-limit:])
    newest = steps[-max(limit - 1, 1) :]
    return {best, *newest}


def rotate_checkpoints(
    output_dir: str | Path, limit: int | None, best: str | Path | None = None, written: Sequence[str | Path] = ()
) -> list[Path]:
    """Delete complete checkpoints beyond ``limit`` (never the best nor the newest); returns the deleted.

    ``written`` lists the checkpoints this run wrote, oldest first: they count as more recent than
    any other, so checkpoints an earlier run left with higher step numbers rotate out first and
    the checkpoint just written is never the one deleted.
    Incomplete directories are not counted and not touched, except temporary directories left
    by processes that no longer run, which are removed.
    """
    _remove_stale_temporaries(Path(output_dir))
    found = list_checkpoints(output_dir)
    if limit is None or not found:
        return []
    best_step = next((step for step, path in found if _same(best, path)), None)
    ours = [step for path in written for step, found_path in found if _same(path, found_path)]
    by_recency = [step for step, _ in found if step not in ours] + ours
    keep = checkpoints_to_keep(by_recency, limit, best_step)
    deleted = []
    for step, path in found:
        if step not in keep:
            _delete(path)
            deleted.append(path)
    return deleted


def _delete(path: Path) -> None:
    # rename first: a crash during rmtree must not leave a half-deleted dir that still has its manifest
    doomed = path.with_name(f"{path.name}.old-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _remove_stale_temporaries(root: Path) -> None:
    if not root.is_dir():
        return
    for child in root.iterdir():
        match = _TMP.match(child.name)
        if match and not _pid_alive(int(match.group(1))):
            shutil.rmtree(child, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers come from a save that already failed
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists but belongs to someone else
    return True


# -- save -----------------------------------------------------------------------------------------
def save_checkpoint(
    engine: Engine,
    output_dir: str | Path,
    *,
    info: dict[str, Any] | None = None,
    rng_states: Sequence[dict[str, Any]] | None = None,
    model_only: bool = False,
) -> Path:
    """Write ``output_dir/checkpoint-{global_step}`` atomically and return its path.

    ``model_only`` (HF's save_only_model) writes the model and the trainer state but no optimizer,
    plugin or RNG state: smaller, and it cannot be resumed from (loading one says so).

    When this step is the best one (``state.best_global_step == state.global_step``), sets
    ``state.best_model_checkpoint`` to it before writing the state. On failure nothing is left
    that looks complete, the previous checkpoints are untouched and the state is unchanged.
    ``rng_states`` holds every rank's RNG states in rank order (default: this process's only).
    """
    rng_states = [cio.rng_state()] if rng_states is None else list(rng_states)
    if engine.optimizer is None:
        raise ConfigError("save_checkpoint needs engine.optimizer: a checkpoint without it cannot resume")
    if saved_by_every_rank(engine.model):
        raise ConfigError("an FSDP or DeepSpeed model is saved by every rank: use save_sharded_checkpoint")
    state = engine.state
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{state.global_step}"
    tmp = root / f"{final.name}.tmp-{os.getpid()}"
    previous_best = state.best_model_checkpoint
    if state.best_global_step is not None and state.best_global_step == state.global_step:
        state.best_model_checkpoint = str(final)
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        frozen_base = base_fingerprint(engine.model)
        weights = tmp / "model.safetensors"
        if frozen_base is None:
            written = cio.save_weights(engine.model, weights)
        else:  # a frozen base: only what trains, the base known by its fingerprint
            written = cio.write_tensors(weights, trainable_state_dict(engine.model))
        files = {weights.name: written}  # file name -> manifest entry: size, and the hash taken as it was written
        if not model_only:
            files |= cio.write_bundle(tmp, "optimizer", engine.optimizer.state_dict())
            files |= cio.write_bundle(tmp, "plugins", engine.state_dict()["plugins"])
            for stem, rng in zip(rng_file_stems(len(rng_states)), rng_states, strict=True):
                files |= cio.write_bundle(tmp, stem, rng)
        files["trainer_state.json"] = cio.write_text(tmp / "trainer_state.json", state.to_json())
        processes = {"world_size": len(rng_states)} if len(rng_states) > 1 else {}
        base = {"frozen_base": frozen_base} if frozen_base is not None else {}
        only = {"model_only": True} if model_only else {}
        listed = {"global_step": state.global_step, **processes, **base, **only, **(info or {})}
        cio.write_manifest(tmp, files, listed, entries=files)
        cio.sync_files(tmp, [*files, cio.MANIFEST])  # every file and tmp's entries durable before the rename
        _publish(tmp, final)
    except BaseException:
        state.best_model_checkpoint = previous_best
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def rng_file_stems(processes: int) -> list[str]:
    """The RNG bundles of a checkpoint written by ``processes`` processes: ``rng``, or ``rng-{rank}`` each."""
    return ["rng"] if processes == 1 else [f"rng-{r}" for r in range(processes)]


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (a re-save of that step) is replaced."""
    cio.publish_directory(tmp, final)


# -- load / resume --------------------------------------------------------------------------------
def resolve_checkpoint(checkpoint: str | Path | bool, output_dir: str | Path | None, *, verify: bool = False) -> Path:
    """A checkpoint path from ``resume_from_checkpoint`` (a path, or True for the latest complete one).

    With ``verify``, True means the newest checkpoint whose files match their manifest: a damaged
    newer one (a truncated or altered file) is skipped with a warning naming it, so nothing is lost.
    """
    if checkpoint is True:
        if output_dir is None:
            raise ConfigError("resume_from_checkpoint=True needs an output_dir to search (or a Checkpointing plugin)")
        latest = _newest_intact(output_dir) if verify else latest_checkpoint(output_dir)
        if latest is None:
            root = Path(output_dir)
            seen = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
            raise ConfigError(
                f"resume_from_checkpoint=True: no complete checkpoint (checkpoint-N with a valid {cio.MANIFEST}) "
                f"in {root}; found: {seen or 'nothing'}"
            )
        return latest
    if isinstance(checkpoint, bool) or not isinstance(checkpoint, str | os.PathLike):
        raise ConfigError(f"resume_from_checkpoint must be a path or True, got {checkpoint!r}")
    path = Path(checkpoint)
    if not path.is_dir():
        raise ConfigError(f"resume_from_checkpoint={str(path)!r} is not a directory")
    return path


def _newest_intact(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint whose files all match the manifest; damaged newer ones are warned about."""
    found = list_checkpoints(output_dir)
    for _, path in reversed(found):
        try:
            verified.read_manifest(path, verify=True)
        except ConfigError as exc:
            warnings.warn(
                f"resume_from_checkpoint=True: skipping the damaged checkpoint {path} ({exc}); "
                "resuming from the newest intact one before it",
                stacklevel=2,
            )
            continue
        return path
    if found:
        raise ConfigError(
            f"resume_from_checkpoint=True: every checkpoint in {output_dir} is damaged (see the warnings)"
        )
    return None


def load_checkpoint(engine: Engine, path: str | Path, *, verify: bool = True) -> dict[str, Any]:
    """Verify a checkpoint and restore model, optimizer, state and plugins into ``engine``.

    Returns the RNG states (not applied: ``resume`` applies them where the interrupted run was).
    Reads only JSON and safetensors files listed in the manifest, each checked against it as it is
    read (``verify=False``: the caller has just verified them), and applies nothing before every
    listed file has been checked.
    """
    directory = Path(path)
    manifest = verified.read_manifest(directory, verify=False)
    if manifest.get("model_only"):
        raise ConfigError(
            f"checkpoint {directory} was saved with save_only_model=True: it holds the model but no optimizer, "
            "scheduler or RNG state, so training cannot resume from it; load its model.safetensors as weights, "
            "or train with save_only_model=False to get resumable checkpoints"
        )
    sharded = SHARDED in manifest  # FSDP: every rank checks and reads only its own slices (sharded.py)
    written_by = manifest.get("world_size", 1)
    if written_by != world_size():
        raise ConfigError(
            world_size_error(directory, written_by)
            if sharded
            else f"checkpoint {directory} was written by {written_by} process(es) but this run has {world_size()}: "
            f"resume it with {written_by} (each rank's RNG states and data share depend on it)"
        )
    if engine.optimizer is None:
        raise ConfigError("resuming needs engine.optimizer: pass it to the Engine or attach the optimizer plugin first")
    files = verified.CheckedFiles(directory, manifest, verify=verify and not sharded)
    state = _trainer_state(files)  # the small files first: a damaged one fails before the large are read
    plugins = files.bundle("plugins")
    stem = rng_file_stems(written_by)[rank()]
    rng = files.bundle(stem)
    if not isinstance(rng, dict) or "python" not in rng or "torch" not in rng:
        raise ConfigError(f"checkpoint file {directory / (stem + '.json')} lacks the python/torch RNG states")
    if not sharded:
        weights = files.tensors("model.safetensors")
        optimizer_state = files.bundle("optimizer")
    files.finish()  # every other rank's RNG states too: the checkpoint is whole, or nothing is applied
    if sharded:
        load_shards(engine, directory, verify=verify)
    else:
        where = str(directory / "model.safetensors")
        frozen = check_base(engine.model, manifest.get("frozen_base"), str(directory))
        cio.load_weights(engine.model, weights, where, may_lack=frozen)
        del weights  # views of the mapped file: unmapped now
        try:
            engine.optimizer.load_state_dict(optimizer_state)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise ConfigError(f"{directory / 'optimizer.json'} does not fit engine.optimizer: {exc}") from exc
    # the fields as they are: State.to_dict() deep-copies them (the log history grows with the run)
    fields = {field.name: getattr(state, field.name) for field in dataclasses.fields(state)}
    engine.load_state_dict({"state": fields, "plugins": plugins})
    return rng


def _trainer_state(files: verified.CheckedFiles) -> State:
    path = files.directory / "trainer_state.json"
    data = files.read_bytes(path.name)  # a missing or damaged file: its ConfigError names it
    try:
        return State.from_json(data.decode("utf-8"))
    except (UnicodeDecodeError, TypeError) as exc:
        raise ConfigError(f"checkpoint file {path} is not a valid trainer state: {exc}") from exc
    except ConfigError as exc:
        raise ConfigError(f"checkpoint file {path}: {exc}") from exc


def resume(engine: Engine, checkpoint: str | Path | bool, output_dir: str | Path | None = None) -> Path:
    """Restore a checkpoint into ``engine`` so that ``engine.fit()`` continues the run bit for bit.

    Args:
        engine: a fresh engine built like the interrupted one (same plugins, optimizer, data).
        checkpoint: a checkpoint directory, or True for the latest complete one in ``output_dir``.
        output_dir: where to look for True; defaults to the attached Checkpointing plugin's.

    RNG states are applied now and again just before the interrupted run's next random draw:
    at the first STEP_START (mid-epoch), or at the next fresh EPOCH_START. Creating the resumed
    epoch's data iterator (a DataLoader draws a seed) would otherwise shift every later draw.
    """
    if checkpoint is True and output_dir is None:
        plugin = engine.get_plugin(Checkpointing)
        output_dir = plugin.output_dir if isinstance(plugin, Checkpointing) else None
    path = chosen_by_main(lambda: resolve_checkpoint(checkpoint, output_dir, verify=True))
    rng = load_checkpoint(engine, path, verify=checkpoint is not True)  # True: verified while choosing
    cio.set_rng_state(rng)
    _RestoreRng(engine, rng)
    logger.info("resumed from %s at global step %d", path, engine.state.global_step)
    return path


def resumed_batch_size(checkpoint: str | Path | bool, output_dir: str | None) -> tuple[Path, int | None]:
    """The checkpoint that ``resume_from_checkpoint`` names and the per-device train batch size it trained with.

    True means the newest intact checkpoint in ``output_dir``, chosen on the main process as a resume
    chooses it. The size is the checkpoint's ``state.train_batch_size`` (None when it records none),
    which transformers' ``train()`` starts from under ``auto_find_batch_size``.
    """
    path = chosen_by_main(lambda: resolve_checkpoint(checkpoint, output_dir, verify=True))
    state_path = path / "trainer_state.json"
    # checked against the manifest before it decides anything (the resume checks the rest)
    verified.verify_listed(path, verified.read_manifest(path, verify=False), [state_path.name])
    try:
        size = State.load_from_json(state_path).train_batch_size
    except (OSError, TypeError, ConfigError) as exc:
        raise ConfigError(f"checkpoint file {state_path} is not a valid trainer state: {exc}") from exc
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ConfigError(
            f"checkpoint file {state_path}: train_batch_size must be an integer >= 1 or null, got {size!r}"
        )
    return path, size


def chosen_by_main(choose: Any) -> Path:
    """``choose()`` run on rank 0 and its result (or its ConfigError) on every rank."""
    outcome: tuple[str, str] = ("", "")
    if rank() == 0:
        try:
            outcome = ("path", str(choose()))
        except ConfigError as exc:
            outcome = ("error", str(exc))
    kind, value = broadcast_from_main(outcome)
    if kind == "error":
        raise ConfigError(value)
    return Path(value)


class _RestoreRng:
    """One-shot handlers re-applying RNG states where the uninterrupted run continued."""

    def __init__(self, engine: Engine, rng: dict[str, Any]) -> None:
        self.rng = rng
        first = Priority.FIRST + 1  # before every plugin, as the uninterrupted run had no extra draws
        self.handles = [
            engine.on(Event.STEP_START, self._restore, priority=first, name="resume.restore_rng"),
            engine.on(Event.EPOCH_START, self._epoch_start, priority=first, name="resume.restore_rng"),
        ]

    def _epoch_start(self, payload: EpochStartEvent) -> None:
        if payload.engine.state.batches_in_epoch == 0:
            self._restore(payload)

    def _restore(self, payload: Payload) -> None:
        cio.set_rng_state(self.rng)
        for handle in self.handles:
            handle.remove()


# -- plugins --------------------------------------------------------------------------------------
class Checkpointing(Plugin):
    """Writes a checkpoint at every SAVE event, then rotates old ones.

    Args:
        output_dir: where ``checkpoint-{step}`` directories go.
        save_total_limit: keep at most this many complete checkpoints (None keeps all); the best
            (``state.best_model_checkpoint``) and the newest are never deleted.
        best_metric_key: the metric that defines the best checkpoint (HF metric_for_best_model);
            its last evaluated value is recorded in each manifest. The best step itself comes
            from ``state.best_global_step`` (the BestMetric plugin).
        save_safetensors: must be True: trainbus never writes pickle.
        save_strategy: when to request saves: "no" / None (only act on SAVE set by others),
            "steps" (every ``save_steps`` and at the last step), "epoch", "best" (after an
            evaluation that found a new best).
        save_steps: an int, or a float in (0, 1) as a fraction of max_steps (as HF).
        save_only_model: checkpoints hold the model and trainer state only (HF); they cannot be resumed.
        only_best_at_end: with ``save_total_limit=1``, a finished run deletes every checkpoint but
            the best (HF's Trainer); during the run the newest stays too, for resuming.

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
    ) -> None:
        if save_total_limit is not None and (
            isinstance(save_total_limit, bool) or not isinstance(save_total_limit, int) or save_total_limit < 1
        ):
            raise ConfigError(f"save_total_limit must be an integer >= 1 or None, got {save_total_limit!r}")
        if save_safetensors is not True:
            raise ConfigError(
                "save_safetensors must be True: trainbus checkpoints are safetensors + JSON, never pickle"
            )
        strategy = getattr(save_strategy, "value", save_strategy) or "no"
        if strategy not in SAVE_STRATEGIES:
            raise ConfigError(f"save_strategy must be one of {SAVE_STRATEGIES}, got {save_strategy!r}")
        if strategy == "steps" and not (
            (isinstance(save_steps, int) and not isinstance(save_steps, bool) and save_steps >= 1)
            or (isinstance(save_steps, float) and (0 < save_steps < 1 or (save_steps.is_integer() and save_steps >= 1)))
        ):
            raise ConfigError(f"save_steps must be an integer >= 1 or a float in (0, 1), got {save_steps!r}")
        self.output_dir = Path(output_dir)
        self.save_total_limit = save_total_limit
        self.best_metric_key = best_metric_key
        self.save_strategy = strategy
        self.save_steps = save_steps
        self.only_best_at_end = only_best_at_end and save_total_limit == 1
        self.save_only_model = save_only_model
        self.last_metric: float | None = None
        self.last_saved: Path | None = None
        self._written: list[Path] = []  # checkpoints this run wrote, oldest first (rotation order)

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.SAVE, self.save)
        if self.only_best_at_end:
            # after LoadBestModelAtEnd (FIRST) has read the best checkpoint
            self.on(engine, Event.TRAIN_END, self._keep_only_best, priority=Priority.LAST)
        if self.save_strategy == "steps":
            self.on(engine, Event.STEP_END, self._step_end, priority=Priority.DEFAULT)
        elif self.save_strategy == "epoch":
            self.on(engine, Event.EPOCH_END, self._epoch_end, priority=Priority.DEFAULT)
        if self.best_metric_key is not None or self.save_strategy == "best":
            # after BestMetric (which updates state.best_global_step at a higher priority)
            self.on(engine, Event.EVAL_END, self._eval_end, priority=Priority.CONSUMER)

    def _interval(self, state: State) -> int:
        if isinstance(self.save_steps, float) and self.save_steps < 1:
            return max(1, int(-(-state.max_steps * self.save_steps // 1)))  # ceil, as HF
        return int(self.save_steps)

    def _step_end(self, payload: StepEndEvent) -> None:
        state = payload.engine.state
        if state.global_step % self._interval(state) == 0 or state.global_step >= state.max_steps:
            payload.engine.control.should_save = True

    def _epoch_end(self, payload: EpochEndEvent) -> None:
        payload.engine.control.should_save = True

    def _eval_end(self, payload: EvalEndEvent) -> None:
        engine = payload.engine
        key = self.best_metric_key
        if key is not None:
            value = payload.metrics.get(key, payload.metrics.get(f"{payload.prefix}_{key}"))
            if isinstance(value, int | float) or (isinstance(value, torch.Tensor) and value.numel() == 1):
                self.last_metric = float(value)  # once per evaluation, not per step
        if self.save_strategy == "best" and engine.state.best_global_step == engine.state.global_step:
            engine.control.should_save = True

    def _keep_only_best(self, payload: TrainEndEvent) -> None:
        """HF: with ``save_total_limit=1`` a finished run keeps only the best checkpoint, not also the newest."""
        best = payload.engine.state.best_model_checkpoint
        if best is None or rank() != 0 or not payload.engine.state.is_world_process_zero:
            return
        for _, path in list_checkpoints(self.output_dir):
            if not _same(best, path):
                logger.info("deleting %s: save_total_limit=1 keeps only the best checkpoint", path)
                _delete(path)

    def save(self, payload: SaveEvent) -> None:
        """The SAVE handler: write the checkpoint (main process only; every rank its slices under FSDP) and rotate."""
        engine = payload.engine
        rng_states = gather_to_main(cio.rng_state())  # every rank's, on rank 0 (a collective: all ranks call it)
        final = self.output_dir / f"{PREFIX}{engine.state.global_step}"
        main = rank() == 0 and engine.state.is_world_process_zero
        info: dict[str, Any] = {}
        if self.best_metric_key is not None:
            info["metric"] = {"key": self.best_metric_key, "value": self.last_metric}
        try:
            if saved_by_every_rank(engine.model):  # FSDP / DeepSpeed: every rank writes its own part
                save_sharded_checkpoint(
                    engine, self.output_dir, info=info, rng_states=rng_states, model_only=self.save_only_model
                )
            elif main:
                save_checkpoint(
                    engine, self.output_dir, info=info, rng_states=rng_states, model_only=self.save_only_model
                )
            if main:
                self._written = [path for path in self._written if path != final] + [final]
                rotate_checkpoints(
                    self.output_dir, self.save_total_limit, engine.state.best_model_checkpoint, self._written
                )
            elif engine.state.best_global_step == engine.state.global_step and not saved_by_every_rank(engine.model):
                engine.state.best_model_checkpoint = str(final)  # as rank 0 records it
        finally:
            barrier()  # no rank reads (resume, best model) before the checkpoint is complete
        self.last_saved = final


class LoadBestModelAtEnd(Plugin):
    """At TRAIN_END, loads the weights of ``state.best_model_checkpoint`` into the model (K5).

    Runs first at TRAIN_END so that later handlers (a final save_model) see the best weights.
    Without a best checkpoint (no evaluation, or the best step was not saved) it warns and keeps
    the last weights, as HF does.
    """

    priority = Priority.FIRST

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_END, self.load)

    def load(self, payload: Payload) -> None:
        engine = payload.engine
        best = engine.state.best_model_checkpoint
        if best is None:
            logger.warning("load_best_model_at_end: no best checkpoint was recorded; keeping the last weights")
            return
        directory = Path(best)
        if SHARDED in verified.read_manifest(directory, verify=False):  # FSDP: every rank loads its own slices
            load_model_shards(engine.model, directory)
            logger.info("loaded the best model from %s (step %s)", best, engine.state.best_global_step)
            return
        manifest = verified.read_manifest(directory, verify=True)
        weights = directory / "model.safetensors"
        frozen = check_base(engine.model, manifest.get("frozen_base"), str(directory))
        cio.load_weights(engine.model, cio.read_tensors(weights), str(weights), may_lack=frozen)
        logger.info("loaded the best model from %s (step %s)", best, engine.state.best_global_step)
