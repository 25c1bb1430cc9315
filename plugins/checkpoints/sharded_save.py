"""Writing a checkpoint of a sharded run (the layout: ``sharded.py``): every rank its own files.

``save_sharded_checkpoint``: all ranks write into one temporary directory, rank 0 writes the
index, the shared files and the manifest, then renames it once every rank is done.
``save_full_model``: ``save_model`` for a sharded model: every rank takes part in gathering the full
weights to the CPU of rank 0, which writes one safetensors file.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import ConfigError, Engine, State

from ..distributed.deepspeed import deepspeed_engine_of
from ..distributed.processes import broadcast_from_main, gather_to_main, rank
from . import codec, identity
from . import io as cio
from .directory import publish_directory
from .final_model import save_model
from .history import TakenState, write_trainer_state
from .sharded import INDEX, INDEX_FORMAT, SHARDED, _is_dtensor, _reshard, _slice_of, optimizer_stem
from .writing import claim_best, rollback_best
from .zero import model_file, write_zero_files, zero_full_state

__all__ = ["save_full_model", "save_sharded_checkpoint"]


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
    final, tmp, previous_best, outcome = start_sharded(engine, output_dir)
    me = rank()
    written: Any = None
    if outcome is None:
        try:
            _reshard(engine.model)
            written = _write_rank_files(engine, tmp, me, model_only)
        except Exception as exc:  # reported to rank 0, which aborts the save for every rank
            written = f"rank {me}: {type(exc).__name__}: {exc}"
        gathered = gather_to_main(written)
        rngs = [] if model_only else rng_states or []
        outcome = _on_main(
            lambda: finish_sharded(tmp, final, gathered or [], shared_fields(engine, info, model_only),
                                   shared_bundles(engine, rngs, plugins=not model_only), engine.state)
        )  # fmt: skip
    if outcome is not None:
        rollback_best(state, final, previous_best)
        raise RuntimeError(f"saving the sharded checkpoint {final} failed: {outcome}")
    return final


def start_sharded(engine: Engine, output_dir: str | Path) -> tuple[Path, Path, str | None, str | None]:
    """Every rank, at the save: ``checkpoint-N``, the one temporary folder all ranks write into (made by rank 0),
    the best checkpoint before this save (``writing.claim_best``), and rank 0's error making the folder (or None)."""
    final = Path(output_dir) / f"checkpoint-{engine.state.global_step}"
    tmp = final.with_name(f"{final.name}.tmp-{broadcast_from_main(os.getpid())}")  # one directory for all ranks
    previous_best = claim_best(engine.state, final)
    return final, tmp, previous_best, _on_main(lambda: _fresh_directory(tmp))


def _on_main(step: Any, group: Any = None) -> str | None:
    """Run ``step()`` on rank 0; its error message (or None) on every rank (told over ``group``: default, the
    default group)."""
    error: str | None = None
    if rank() == 0:
        try:
            step()
        except Exception as exc:  # every rank must learn of it, or the others wait forever
            error = f"{type(exc).__name__}: {exc}"
    return broadcast_from_main(error, group)  # type: ignore[no-any-return]


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


def shared_fields(engine: Engine, info: Mapping[str, Any] | None, model_only: bool) -> dict[str, Any]:
    """The manifest fields rank 0 adds to the gathered ones: the step, ``info``, save_only_model, the run's id."""
    run = identity.run_id(engine.state)  # the run's identity, in its state and its manifest (identity.py)
    only = {"model_only": True} if model_only else {}
    return {"global_step": engine.state.global_step, **(info or {}), **only, identity.MANIFEST_KEY: run}


def shared_bundles(
    engine: Engine, rng_states: Sequence[dict[str, Any]], *, plugins: bool
) -> list[tuple[str, Any, dict[str, torch.Tensor]]]:
    """Rank 0's shared bundles, split (``codec.split_tensors``): the plugins' states and every rank's RNG states."""
    values: list[tuple[str, Any]] = []
    if plugins:
        values.append(("plugins", {p.name: p.state_dict() for p in engine.plugins}))
    stems = ["rng"] if len(rng_states) == 1 else [f"rng-{r}" for r in range(len(rng_states))]
    values += list(zip(stems, rng_states, strict=True))
    return [(stem, *codec.split_tensors(value, stem)) for stem, value in values]


def finish_sharded(
    tmp: Path,
    final: Path,
    gathered: list[Any],
    fields: Mapping[str, Any],
    bundles: Sequence[tuple[str, Any, Mapping[str, torch.Tensor]]],
    trainer_state: State | TakenState,
) -> None:
    """Rank 0: the shared files, the index and the manifest, then publish; removes ``tmp`` on failure."""
    try:
        failures = [w for w in gathered if isinstance(w, str)]
        if failures:
            raise RuntimeError("; ".join(failures))
        layout = gathered[0]["layout"]
        shared = {INDEX: cio.write_json(tmp / INDEX, _index(gathered))} if layout == "fsdp2" else {}
        for stem, structure, tensors in bundles:
            shared |= cio.write_split_bundle(tmp, stem, structure, tensors)
        state_files, history, linked = write_trainer_state(trainer_state, tmp, final)  # history.py
        shared |= state_files
        files = {name: entry for written in gathered for name, entry in written["files"].items()} | shared
        listed = {"global_step": fields["global_step"], "world_size": len(gathered), SHARDED: layout, **history,
                  **fields}  # fmt: skip
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
    save_model(model, output_dir, state_dict=full, model_class=kind)
