"""Reading a checkpoint back: choose it, read all of it, then apply it; damage is never half applied.

A load has two phases. ``read_checkpoint`` reads and checks every file against the manifest and
parses it into values (the trainer state, the plugins' states, the RNG states, the weights, the
optimizer state): any exception there, whatever its type, makes the checkpoint *damaged*
(``safety.DamagedCheckpoint``, naming the file). ``apply_checkpoint`` then puts the values into the
engine; its errors say the checkpoint does not fit this run (another model, another optimizer),
which an older checkpoint would not mend, so they are not damage. ``resume_from_checkpoint=True``
reads the checkpoints newest first and takes the first that reads, warning about each damaged one
it skips (a missing manifest too); an explicit path fails with the damage's error. The two phases
are ``reading.py``; this module chooses the checkpoint and resumes from it.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import ConfigError, Engine, Event, Priority
from trainbus.engine.events import EpochStartEvent, Payload

from ..data.loading import ensure_resumable_data, find_resumable_data
from ..distributed.processes import broadcast_from_main, rank
from . import io as cio
from . import verified
from .directory import PREVIOUS_RUNS, checkpoint_dirs, latest_checkpoint, previous_runs
from .lineage import UNSET, RunClaim
from .lock import tidy_under_lock
from .model_part import weights_file
from .reading import Loaded, apply_checkpoint, load_checkpoint, read_checkpoint, rng_file_stems
from .safety import DamagedCheckpoint, damaged, real_directory
from .sharded import SHARDED
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


# -- choosing -------------------------------------------------------------------------------------
def choose_and_read(
    checkpoint: str | Path | bool, output_dir: str | Path | None, model: torch.nn.Module | None = None
) -> Loaded:
    """The checkpoint ``resume_from_checkpoint`` names, read and checked whole (rank 0 runs it).

    True: the newest that reads among the ``checkpoint-N`` directly in ``output_dir`` (the run's own:
    an earlier run's, set aside in ``previous-runs`` by a fresh run, are never taken; ``lock.py``);
    each damaged newer one is skipped with a warning naming the file (with ``model``: weights of a dtype
    that is not the model's are damage too).
    """
    if checkpoint is True:
        if output_dir is None:
            raise ConfigError(
                "resuming from True (the newest checkpoint) needs an output_dir to search: resume(engine, True, "
                "output_dir=...) or an attached Checkpointing (the Trainer: its args.output_dir)"
            )
        root = Path(output_dir)
        # under output_dir's lock only (taken if free): a set-aside a killed fresh run left half done is finished
        # (that run stays aside), an interrupted re-save's copy put back; a running run's saves are never touched
        tidy_under_lock(root)
        found = checkpoint_dirs(root)  # this run's: never an earlier run's set aside in previous-runs
        if not found:
            seen = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
            raise ConfigError(  # opening with transformers' words (scripts and its tests look for them)
                f"No valid checkpoint found in output directory ({root}): resuming from True: no complete "
                f"checkpoint (checkpoint-N with a valid {cio.MANIFEST}) in {root}; found: {seen or 'nothing'}"
                f"{_set_aside_hint(root)}"
            )
        for _, path in reversed(found):
            try:
                loaded = read_checkpoint(path, verify=True, model=model)
                if SHARDED in loaded.manifest:  # every rank's slices, so that none fails after the choice
                    verified.read_manifest(path, verify=True)
            except DamagedCheckpoint as exc:
                warnings.warn(
                    f"resuming from True: skipping the damaged checkpoint {path} ({exc}); "
                    "resuming from the newest intact one before it",
                    stacklevel=3,
                )
                continue
            return loaded
        raise ConfigError(
            f"resuming from True: every checkpoint in {root} is damaged (see the warnings): no complete "
            f"checkpoint to resume from; found: {sorted(p.name for p in root.iterdir())}"
        )
    return read_checkpoint(_explicit(checkpoint), verify=True, model=model)


def _set_aside_hint(root: Path) -> str:
    folders = previous_runs(root)
    if not folders:
        return ""
    return (
        f". Earlier runs' checkpoints, set aside when a fresh run started here, are in {root / PREVIOUS_RUNS} "
        f"({', '.join(f.name for f in folders)}): they belong to another run, so True never resumes them; "
        "pass one's path to resume it"
    )


def _explicit(checkpoint: Any) -> Path:
    if isinstance(checkpoint, bool) or not isinstance(checkpoint, str | os.PathLike):
        raise ConfigError(f"resume_from_checkpoint must be a path or True, got {checkpoint!r}")
    path = Path(checkpoint)
    if not path.is_dir() and not path.is_symlink():
        raise ConfigError(
            f"Can't find a valid checkpoint at {path}: resume_from_checkpoint={str(path)!r} is not a directory"
        )
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
        chosen.append(choose_and_read(checkpoint, output_dir, engine.model))
        return chosen[0].path

    ensure_resumable_data(engine)  # the data plugin replays the interrupted epoch's order (data/replay.py)
    path = chosen_by_main(choose)
    # rank 0 read and checked it whole; the other ranks read their part (their slices checked as read)
    loaded = chosen[0] if chosen else read_checkpoint(path, verify=False)
    rng = apply_checkpoint(engine, loaded, verify=checkpoint is not True)
    if checkpoint is not True:
        _tell_checkpointing(engine, path)
    if _attached(engine, "LoadBestModelAtEnd") is not None:
        check_best_checkpoint(engine)
    cio.set_rng_state(rng)
    _RestoreRng(engine, rng, _replay_through_data(engine, rng))
    logger.info("resumed from %s at global step %d", path, engine.state.global_step)
    return path


def _tell_checkpointing(engine: Engine, path: Path) -> None:
    """Tell the Checkpointing plugin where this resume read (unless a caller told it already: the Trainer's
    ``claim_run``), so that its TRAIN_START applies the lineage rule to the path (``lineage.py``)."""
    for plugin in engine.plugins:
        claim = getattr(plugin, "claim", None)
        if isinstance(claim, RunClaim) and claim.expected is UNSET:
            claim.expect(str(path))


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
            f"LoadBestModelAtEnd: the best checkpoint {best} is damaged ({problem}); the run will keep its "
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
            names = [weights_file(manifest, directory / cio.MANIFEST)]
        verified.verify_listed(directory, manifest, names)
    except Exception as exc:
        raise damaged(directory, exc) from exc
    return manifest


def resume_after_restart(checkpoint: str | Path | bool | None, output_dir: str | Path | None) -> Any:
    """``resume_from_checkpoint`` for ``train()``: True in a worker torchrun restarted, when its launch wrote the
    newest checkpoint in ``output_dir``; else ``checkpoint`` as given.

    Under ``torchrun --max-restarts N`` a failed worker group is started again with the same command:
    without this each restart would be a fresh run, setting aside the checkpoints its first attempt
    wrote and starting over (``lock.start_fresh``). Only an unset ``resume_from_checkpoint`` (None)
    is decided here, only from the second attempt on (``TORCHELASTIC_RESTART_COUNT`` > 0), and only
    when the newest checkpoint's manifest names this launch (``io.torchelastic_run``): another
    launch's checkpoints are never resumed (that restart is a fresh run, which sets them aside:
    ``lock.py``). Rank 0 decides for every rank.
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


def _replay_through_data(engine: Engine, rng: dict[str, Any]) -> Any:
    """A mid-epoch resume: the data plugin draws the resumed epoch's order again from the states of the epoch's
    start (``epoch_start``: ``data/replay.py``), then sets the checkpoint's states right before the epoch's
    first fetches (the batch that was in flight first, made from its own states), so the order, batches drawn
    in this process (random masks, crops) and every draw after them (dropout) are the uninterrupted run's.
    ``evaluated`` tells the data plugin whether a persistent eval pool existed. Returns its token, or None."""
    in_flight, epoch_start = rng.pop("in_flight", None), rng.pop("epoch_start", None)
    engine.rng_evaluated = bool(rng.pop("evaluated", False))  # type: ignore[attr-defined]  # ResumableData
    data = find_resumable_data(engine)
    if data is None or engine.state.batches_in_epoch == 0 or getattr(data, "ignore_data_skip", False):
        return None
    states = [rng] if in_flight is None else [in_flight, rng]
    return data.replay_rng(states, epoch_start)


class _RestoreRng:
    """One-shot handlers re-applying RNG states where the uninterrupted run continued (unless the data plugin
    replayed them at the resumed epoch's first fetches: ``replay.used``)."""

    def __init__(self, engine: Engine, rng: dict[str, Any], replay: Any = None) -> None:
        self.rng = rng
        self.replay = replay
        first = Priority.FIRST.before("*")  # before every plugin, as the uninterrupted run had no extra draws
        self.handles = [
            engine.on(Event.STEP_START, self._restore, priority=first, name="resume.restore_rng"),
            engine.on(Event.EPOCH_START, self._epoch_start, priority=first, name="resume.restore_rng"),
        ]

    def _epoch_start(self, ev: EpochStartEvent) -> None:
        if ev.engine.state.batches_in_epoch == 0:
            self._restore(ev)

    def _restore(self, ev: Payload) -> None:
        if self.replay is None or not self.replay.used:
            cio.set_rng_state(self.rng)
        for handle in self.handles:
            handle.remove()
