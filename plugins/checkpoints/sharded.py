"""Checkpoints of FSDP runs: every rank writes its own shard, and no rank gathers the model.

An FSDP2 model's parameters and its optimizer's states are DTensors; each rank holds a slice. A
checkpoint of such a run keeps the usual layout (``checkpoint.py``) with per-rank tensor files:

- ``model-rank{r}.safetensors``: rank r's local slices (``DTensor.to_local()``); rank 0's file also
  holds the tensors that are not sharded (buffers);
- ``optimizer-rank{r}.json`` + ``.safetensors``: rank r's ``optimizer.state_dict()`` with its
  DTensor states as local slices, and which states they were;
- ``shards.json``: the JSON index: every tensor's global shape and dtype, and for each rank the
  offsets and sizes of its slice (so the slices can be put together without torch's pickled
  distributed-checkpoint metadata);
- plugins, RNG states (one bundle per rank), ``trainer_state.json``: written by rank 0, as always;
- ``manifest.json`` last, by rank 0: every rank hashes its own files as it writes them and rank 0
  lists them all.

All ranks write into one temporary directory, which rank 0 renames once every rank is done.
Resuming needs the same number of processes (each rank reads back its own slices, RNG states and
data share); ``consolidate_checkpoint`` puts the slices of a checkpoint together in one process
into a single ``model.safetensors``, a model that starts a run at any number of processes.
``save_full_model`` is ``save_model`` for a sharded model: every rank takes part in gathering the
full weights to the CPU of rank 0, which writes one safetensors file.

A DeepSpeed (ZeRO) run is saved the same way, with its own rank files (``zero.py``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from trainbus.engine import ConfigError, Engine

from ..distributed.deepspeed import deepspeed_engine_of
from ..distributed.fsdp import is_sharded
from ..distributed.processes import broadcast_from_main, gather_to_main, rank, world_size
from . import io as cio
from . import verified
from .directory import publish_directory
from .history import write_trainer_state
from .zero import is_zero_layout, load_zero, model_file, write_zero_files, zero_full_state, zero_world_size_error

#: the manifest key that marks a checkpoint written in shards (its value: the sharding's name)
SHARDED = "sharded"
INDEX = "shards.json"
INDEX_FORMAT = "trainbus-shards"

__all__ = [
    "INDEX",
    "SHARDED",
    "consolidate_checkpoint",
    "load_model_shards",
    "load_shards",
    "rank_files",
    "save_full_model",
    "save_sharded_checkpoint",
    "saved_by_every_rank",
]


def saved_by_every_rank(model: torch.nn.Module) -> bool:
    """Whether ``model``'s checkpoints are written by every rank: FSDP-sharded, or run by DeepSpeed."""
    return is_sharded(model) or deepspeed_engine_of(model) is not None


def optimizer_stem(r: int) -> str:
    return f"optimizer-rank{r}"


def rank_files(r: int) -> list[str]:
    """The files rank ``r`` writes into an FSDP checkpoint."""
    return [model_file(r), f"{optimizer_stem(r)}.safetensors", f"{optimizer_stem(r)}.json"]


# -- the local slices -----------------------------------------------------------------------------
def _is_dtensor(value: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _reshard(model: torch.nn.Module) -> None:
    """Put every FSDP unit back in its sharded state (a forward without backward can leave the root gathered)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _slice_of(name: str, tensor: Any) -> dict[str, Any]:
    chunks = tensor.__create_chunk_list__()  # the layout torch's distributed checkpoint records
    if len(chunks) != 1:
        raise ConfigError(f"{name}: a DTensor with {len(chunks)} local chunks on one rank is not supported")
    return {"offsets": list(chunks[0].offsets), "sizes": list(chunks[0].sizes)}


def _local_model_state(model: torch.nn.Module, r: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This rank's tensors to write, and its part of the index."""
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, Any] = {}
    for name, value in model.state_dict().items():
        entry: dict[str, Any] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
        if _is_dtensor(value):
            tensors[name] = value.to_local()
            entry["slice"] = _slice_of(name, value)
        elif r == 0:  # not sharded: the same on every rank, written once
            tensors[name] = value
        entries[name] = entry
    return tensors, entries


def _local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with its DTensor states as local slices, and which states they were."""
    sharded: list[list[Any]] = []

    def to_local(_: Any, state_dict: dict[str, Any]) -> None:
        # first among the post hooks: the others (optimizers.py) see plain tensors
        for index, states in state_dict["state"].items():
            state_dict["state"][index] = states = dict(states)  # torch hands out the live per-parameter dicts
            for key, value in states.items():
                if _is_dtensor(value):
                    states[key] = value.to_local()
                    sharded.append([index, key])

    handle = optimizer.register_state_dict_post_hook(to_local, prepend=True)
    try:
        state_dict = optimizer.state_dict()
    finally:
        handle.remove()
    return {"state_dict": state_dict, "dtensors": sharded}


# -- save -----------------------------------------------------------------------------------------
def save_sharded_checkpoint(
    engine: Engine,
    output_dir: str | Path,
    *,
    info: Mapping[str, Any] | None = None,
    rng_states: Sequence[dict[str, Any]] | None = None,
    model_only: bool = False,
) -> Path:
    """Write ``output_dir/checkpoint-{global_step}`` from every rank; every rank must call it.

    ``rng_states`` (rank 0): every rank's RNG states in rank order. ``model_only`` (HF's
    save_only_model): the weights and the trainer state, no optimizer, plugin or RNG states (under
    ZeRO-3 the ZeRO partitions stay: they hold the weights). Returns the checkpoint's path on every
    rank; a failure on any rank leaves no checkpoint and raises on every rank.
    """
    if engine.optimizer is None:
        raise ConfigError("save_checkpoint needs engine.optimizer: a checkpoint without it cannot resume")
    state = engine.state
    root = Path(output_dir)
    final = root / f"checkpoint-{state.global_step}"
    tmp = root / f"{final.name}.tmp-{broadcast_from_main(os.getpid())}"  # one directory for all ranks
    previous_best = state.best_model_checkpoint
    if state.best_global_step is not None and state.best_global_step == state.global_step:
        state.best_model_checkpoint = str(final)
    me = rank()
    outcome = _on_main(lambda: _fresh_directory(tmp))
    written: Any = None
    if outcome is None:
        try:
            _reshard(engine.model)
            written = _write_rank_files(engine, tmp, me, model_only)
        except Exception as exc:  # reported to rank 0, which aborts the save for every rank
            written = f"rank {me}: {type(exc).__name__}: {exc}"
        gathered = gather_to_main(written)
        rngs = [] if model_only else rng_states or []
        listed = {**(info or {}), **({"model_only": True} if model_only else {})}
        outcome = _on_main(lambda: _finish(engine, tmp, final, gathered or [], listed, rngs, plugins=not model_only))
    if outcome is not None:
        state.best_model_checkpoint = previous_best
        raise RuntimeError(f"saving the sharded checkpoint {final} failed: {outcome}")
    return final


def _on_main(step: Any) -> str | None:
    """Run ``step()`` on rank 0; its error message (or None) on every rank."""
    error: str | None = None
    if rank() == 0:
        try:
            step()
        except Exception as exc:  # every rank must learn of it, or the others wait forever
            error = f"{type(exc).__name__}: {exc}"
    return broadcast_from_main(error)  # type: ignore[no-any-return]


def _fresh_directory(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()


def _write_rank_files(engine: Engine, tmp: Path, r: int, model_only: bool) -> dict[str, Any]:
    """This rank's files, synced; returns the files' manifest entries, its layout and index entries."""
    ds_engine = deepspeed_engine_of(engine.model)
    if ds_engine is not None:
        return write_zero_files(engine.model, ds_engine, tmp, r, model_only)
    tensors, entries = _local_model_state(engine.model, r)
    assert engine.optimizer is not None
    files = {model_file(r): cio.write_tensors(tmp / model_file(r), tensors)}
    if not model_only:
        files |= cio.write_bundle(tmp, optimizer_stem(r), _local_optimizer_state(engine.optimizer))
    cio.sync_files(tmp, files)
    return {"layout": "fsdp2", "tensors": entries, "files": files}


def _finish(
    engine: Engine,
    tmp: Path,
    final: Path,
    gathered: list[Any],
    info: Mapping[str, Any],
    rng_states: Sequence[dict[str, Any]],
    *,
    plugins: bool,
) -> None:
    """Rank 0: the shared files, the index and the manifest, then publish; removes ``tmp`` on failure."""
    try:
        failures = [w for w in gathered if isinstance(w, str)]
        if failures:
            raise RuntimeError("; ".join(failures))
        layout = gathered[0]["layout"]
        shared = {INDEX: cio.write_json(tmp / INDEX, _index(gathered))} if layout == "fsdp2" else {}
        if plugins:
            shared |= cio.write_bundle(tmp, "plugins", {p.name: p.state_dict() for p in engine.plugins})
        stems = ["rng"] if len(rng_states) == 1 else [f"rng-{r}" for r in range(len(rng_states))]
        for stem, rng in zip(stems, rng_states, strict=True):
            shared |= cio.write_bundle(tmp, stem, rng)
        state_files, history, linked = write_trainer_state(engine.state, tmp, final)  # history.py
        shared |= state_files
        files = {name: entry for written in gathered for name, entry in written["files"].items()} | shared
        listed = {
            "global_step": engine.state.global_step, "world_size": len(gathered), SHARDED: layout, **history, **info
        }  # fmt: skip
        cio.write_manifest(tmp, files, listed, entries=files)  # every rank hashed its own files as it wrote them
        cio.sync_files(tmp, [*(name for name in shared if name not in linked), cio.MANIFEST])
        publish_directory(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _index(gathered: list[Any]) -> dict[str, Any]:
    """Every tensor's shape, dtype and, when sharded, each rank's slice (from every rank's entries)."""
    tensors: dict[str, Any] = {}
    for r, written in enumerate(gathered):
        for name, entry in written["tensors"].items():
            merged = tensors.setdefault(name, {"shape": entry["shape"], "dtype": entry["dtype"]})
            if "slice" in entry:
                merged.setdefault("slices", []).append({"rank": r, **entry["slice"]})
    return {"format": INDEX_FORMAT, "world_size": len(gathered), "tensors": tensors}


# -- load -----------------------------------------------------------------------------------------
def _read_index(directory: Path) -> dict[str, Any]:
    index = cio.read_json(directory / INDEX)
    if not isinstance(index, dict) or index.get("format") != INDEX_FORMAT or not isinstance(index.get("tensors"), dict):
        raise ConfigError(f"{directory / INDEX} is not a {INDEX_FORMAT} index")
    return index


def world_size_error(directory: Path, written_by: int) -> str:
    """How to go on when a sharded checkpoint meets another number of processes."""
    if is_zero_layout(verified.read_manifest(directory, verify=False).get(SHARDED, "")):
        return zero_world_size_error(directory, written_by)
    return (
        f"sharded checkpoint {directory} was written by {written_by} processes but this run has {world_size()}: "
        f"resume it with {written_by} processes (each rank reads back its own slices, RNG states and data "
        "share), or start a new run from its weights: "
        f"trainbus.plugins.checkpoints.sharded.consolidate_checkpoint({str(directory)!r}, OUT) writes one "
        "model.safetensors that load_model_weights(model, OUT) loads at any number of processes"
    )


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[Any]:
    if path.is_symlink():  # safe_open opens by name: a link would be followed
        raise ConfigError(f"checkpoint file {path} is a symlink; trainbus follows no link")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            yield handle
    except FileNotFoundError as exc:
        raise ConfigError(f"checkpoint file {path} is missing") from exc
    except (SafetensorError, OSError) as exc:
        raise ConfigError(f"checkpoint file {path} is not a valid safetensors file: {exc}") from exc


def _read_sharded_manifest(directory: Path, model: torch.nn.Module) -> dict[str, Any]:
    manifest = verified.read_manifest(directory, verify=False)
    if manifest.get("world_size") != world_size():
        raise ConfigError(world_size_error(directory, int(manifest.get("world_size", 1))))
    by_deepspeed = is_zero_layout(manifest.get(SHARDED))
    if by_deepspeed != (deepspeed_engine_of(model) is not None):
        raise ConfigError(
            f"checkpoint {directory} was written by a {manifest.get(SHARDED)} run; this run "
            f"{'does not use' if by_deepspeed else 'uses'} DeepSpeed: resume it the way it was trained"
        )
    return manifest


def load_model_shards(model: torch.nn.Module, directory: str | Path, *, verify: bool = True) -> None:
    """Copy this rank's part of a sharded checkpoint's weights into ``model`` (every rank calls it).

    Under ZeRO-3 the weights come back through the optimizer's fp32 partitions, so its state is loaded too.
    """
    directory = Path(directory)
    manifest = _read_sharded_manifest(directory, model)
    if is_zero_layout(manifest[SHARDED]):
        load_zero(model, directory, manifest, manifest[SHARDED], verify=verify, optimizer=False)
        return
    me = rank()
    if verify:
        verified.verify_listed(directory, manifest, [INDEX, model_file(me), model_file(0)])
    tensors = _read_index(directory)["tensors"]
    _reshard(model)
    targets = model.state_dict()
    unexpected, missing = sorted(set(tensors) - set(targets)), sorted(set(targets) - set(tensors))
    if unexpected or missing:
        raise ConfigError(
            f"{directory / INDEX} does not fit the model: unexpected {unexpected[:10]}, missing {missing[:10]}"
        )
    with _opened(directory / model_file(me)) as own, _opened(directory / model_file(0)) as main, torch.no_grad():
        for name, target in targets.items():
            if _is_dtensor(target):
                saved = next((s for s in tensors[name].get("slices", []) if s["rank"] == me), None)
                wanted = _slice_of(name, target)
                if saved is None or {"offsets": saved["offsets"], "sizes": saved["sizes"]} != wanted:
                    raise ConfigError(
                        f"{directory}: {name} was sharded differently ({saved}) than this model shards it "
                        f"on rank {me} ({wanted}); use the same fsdp_config and number of processes"
                    )
                target.to_local().copy_(own.get_tensor(name))
            else:
                target.copy_(main.get_tensor(name))


def load_shards(engine: Engine, directory: str | Path, *, verify: bool = True) -> None:
    """Restore this rank's model and optimizer slices from a sharded checkpoint (every rank calls it)."""
    from torch.distributed.tensor import DTensor

    directory = Path(directory)
    manifest = _read_sharded_manifest(directory, engine.model)
    if is_zero_layout(manifest[SHARDED]):
        load_zero(engine.model, directory, manifest, manifest[SHARDED], verify=verify, optimizer=True)
        return
    load_model_shards(engine.model, directory, verify=verify)
    me = rank()
    if verify:
        manifest = verified.read_manifest(directory, verify=False)
        verified.verify_listed(directory, manifest, rank_files(me)[1:])
    assert engine.optimizer is not None
    bundle = cio.read_bundle(directory, optimizer_stem(me))
    state_dict = bundle["state_dict"]
    params = [p for group in engine.optimizer.param_groups for p in group["params"]]
    for index, key in bundle["dtensors"]:
        param = params[index]
        local = state_dict["state"][index][key].to(param.device)
        state_dict["state"][index][key] = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    try:
        engine.optimizer.load_state_dict(state_dict)
    except (ValueError, KeyError, RuntimeError, IndexError) as exc:
        raise ConfigError(f"{directory / (optimizer_stem(me) + '.json')} does not fit engine.optimizer: {exc}") from exc


# -- one model from the shards --------------------------------------------------------------------
def consolidate_checkpoint(directory: str | Path, output_dir: str | Path) -> Path:
    """Put a sharded checkpoint's model slices together into ``output_dir/model.safetensors`` (one process).

    Reads one tensor at a time from each rank's file; the result loads with ``load_model_weights``.
    """
    directory, out = Path(directory), Path(output_dir)
    layout = verified.read_manifest(directory, verify=True).get(SHARDED)
    if layout != "fsdp2":
        raise ConfigError(f"{directory} is a {layout} checkpoint, not FSDP slices: save the model with save_model")
    index = _read_index(directory)
    full: dict[str, torch.Tensor] = {}
    handles = contextlib.ExitStack()
    with handles:
        files = [handles.enter_context(_opened(directory / model_file(r))) for r in range(int(index["world_size"]))]
        for name, entry in index["tensors"].items():
            if "slices" not in entry:
                full[name] = files[0].get_tensor(name)
                continue
            tensor = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]))
            for piece in entry["slices"]:
                region = tuple(slice(o, o + s) for o, s in zip(piece["offsets"], piece["sizes"], strict=True))
                tensor[region] = files[piece["rank"]].get_tensor(name)
            full[name] = tensor
    out.mkdir(parents=True, exist_ok=True)
    cio.write_tensors(out / "model.safetensors", full)
    return out / "model.safetensors"


def save_full_model(model: torch.nn.Module, output_dir: str | Path, *, write: bool) -> None:
    """``save_model`` for a sharded model: every rank calls it; the ``write`` rank saves one file.

    torch's ``get_model_state_dict`` gathers one tensor at a time to rank 0's CPU (``cpu_offload``),
    so no device ever holds the whole model. HF models are saved with ``save_pretrained``.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import FSDPModule

    ds_engine = deepspeed_engine_of(model)
    full: dict[str, torch.Tensor]
    if ds_engine is not None:
        full = zero_full_state(model, ds_engine)
    else:
        _reshard(model)
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # type: ignore[assignment]
    if not write:
        return
    kind = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # FSDP2 made a subclass of it
    cio.save_model(model, output_dir, state_dict=full, model_class=kind)
