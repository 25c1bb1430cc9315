"""Reading a checkpoint into an engine: verify its files, decode them, apply them (``resuming.py`` chooses which).

``read_checkpoint`` reads and checks everything before ``apply_checkpoint`` changes anything, and
``apply_checkpoint`` checks what fits before it applies (putting back what it applied if a later part
fails), so a damaged or unfitting checkpoint leaves the engine as it was.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import ConfigError, Engine, State

from ..distributed.processes import rank, world_size
from ..optimization.optimizer_fit import check_optimizer_fits
from . import io as cio
from . import verified
from .frozen import check_base
from .history import OWN_STATE, join_state, read_log_history, untag
from .model_part import weights_file
from .restored import check_rng_states, check_state_fields, trusted_best
from .safety import DamagedCheckpoint, damaged
from .sharded import SHARDED, load_shards, world_size_error
from .weights import check_weights

logger = logging.getLogger("trainbus.checkpoint")


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
            f"checkpoint {directory} was saved with save_only_model=True (Checkpointing's): it holds the model but "
            "no optimizer, scheduler or RNG state, so training cannot resume from it; load its weights "
            "(load_model_weights), or save with save_only_model=False to get resumable checkpoints"
        )
    written_by = manifest.get("world_size", 1)
    if written_by != world_size():
        raise ConfigError(
            world_size_error(directory, written_by)
            if SHARDED in manifest
            else f"checkpoint {directory} was written by {written_by} process(es) but this run has {world_size()}: "
            f"resume it with {written_by} (each rank's RNG states and data share depend on it)"
        )


def read_checkpoint(path: str | Path, *, verify: bool = True, model: torch.nn.Module | None = None) -> Loaded:
    """Read and check (``verify``) every file this rank needs; DamagedCheckpoint naming what failed.

    Of a sharded checkpoint the shared files are read here and each rank's slices when it is applied.
    With ``model``, weights saved with a dtype that is not the model's (int32 bytes over float32, same
    shapes) are damage too (``weights.check_dtypes``): a resume of True falls back to the checkpoint before.
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
        check_rng_states(rng, directory / f"{stem}.json")
        weights = optimizer = None
        if not sharded:
            weights = files.tensors(weights_file(manifest, directory / cio.MANIFEST))
            if model is not None:
                check_weights(model, weights, str(directory / weights_file(manifest, directory / cio.MANIFEST)))
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


def read_trainer_state(path: str | Path) -> State:
    """A checkpoint's State with its whole log history (the segments of a long one joined), each file checked."""
    directory = Path(path)
    manifest = verified.read_manifest(directory, verify=False)
    files = verified.CheckedFiles(directory, manifest, verify=True)
    try:
        state = _trainer_state(files, manifest)
        files.finish()
    finally:
        files.close()
    return state


def _trainer_state(files: verified.CheckedFiles, manifest: dict[str, Any]) -> State:
    path = files.directory / "trainer_state.json"
    own_path = None
    data = files.read_bytes(path.name)  # a missing or damaged file: its ConfigError names it
    value = cio.parse_json(data, path)  # parsed once, bounded in size, parse memory and depth (safety.py)
    try:
        if not isinstance(value, dict):
            raise TypeError(f"it holds {type(value).__name__}, not an object")
        value = untag(value) if b'"__float__"' in data else value  # as State.from_json
        if OWN_STATE in files.files:  # the engine's own fields (a checkpoint before the split has them in value)
            own_path = files.directory / OWN_STATE
            value = join_state(value, cio.parse_json(files.read_bytes(OWN_STATE), own_path), own_path)
        state = State.from_dict(value)
    except Exception as exc:
        raise DamagedCheckpoint(f"checkpoint file {path} is not a valid trainer state: {exc}") from exc
    check_state_fields(vars(state), path, manifest, own_path)  # types, ranges, agreement (restored.py)
    # the best checkpoint by its name, next to this one: never a path the state names (restored.py)
    best, forgotten = trusted_best(state.best_model_checkpoint, files.directory, state.global_step)
    state.best_model_checkpoint = best
    if forgotten is not None:
        logger.warning("%s: %s", path, forgotten)
        warnings.warn(f"checkpoint file {path}: {forgotten}", stacklevel=4)
    older = read_log_history(files, manifest)  # the segments of a long history (history.py)
    if older:
        state.log_history = older + state.log_history
    return state


def apply_checkpoint(engine: Engine, loaded: Loaded, *, verify: bool = True) -> dict[str, Any]:
    """Put what ``read_checkpoint`` read into ``engine``; returns the RNG states (not applied).

    Refused means untouched: what can be checked without applying is checked first (every plugin it holds a
    state for is attached; the optimizer is of its class, with its groups' sizes), then the optimizer state,
    the trainer state and the plugins' states are applied, the weights last (their names, shapes and dtypes are
    checked before a tensor is copied: ``weights.load_weights``). If anything fails on the way, the optimizer,
    the state and the plugins are put back as they were. ``verify``: check this rank's slices of a sharded
    checkpoint as they are read.
    """
    if engine.optimizer is None:
        raise ConfigError("resuming needs engine.optimizer: pass it to the Engine or attach the optimizer plugin first")
    directory = loaded.path
    check_fits(engine, loaded)
    undo = _Undo(engine, loaded.plugins)
    try:
        if not loaded.sharded:
            try:
                engine.optimizer.load_state_dict(loaded.optimizer)
            except (ValueError, KeyError, RuntimeError, IndexError, TypeError) as exc:
                raise ConfigError(f"{directory / 'optimizer.json'} does not fit engine.optimizer: {exc}") from exc
        state = loaded.state
        # the fields as they are: State.to_dict() deep-copies them (the log history grows with the run)
        fields = {field.name: getattr(state, field.name) for field in dataclasses.fields(state)}
        engine.load_state_dict({"state": fields, "plugins": loaded.plugins})
        _apply_weights(engine, loaded, verify)
    except BaseException:
        undo.restore(engine)
        raise
    return loaded.rng


def check_fits(engine: Engine, loaded: Loaded) -> None:
    """Refuse (ConfigError) a checkpoint this engine cannot take, before anything of it is applied: a plugin state
    for a plugin that is not attached, an optimizer state of another class or other param groups."""
    assert engine.optimizer is not None
    names = {p.name for p in engine.plugins}
    missing = [name for name in loaded.plugins if name not in names]
    if missing:
        raise ConfigError(
            f"checkpoint {loaded.path} holds the states of plugins {missing} that this engine lacks (attached: "
            f"{sorted(names)}); nothing was applied. Attach them (built as in the run that saved it) and resume again"
        )
    if loaded.sharded:
        return
    where = loaded.path / "optimizer.json"
    check_optimizer_fits(engine.optimizer, loaded.optimizer, loaded.path)  # SGD from AdamW: say so, not KeyError
    saved = loaded.optimizer.get("param_groups")
    if not isinstance(saved, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved):
        return  # an optimizer of its own kind (a layer-wise wrapper): its load_state_dict decides, before the weights
    own = [len(group["params"]) for group in engine.optimizer.param_groups]
    if [len(group["params"]) for group in saved] != own:
        raise ConfigError(
            f"{where} does not fit engine.optimizer: parameters per group {[len(g['params']) for g in saved]} "
            f"saved, {own} in this optimizer (another model, or other parameter groups); nothing was applied"
        )


def _apply_weights(engine: Engine, loaded: Loaded, verify: bool) -> None:
    directory = loaded.path
    if loaded.sharded:
        load_shards(engine, directory, verify=verify)
        return
    if loaded.weights is None:
        return
    weights = loaded.weights

    def apply_weights() -> Any:
        where = str(directory / weights_file(loaded.manifest, directory / cio.MANIFEST))
        frozen = check_base(engine.model, loaded.manifest.get("frozen_base"), str(directory))
        return cio.load_weights(engine.model, weights, where, may_lack=frozen)

    # the facade: a subclass's _load_from_checkpoint runs, its super() applying the verified weights
    around = getattr(engine, "around_checkpoint_weights", None)
    around(directory, apply_weights) if callable(around) else apply_weights()
    loaded.weights = weights = None  # views of the mapped file: unmapped now (a frame kept alive keeps no view)


class _Undo:
    """What ``apply_checkpoint`` changes before the weights, kept to be put back if a later part fails: the
    optimizer's state (its tensors, by reference), the engine's State object and the states of the plugins the
    checkpoint holds states for (with the Checkpointing plugin's claim on output_dir, which a load marks)."""

    def __init__(self, engine: Engine, plugins: Any) -> None:
        assert engine.optimizer is not None
        self.optimizer = engine.optimizer.state_dict()
        self.state = engine.state
        self.plugins = {p.name: p.state_dict() for p in engine.plugins if p.name in plugins}
        claims = [getattr(p, "claim", None) for p in engine.plugins]
        self.claims = [(c, c.loaded, c.wrote) for c in claims if hasattr(c, "loaded") and hasattr(c, "wrote")]

    def restore(self, engine: Engine) -> None:
        assert engine.optimizer is not None
        try:
            engine.optimizer.load_state_dict(self.optimizer)
            engine.state = self.state
            for name, state in self.plugins.items():
                engine.get_plugin(name).load_state_dict(state)
            for claim, was_loaded, wrote in self.claims:
                claim.loaded, claim.wrote = was_loaded, wrote
        except Exception as exc:  # the refusal is what the caller needs to see; this is logged
            logger.warning("could not put the engine back as it was before a refused checkpoint: %s", exc)


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
