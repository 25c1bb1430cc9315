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

A DeepSpeed (ZeRO) run is saved the same way, with its own rank files (``zero.py``). Writing is in
``sharded_save.py``; this module holds the layout and reading.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from trainbus.engine import ConfigError, Engine

from ..distributed.deepspeed import deepspeed_engine_of
from ..distributed.fsdp import is_sharded
from ..distributed.processes import rank, world_size
from . import io as cio
from . import verified
from .zero import is_zero_layout, load_zero, model_file, zero_world_size_error

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


# -- save -----------------------------------------------------------------------------------------


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
