"""Reading a checkpoint back: choose it, read all of it, then apply it; damage is never half applied.

A load has two phases. ``read_checkpoint`` reads and checks every file against the manifest and
parses it into values (the trainer state, the plugins' states, the RNG states, the weights, the
optimizer state): any exception there, whatever its type, makes the checkpoint *damaged*
(``safety.DamagedCheckpoint``, naming the file). ``apply_checkpoint`` then puts the values into the
engine; its errors say the checkpoint does not fit this run (another model, another optimizer),
which an older checkpoint would not mend, so they are not damage. ``resume_from_checkpoint=True``
reads the checkpoints newest first and takes the first that reads, warning about each damaged one
it skips (a missing manifest too); an explicit path fails with the damage's error.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainbus.engine import ConfigError, Engine, Event, Priority, State
from trainbus.engine.events import EpochStartEvent, Payload

from ..distributed.processes import broadcast_from_main, rank, world_size
from ..optimization.optimizer_fit import check_optimizer_fits
from . import io as cio
from . import verified
from .directory import checkpoint_dirs, latest_checkpoint, tidy
from .frozen import check_base
from .history import read_log_history
from .safety import DamagedCheckpoint, damaged, real_directory
from .sharded import SHARDED, load_shards, world_size_error
from .zero import model_file

logger = logging.getLogger("trainbus.checkpoint")

__all__ = [
    "Loaded",
    "apply_checkpoint",
    "check_best_checkpoint",
    "chosen_by_main",
    "load_checkpoint",
    "read_checkpoint",
    "resolve_checkpoint",
    "resume",
    "resume_after_restart",
    "resumed_batch_size",
    "rng_file_stems",
]


def rng_file_stems(processes: int) -> list[str]:
    """The RNG bundles of a checkpoint written by ``processes`` processes: ``rng``, or ``rng-{rank}`` each."""
    return ["rng"] if processes == 1 else [f"rng-{r}" for r in range(processes)]


@dataclasses.dataclass
class Loaded:
    """Everything a checkpoint holds for this rank, read and checked, not yet applied."""

    path: Path
    manifest: dict[str, Any]
    state: State
    plugins: Any
    rng: dict[str, Any]
    weights: dict[str, Any] | None  # None for a sharded checkpoint: every rank reads its slices when applying
    optimizer: Any
    sharded: bool


def _check_resumable(directory: Path, manifest: dict[str, Any]) -> None:
    """A sound checkpoint that this run cannot resume from: a ConfigError, not damage."""
    if manifest.get("model_only"):
        raise ConfigError(
            f"checkpoint {directory} was saved with save_only_model=True: it holds the model but no optimizer, "
            "scheduler or RNG state, so training cannot resume from it; load its model.safetensors as weights, "
            "or train with save_only_model=False to get resumable checkpoints"
        )
    written_by = manifest.get("world_size", 1)
    if written_by != world_size():
        raise ConfigError(
            world_size_error(directory, written_by)
            if SHARDED in manifest
            else f"checkpoint {directory} was written by {written_by} process(es) but this run has {world_size()}: "
            f"resume it with {written_by} (each rank's RNG states and data share depend on it)"
        )


def read_checkpoint(path: str | Path, *, verify: bool = True) -> Loaded:
    """Read and check (``verify``) every file this rank needs; DamagedCheckpoint naming what failed.

    Of a sharded checkpoint the shared files are read here and each rank's slices when it is applied.
    """
    directory = Path(path)
    manifest = verified.read_manifest(directory, verify=False)  # DamagedCheckpoint whatever fails
    if not isinstance(manifest.get("world_size", 1), int):
        raise DamagedCheckpoint(f"{directory / cio.MANIFEST}: world_size is not an integer")
    _check_resumable(directory, manifest)
    sharded = SHARDED in manifest
    files = verified.CheckedFiles(directory, manifest, verify=verify)
    try:
        state = _trainer_state(files, manifest)  # the small files first: a damaged one fails before the large
        plugins = files.bundle("plugins")
        if not isinstance(plugins, dict):
            raise DamagedCheckpoint(f"checkpoint file {directory / 'plugins.json'} does not hold a dict of states")
        stem = rng_file_stems(manifest.get("world_size", 1))[rank()]
        rng = files.bundle(stem)
        if not isinstance(rng, dict) or "python" not in rng or "torch" not in rng:
            raise DamagedCheckpoint(f"checkpoint file {directory / (stem + '.json')} lacks the python/torch RNG states")
        weights = optimizer = None
        if not sharded:
            weights = files.tensors("model.safetensors")
            optimizer = files.bundle("optimizer")
            if not isinstance(optimizer, dict):
                raise DamagedCheckpoint(f"checkpoint file {directory / 'optimizer.json'} does not hold a state dict")
            files.finish()  # every other rank's RNG states too: the checkpoint is whole, or nothing is applied
        else:
            files.settle()  # the shared files' hashes (each rank checks its slices as it reads them)
    except Exception as exc:  # a file of the checkpoint made reading fail: damaged, whatever the error
        raise damaged(directory, exc) from exc
    finally:
        files.close()  # no hash still reads a file of it after a failure
    return Loaded(directory, manifest, state, plugins, rng, weights, optimizer, sharded)


def _trainer_state(files: verified.CheckedFiles, manifest: dict[str, Any]) -> State:
    path = files.directory / "trainer_state.json"
    data = files.read_bytes(path.name)  # a missing or damaged file: its ConfigError names it
    if len(data) > 64 and data.count(b"[") + data.count(b"{") > 64:
        cio.parse_json(data, path)  # bounded in depth before State parses it
    try:
        state = State.from_json(data.decode("utf-8"))
    except Exception as exc:
        raise DamagedCheckpoint(f"checkpoint file {path} is not a valid trainer state: {exc}") from exc
    older = read_log_history(files, manifest)  # the segments of a long history (history.py)
    if older:
        state.log_history = older + state.log_history
    return state


def apply_checkpoint(engine: Engine, loaded: Loaded, *, verify: bool = True) -> dict[str, Any]:
    """Put what ``read_checkpoint`` read into ``engine``; returns the RNG states (not applied).

    ``verify``: check this rank's slices of a sharded checkpoint as they are read.
    """
    if engine.optimizer is None:
        raise ConfigError("resuming needs engine.optimizer: pass it to the Engine or attach the optimizer plugin first")
    directory = loaded.path
    if loaded.sharded:
        load_shards(engine, directory, verify=verify)
    elif loaded.weights is not None:
        where = str(directory / "model.safetensors")
        frozen = check_base(engine.model, loaded.manifest.get("frozen_base"), str(directory))
        cio.load_weights(engine.model, loaded.weights, where, may_lack=frozen)
        loaded.weights = None  # views of the mapped file: unmapped now
        check_optimizer_fits(engine.optimizer, loaded.optimizer, directory)  # SGD from AdamW: say so, not KeyError
        try:
            engine.optimizer.load_state_dict(loaded.optimizer)
        except (ValueError, KeyError, RuntimeError, IndexError, TypeError) as exc:
            raise ConfigError(f"{directory / 'optimizer.json'} does not fit engine.optimizer: {exc}") from exc
    state = loaded.state
    # the fields as they are: State.to_dict() deep-copies them (the log history grows with the run)
    fields = {field.name: getattr(state, field.name) for field in dataclasses.fields(state)}
    engine.load_state_dict({"state": fields, "plugins": loaded.plugins})
    return loaded.rng


def load_checkpoint(engine: Engine, path: str | Path, *, verify: bool = True) -> dict[str, Any]:
    """Verify a checkpoint and restore model, optimizer, state and plugins into ``engine``.

    Returns the RNG states (not applied: ``resume`` applies them where the interrupted run was).
    Reads only JSON and safetensors files listed in the manifest, each checked against it as it is
    read (``verify=False``: the caller has just verified them), and applies nothing before every
    listed file has been checked.
    """
    if engine.optimizer is None:
        raise ConfigError("resuming needs engine.optimizer: pass it to the Engine or attach the optimizer plugin first")
    return apply_checkpoint(engine, read_checkpoint(path, verify=verify), verify=verify)


# -- choosing -------------------------------------------------------------------------------------
def choose_and_read(checkpoint: str | Path | bool, output_dir: str | Path | None) -> Loaded:
    """The checkpoint ``resume_from_checkpoint`` names, read and checked whole (rank 0 runs it).

    True: the newest that reads; each damaged newer one is skipped with a warning naming the file.
    """
    if checkpoint is True:
        if output_dir is None:
            raise ConfigError("resume_from_checkpoint=True needs an output_dir to search (or a Checkpointing plugin)")
        root = Path(output_dir)
        tidy(root)  # an interrupted re-save's copies: one is put back, not lost
        found = checkpoint_dirs(root)
        if not found:
            seen = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
            raise ConfigError(
                f"resume_from_checkpoint=True: no complete checkpoint (checkpoint-N with a valid {cio.MANIFEST}) "
                f"in {root}; found: {seen or 'nothing'}"
            )
        for _, path in reversed(found):
            try:
                loaded = read_checkpoint(path, verify=True)
                if SHARDED in loaded.manifest:  # every rank's slices, so that none fails after the choice
                    verified.read_manifest(path, verify=True)
            except DamagedCheckpoint as exc:
                warnings.warn(
                    f"resume_from_checkpoint=True: skipping the damaged checkpoint {path} ({exc}); "
                    "resuming from the newest intact one before it",
                    stacklevel=3,
                )
                continue
            return loaded
        raise ConfigError(
            f"resume_from_checkpoint=True: every checkpoint in {root} is damaged (see the warnings): no complete "
            f"checkpoint to resume from; found: {sorted(p.name for p in root.iterdir())}"
        )
    return read_checkpoint(_explicit(checkpoint), verify=True)


def _explicit(checkpoint: Any) -> Path:
    if isinstance(checkpoint, bool) or not isinstance(checkpoint, str | os.PathLike):
        raise ConfigError(f"resume_from_checkpoint must be a path or True, got {checkpoint!r}")
    path = Path(checkpoint)
    if not path.is_dir() and not path.is_symlink():
        raise ConfigError(f"resume_from_checkpoint={str(path)!r} is not a directory")
    real_directory(path)
    return path


def resolve_checkpoint(checkpoint: str | Path | bool, output_dir: str | Path | None, *, verify: bool = False) -> Path:
    """A checkpoint path from ``resume_from_checkpoint`` (a path, or True for the latest complete one).

    With ``verify``, the checkpoint is read whole and checked (True: the newest that reads).
    """
    if verify:
        return choose_and_read(checkpoint, output_dir).path
    if checkpoint is True:
        latest = latest_checkpoint(output_dir) if output_dir is not None else None
        if latest is None:
            return choose_and_read(checkpoint, output_dir).path  # its error
        return latest
    return _explicit(checkpoint)


def chosen_by_main(choose: Callable[[], Any]) -> Path:
    """``choose()`` run on rank 0 and its result (or its ConfigError) on every rank."""
    outcome: tuple[str, str] = ("", "")
    if rank() == 0:
        try:
            outcome = ("path", str(choose()))
        except ConfigError as exc:
            outcome = ("damaged" if isinstance(exc, DamagedCheckpoint) else "error", str(exc))
    kind, value = broadcast_from_main(outcome)
    if kind != "path":
        raise (DamagedCheckpoint if kind == "damaged" else ConfigError)(value)
    return Path(value)


# -- resume ---------------------------------------------------------------------------------------
def resume(engine: Engine, checkpoint: str | Path | bool, output_dir: str | Path | None = None) -> Path:
    """Restore a checkpoint into ``engine`` so that ``engine.fit()`` continues the run bit for bit.

    Args:
        engine: a fresh engine built like the interrupted one (same plugins, optimizer, data).
        checkpoint: a checkpoint directory, or True for the newest intact one in ``output_dir``.
        output_dir: where to look for True; defaults to the attached Checkpointing plugin's.

    RNG states are applied now and again just before the interrupted run's next random draw:
    at the first STEP_START (mid-epoch), or at the next fresh EPOCH_START. Creating the resumed
    epoch's data iterator (a DataLoader draws a seed) would otherwise shift every later draw.
    With a LoadBestModelAtEnd plugin the best checkpoint the run will load at its end is checked now.
    """
    if checkpoint is True and output_dir is None:
        output_dir = getattr(_attached(engine, "Checkpointing"), "output_dir", None)
    if engine.optimizer is None:
        raise ConfigError("resuming needs engine.optimizer: pass it to the Engine or attach the optimizer plugin first")
    chosen: list[Loaded] = []

    def choose() -> Path:
        chosen.append(choose_and_read(checkpoint, output_dir))
        return chosen[0].path

    path = chosen_by_main(choose)
    # rank 0 read and checked it whole; the other ranks read their part (their slices checked as read)
    loaded = chosen[0] if chosen else read_checkpoint(path, verify=False)
    rng = apply_checkpoint(engine, loaded, verify=checkpoint is not True)
    if _attached(engine, "LoadBestModelAtEnd") is not None:
        check_best_checkpoint(engine)
    cio.set_rng_state(rng)
    _RestoreRng(engine, rng)
    logger.info("resumed from %s at global step %d", path, engine.state.global_step)
    return path


def _attached(engine: Engine, name: str) -> Any:
    """The plugin of that class name (checkpoint.py's plugins, which this module sits below), or None."""
    return next((p for p in engine.plugins if any(c.__name__ == name for c in type(p).__mro__)), None)


def check_best_checkpoint(engine: Engine) -> None:
    """The best checkpoint a run will load at its end, checked now (rank 0 decides for every rank).

    A damaged or missing one is forgotten with a warning: the run keeps its own weights at the end
    (or a better checkpoint it saves later), instead of failing at the end, and at every resume after.
    """
    best = engine.state.best_model_checkpoint
    if best is None:
        return
    problem = None
    if rank() == 0:
        try:
            verify_best_weights(Path(best))
        except DamagedCheckpoint as exc:
            problem = str(exc)
    problem = broadcast_from_main(problem)
    if problem is not None:
        warnings.warn(
            f"load_best_model_at_end: the best checkpoint {best} is damaged ({problem}); the run will keep its "
            "own weights at the end unless it saves a new best",
            stacklevel=3,
        )
        engine.state.best_model_checkpoint = None


def verify_best_weights(directory: Path) -> dict[str, Any]:
    """Check the files a best-model load reads (the weights, or every rank's slices); returns the manifest."""
    manifest = verified.read_manifest(directory, verify=False)
    try:
        if SHARDED in manifest:
            names = [name for name in manifest["files"] if name.startswith(("model-", "shards", "zero-"))]
            names = names or [model_file(0)]
        else:
            names = ["model.safetensors"]
        verified.verify_listed(directory, manifest, names)
    except Exception as exc:
        raise damaged(directory, exc) from exc
    return manifest


def resume_after_restart(checkpoint: str | Path | bool | None, output_dir: str | Path | None) -> Any:
    """``resume_from_checkpoint`` for ``train()``: True in a worker torchrun restarted, when its launch wrote the
    newest checkpoint in ``output_dir``; else ``checkpoint`` as given.

    Under ``torchrun --max-restarts N`` a failed worker group is started again with the same command:
    without this each restart would be a fresh run refused by the checkpoints its first attempt wrote
    (``lock.check_fresh_run``). Only an unset ``resume_from_checkpoint`` (None) is decided here, only
    from the second attempt on (``TORCHELASTIC_RESTART_COUNT`` > 0), and only when the newest
    checkpoint's manifest names this launch (``io.torchelastic_run``): another run's checkpoints
    are still refused, never resumed. Rank 0 decides for every rank.
    """
    restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if checkpoint is not None or output_dir is None or not restarts.isdigit() or int(restarts) == 0:
        return checkpoint
    latest = None
    if rank() == 0:
        newest = latest_checkpoint(output_dir)
        try:
            manifest = verified.read_manifest(newest, verify=False) if newest is not None else {}
        except DamagedCheckpoint:
            manifest = {}
        if manifest.get("torchelastic_run") == cio.torchelastic_run():
            latest = str(newest)
    latest = broadcast_from_main(latest)
    if latest is None:
        return checkpoint
    logger.warning("torchrun restart %s: resuming from this launch's newest checkpoint, %s", restarts, latest)
    return True


def resumed_batch_size(checkpoint: str | Path | bool, output_dir: str | None) -> tuple[Path, int | None]:
    """The checkpoint that ``resume_from_checkpoint`` names and the per-device train batch size it trained with.

    True means the newest intact checkpoint in ``output_dir``, chosen on the main process as a resume
    chooses it. The size is the checkpoint's ``state.train_batch_size`` (None when it records none),
    which transformers' ``train()`` starts from under ``auto_find_batch_size``.
    """
    sizes: list[Any] = []

    def choose() -> Path:
        loaded = choose_and_read(checkpoint, output_dir)
        sizes.append(loaded.state.train_batch_size)
        return loaded.path

    path = chosen_by_main(choose)
    size = broadcast_from_main(sizes[0] if sizes else None)
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ConfigError(
            f"checkpoint file {path / 'trainer_state.json'}: train_batch_size must be an integer >= 1 or null, "
            f"got {size!r}"
        )
    return path, size


class _RestoreRng:
    """One-shot handlers re-applying RNG states where the uninterrupted run continued."""

    def __init__(self, engine: Engine, rng: dict[str, Any]) -> None:
        self.rng = rng
        first = Priority.FIRST.before("*")  # before every plugin, as the uninterrupted run had no extra draws
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
