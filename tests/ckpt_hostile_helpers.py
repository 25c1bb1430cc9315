"""Shared by the tests/test_ckpt_hostile_*.py files: a tiny checkpointed run and ways to alter its files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import Engine, Event
from trainbus.plugins.checkpoints import io as cio
from trainbus.plugins.checkpoints.checkpoint import Checkpointing


def make_engine(output_dir: Path, max_steps: int = 6, *plugins: Any, **checkpointing: Any) -> Engine:
    """An MLP trained on 3 batches with AdamW; a log record per step; a checkpoint every 2 steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    data = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(3)]
    checkpointing.setdefault("save_strategy", "steps")
    checkpointing.setdefault("save_steps", 2)
    engine = Engine(
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        train_data=data,
        eval_data=data[:1],
        max_steps=max_steps,
        loss_fn=torch.nn.MSELoss(),
        plugins=[Checkpointing(output_dir, **checkpointing), *plugins],
    )
    engine.on(Event.STEP_END, _log_step)
    return engine


def _log_step(ev: Any) -> None:
    state = ev.engine.state
    state.log_history.append({"loss": 1.0 / (1 + state.global_step), "step": state.global_step})


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return cio.read_tensors(directory / "model.safetensors", owned=True)


def same_weights(model: torch.nn.Module, directory: Path) -> bool:
    return all(torch.equal(model.state_dict()[k], v) for k, v in weights(directory).items())


def flip_byte(path: Path, where: float = 0.5) -> None:
    """One bit flipped in place, as a disk flips it: the same inode (every hard link sees it), the same mtime."""
    info = path.stat()
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        data[int(len(data) * where)] ^= 0x10
        f.seek(0)
        f.write(bytes(data))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


def rewrite_json(directory: Path, name: str, change: Any) -> None:
    """Change a JSON file of a checkpoint and rehash it in the manifest (a consistent forgery)."""
    path = directory / name
    value = json.loads(path.read_text())
    value = change(value) or value
    path.unlink()  # a file of its own, not the linked one
    path.write_text(json.dumps(value))
    rehash(directory, name)


def rehash(directory: Path, name: str) -> None:
    manifest = json.loads((directory / cio.MANIFEST).read_text())
    manifest["files"][name] = cio.file_entry(directory / name)
    (directory / cio.MANIFEST).write_text(json.dumps(manifest))
