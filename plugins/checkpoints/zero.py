"""Checkpoints of DeepSpeed (ZeRO) runs: the files each rank writes and reads back.

A ZeRO run is saved the way ``sharded.py`` saves an FSDP run (every rank writes into one temporary
directory; rank 0 writes the shared files, lists every rank's files in the manifest and publishes),
with ``zero-rank{r}.json`` + ``.safetensors`` in place of the optimizer files: rank r's ZeRO state as
plain values (its fp32 master partitions, optimizer states, loss scale; ``distributed/deepspeed.py``),
and ``model-rank0.safetensors`` the module's weights for ZeRO-1/2 (every rank holds them all) or only
its buffers for ZeRO-3 (whose weights are restored from the fp32 partitions). The manifest names the
layout ``deepspeed-zero{stage}``.

``sharded.py`` hands DeepSpeed runs to this module, so this one sits below it and holds what both
layouts share (``model_file``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import ConfigError

from ..distributed.deepspeed import deepspeed_engine_of, load_zero_state, zero_state
from ..distributed.processes import rank, world_size
from . import io as cio
from . import verified

__all__ = [
    "is_zero_layout",
    "load_zero",
    "model_file",
    "write_zero_files",
    "zero_full_state",
    "zero_layout",
    "zero_stem",
    "zero_world_size_error",
]


def model_file(r: int) -> str:
    """Rank ``r``'s weights file, in FSDP and ZeRO checkpoints alike."""
    return f"model-rank{r}.safetensors"


def zero_stem(r: int) -> str:
    return f"zero-rank{r}"


def zero_layout(stage: int) -> str:
    """The manifest's layout name (its ``sharded`` key) for a ZeRO stage."""
    return f"deepspeed-zero{stage}"


def is_zero_layout(layout: Any) -> bool:
    """Whether a manifest's layout name is a DeepSpeed one."""
    return str(layout).startswith("deepspeed")


def zero_world_size_error(directory: Path, written_by: int) -> str:
    """How to go on when a DeepSpeed checkpoint meets another number of processes."""
    return (
        f"DeepSpeed checkpoint {directory} was written by {written_by} processes but this run has "
        f"{world_size()}: resume it with {written_by} processes (each rank reads back its own ZeRO partitions)"
    )


# -- save -----------------------------------------------------------------------------------------
def write_zero_files(model: torch.nn.Module, ds_engine: Any, tmp: Path, r: int, model_only: bool) -> dict[str, Any]:
    """This rank's files, synced; returns their manifest entries and the layout."""
    stage = int(ds_engine.zero_optimization_stage())
    files = {}
    if r == 0:  # ZeRO-1/2: every rank holds the whole module; ZeRO-3: only the buffers are whole
        params = {name for name, _ in model.named_parameters()} if stage == 3 else set()
        kept = {k: v for k, v in model.state_dict().items() if k not in params}
        files[model_file(0)] = cio.write_tensors(tmp / model_file(0), kept)
    if stage == 3 or not model_only:
        files |= cio.write_bundle(tmp, zero_stem(r), zero_state(ds_engine))
    cio.sync_files(tmp, files)
    return {"layout": zero_layout(stage), "files": files}


# -- load -----------------------------------------------------------------------------------------
def load_zero(
    model: torch.nn.Module,
    directory: Path,
    manifest: Mapping[str, Any],
    layout: str,
    *,
    verify: bool,
    optimizer: bool,
) -> None:
    """A DeepSpeed run's weights (and with ``optimizer`` its ZeRO state) from this rank's files."""
    ds_engine = deepspeed_engine_of(model)
    stage = int(ds_engine.zero_optimization_stage())
    if layout != zero_layout(stage):
        raise ConfigError(f"checkpoint {directory} was written under {layout}, this run uses ZeRO-{stage}")
    me = rank()
    if verify:
        verified.verify_listed(
            directory, manifest, [model_file(0), f"{zero_stem(me)}.json", f"{zero_stem(me)}.safetensors"]
        )
    weights = directory / model_file(0)
    saved = cio.read_tensors(weights)
    if stage < 3:
        cio.load_weights(model, saved, str(weights))  # into the module's (flattened) parameters
    else:
        buffers = dict(model.named_buffers())
        with torch.no_grad():
            for name, tensor in saved.items():
                buffers[name].copy_(tensor)
    if optimizer or stage == 3:  # ZeRO-3 restores its weights from the fp32 partitions
        load_zero_state(ds_engine, cio.read_bundle(directory, zero_stem(me)))


# -- one model ------------------------------------------------------------------------------------
def zero_full_state(model: torch.nn.Module, ds_engine: Any) -> dict[str, torch.Tensor]:
    """The whole model on rank 0's CPU: ZeRO-1/2 hold it already; ZeRO-3 gathers one parameter at a time."""
    if int(ds_engine.zero_optimization_stage()) < 3:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()} if rank() == 0 else {}
    import deepspeed

    full: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            if rank() == 0:
                full[name] = param.detach().cpu().clone()
    if rank() == 0:
        params = set(full)
        full |= {k: v.detach().cpu() for k, v in model.state_dict().items() if k not in params}
    return full
