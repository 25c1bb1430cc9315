"""The host buffers of ``save_async``: reserved in a thread after the run's first step, so the first save only
copies (as every later one), held to the end of training, released there."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainbus.engine import Engine, Event
from trainbus.plugins import Checkpointing
from trainbus.plugins.checkpoints import snapshot


def _engine(out: Path, **checkpointing: Any) -> Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    data = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(4)]
    options = {"save_strategy": "steps", "save_steps": 3, "save_async": True, **checkpointing}
    return Engine(model, torch.optim.AdamW(model.parameters(), lr=0.01), train_data=data, max_steps=6,
                  loss_fn=torch.nn.MSELoss(), plugins=[Checkpointing(out, **options)])  # fmt: skip


def _count_allocations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Keys ``HostBuffers.take`` had to allocate (a buffer missing or of another shape)."""
    allocated: list[str] = []
    real = snapshot.HostBuffers._copy

    def copy(self: snapshot.HostBuffers, key: str, source: torch.Tensor) -> torch.Tensor:
        if key not in self._buffers or self._buffers[key].shape != source.shape:
            allocated.append(key)
        return real(self, key, source)

    monkeypatch.setattr(snapshot.HostBuffers, "_copy", copy)
    return allocated


def test_the_first_save_copies_into_buffers_reserved_after_the_first_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    allocated = _count_allocations(monkeypatch)
    engine = _engine(tmp_path)
    plugin = engine.get_plugin(Checkpointing)
    held: list[int] = []
    engine.on(Event.STEP_END, lambda ev: held.append(plugin._async.buffers.nbytes))  # type: ignore[union-attr]
    engine.fit()
    weights_and_moments = [k for k in allocated if k.startswith(("weights/", "optimizer/"))]
    assert weights_and_moments == [], weights_and_moments  # only small states (plugins, RNG, step counts) left
    state_bytes = sum(p.numel() * 4 * 3 for p in engine.model.parameters())  # weights + AdamW's two moments
    assert held[-1] >= state_bytes  # held through the run
    assert plugin._async.buffers.nbytes == 0  # released at the end of training  # type: ignore[union-attr]


def test_save_only_model_reserves_no_optimizer_buffers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(tmp_path, save_only_model=True)
    plugin = engine.get_plugin(Checkpointing)
    keys: list[list[str]] = []

    def reserved(ev: Any) -> None:
        saves = plugin._async  # type: ignore[union-attr]
        if saves._warming is not None:
            saves._warming.join()  # reserved in a thread: done by the first save, here at step 2
        keys.append(sorted(saves.buffers._buffers))

    engine.on(Event.STEP_END(once=2), reserved)
    engine.fit()
    assert keys[0] and all(key.startswith("weights/") for key in keys[0]), keys
