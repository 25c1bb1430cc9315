"""Invariant 6: interrupt a run at any step, resume in a fresh engine: the rest is bit-exact (K4).

The model has dropout and a plugin perturbs batches with Python's and numpy's RNG, the data is
a shuffled DataLoader (whose iterator draws from torch's global RNG), with Adam, the
GradientAccumulation plugin, a linear LR schedule and a plugin with tensor state: every piece a
resume must restore. Run this file as a script to resume in a fresh process (used by the subprocess test).
"""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch as st
import torch
from hypothesis import given
from hypothesis import strategies as hs
from torch.utils.data import DataLoader, Sampler, TensorDataset

from trainbus.engine import ConfigError, Engine, Event, Plugin, Priority
from trainbus.engine.events import BatchStartEvent, LossEvent, StepEndEvent
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, resume
from trainbus.plugins.optimization.accumulation import GradientAccumulation
from trainbus.plugins.optimization.schedulers import LRScheduler


class EpochShuffle(Sampler[int]):
    """A shuffle seeded by (seed, epoch): the order of an epoch does not depend on global RNG use."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return iter(torch.randperm(self.n, generator=generator).tolist())

    def __len__(self) -> int:
        return self.n


class Noise(Plugin):
    """Perturbs inputs with Python's and numpy's global RNG (so both must be restored)."""

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.BATCH_START, self.perturb, priority=Priority.PRODUCER)

    def perturb(self, ev: BatchStartEvent) -> None:
        x, y = ev.batch
        scale = 0.1 if random.random() < 0.5 else 0.0
        ev.batch = (x + scale * torch.from_numpy(np.random.standard_normal(tuple(x.shape))).float(), y)


class LossHistory(Plugin):
    """Stateful plugin: a running tensor sum, per-step losses keyed by int step, and log_history."""

    def __init__(self) -> None:
        self.window = torch.zeros(())
        self.total = torch.zeros(())
        self.by_step: dict[int, float] = {}

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.LOSS, self.loss)
        self.on(engine, Event.STEP_END, self.step_end)

    def loss(self, ev: LossEvent) -> None:
        self.window = self.window + ev.loss.detach()

    def step_end(self, ev: StepEndEvent) -> None:
        state = ev.engine.state
        self.total = self.total + self.window
        self.by_step[state.global_step] = float(self.window)  # a test may read the host every step
        state.log_history.append({"step": state.global_step, "loss": float(self.window), "epoch": state.epoch})
        self.window = torch.zeros(())

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "total": self.total, "by_step": dict(self.by_step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window, self.total, self.by_step = state["window"], state["total"], dict(state["by_step"])


def build(config: dict[str, int], output_dir: Path) -> Engine:
    """The same engine every time for the same config: seeds fixed before construction."""
    torch.manual_seed(config["seed"])
    random.seed(config["seed"])
    np.random.seed(config["seed"])
    n = config["n_items"]
    data = TensorDataset(torch.randn(n, 3), torch.randn(n, 1))
    loader = DataLoader(data, batch_size=config["batch_size"], sampler=EpochShuffle(n, config["seed"]))
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.3), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    plugins = [
        GradientAccumulation(config["k"]),
        Noise(),
        LossHistory(),
        LRScheduler("linear", num_warmup_steps=2),
        Checkpointing(output_dir),
    ]
    engine = Engine(
        model, optimizer, train_data=loader, max_epochs=config["epochs"], loss_fn=torch.nn.MSELoss(), plugins=plugins
    )
    return engine


def total_steps(config: dict[str, int]) -> int:
    batches = math.ceil(config["n_items"] / config["batch_size"])
    return config["epochs"] * math.ceil(batches / config["k"])


class Crash(Exception):
    pass


def run_interrupted(config: dict[str, int], output_dir: Path, kind: str, at: int) -> None:
    """Save at step ``at`` (kind "step") or after epoch ``at`` ends (kind "epoch"), then crash."""
    engine = build(config, output_dir)

    def request(ev: Any) -> None:
        if (kind == "step" and ev.engine.state.global_step == at) or (kind == "epoch" and ev.epoch == at):
            ev.engine.control.should_save = True

    def crash(ev: Any) -> None:
        raise Crash("simulated crash right after the checkpoint was written")

    engine.on(Event.STEP_END if kind == "step" else Event.EPOCH_END, request)
    engine.on(Event.SAVE, crash, priority=Priority.LAST)
    with pytest.raises(Crash, match="simulated crash"):
        engine.fit()


def assert_same_run(a: Engine, b: Engine) -> None:
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), f"parameter {name} differs"
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()  # type: ignore[union-attr]
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for index, entry in sa["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, sb["state"][index][key]), f"optimizer state {index}/{key} differs"
    assert a.state.log_history == b.state.log_history
    assert a.state.global_step == b.state.global_step and a.state.epoch == b.state.epoch
    ha, hb = a.get_plugin(LossHistory), b.get_plugin(LossHistory)
    assert isinstance(ha, LossHistory) and isinstance(hb, LossHistory)
    assert torch.equal(ha.total, hb.total) and ha.by_step == hb.by_step
    assert a.get_plugin(LRScheduler).state_dict() == b.get_plugin(LRScheduler).state_dict()  # type: ignore[union-attr]


configs = hs.fixed_dictionaries(
    {
        "seed": hs.integers(0, 3),
        "n_items": hs.integers(2, 9),
        "batch_size": hs.integers(1, 3),
        "k": hs.integers(1, 3),
        "epochs": hs.integers(1, 3),
    }
)


@given(config=configs, data=hs.data())
def test_resume_is_bit_exact(tmp_path_factory: pytest.TempPathFactory, config: dict[str, int], data: Any) -> None:
    total = total_steps(config)
    choices = [("step", s) for s in range(1, total)] + [("epoch", e) for e in range(config["epochs"] - 1)]
    if not choices:
        return  # a one-step run has no interior point to interrupt at
    kind, at = data.draw(hs.sampled_from(choices))
    reference = build(config, tmp_path_factory.mktemp("unused"))
    reference.fit()
    rng_after_reference = torch.get_rng_state()

    output_dir = tmp_path_factory.mktemp("ckpt")
    run_interrupted(config, output_dir, kind, at)
    resumed = build(config, output_dir)
    path = resume(resumed, True)  # the latest complete checkpoint of the Checkpointing plugin's dir
    assert path.parent == output_dir
    resumed.fit()
    assert_same_run(reference, resumed)
    assert torch.equal(torch.get_rng_state(), rng_after_reference), "global torch RNG differs at the end"


def test_resume_in_a_fresh_process(tmp_path: Path) -> None:
    config = {"seed": 1, "n_items": 7, "batch_size": 2, "k": 2, "epochs": 3}
    reference = build(config, tmp_path / "unused")
    reference.fit()
    run_interrupted(config, tmp_path / "ckpt", "step", 3)
    result = tmp_path / "result"
    script = Path(__file__).resolve()
    subprocess.run(
        [sys.executable, str(script), json.dumps(config), str(tmp_path / "ckpt"), str(result)],
        check=True,
        cwd=script.parent.parent,
        timeout=120,
    )
    weights = st.load_file(str(result / "params.safetensors"))
    for name, p in reference.model.named_parameters():
        assert torch.equal(p.detach(), weights[name]), f"parameter {name} differs after a resume in a fresh process"
    optimizer_state = st.load_file(str(result / "optimizer.safetensors"))
    for index, entry in reference.optimizer.state_dict()["state"].items():  # type: ignore[union-attr]
        for key, value in entry.items():
            assert torch.equal(value, optimizer_state[f"{index}.{key}"])
    assert json.loads((result / "log_history.json").read_text()) == reference.state.log_history


def _resume_in_this_process(config: dict[str, int], checkpoint_dir: Path, result: Path) -> None:
    torch.set_num_threads(1)
    engine = build(config, checkpoint_dir)
    resume(engine, True)
    engine.fit()
    result.mkdir(parents=True)
    st.save_file(
        {n: p.detach().contiguous() for n, p in engine.model.named_parameters()}, result / "params.safetensors"
    )
    flat = {
        f"{index}.{key}": value
        for index, entry in engine.optimizer.state_dict()["state"].items()  # type: ignore[union-attr]
        for key, value in entry.items()
    }
    st.save_file(flat, result / "optimizer.safetensors")
    (result / "log_history.json").write_text(json.dumps(engine.state.log_history))


def test_resume_true_without_checkpoints_lists_what_it_found(tmp_path: Path) -> None:
    config = {"seed": 0, "n_items": 4, "batch_size": 2, "k": 1, "epochs": 1}
    (tmp_path / "checkpoint-3.tmp-1").mkdir()  # pid 1 lives, but the output_dir lock is free: no save is running
    (tmp_path / "checkpoint-2").mkdir()  # no manifest: incomplete
    (tmp_path / "notes.txt").write_text("")
    engine = build(config, tmp_path)
    with pytest.raises(ConfigError, match=r"no complete checkpoint.*found: \['checkpoint-2', 'notes.txt'\]"):
        resume(engine, True)
    assert not (tmp_path / "checkpoint-3.tmp-1").exists()  # tidied under the lock (the lock, not a pid, says who lives)
    with pytest.raises(ConfigError, match="is not a directory"):
        resume(engine, tmp_path / "nope")
    with pytest.raises(ConfigError, match="must be a path or True"):
        resume(engine, False)


def test_resume_needs_the_same_plugins(tmp_path: Path) -> None:
    config = {"seed": 0, "n_items": 4, "batch_size": 2, "k": 1, "epochs": 2}
    run_interrupted(config, tmp_path, "step", 1)
    engine = build(config, tmp_path)
    engine.pop_plugin(LossHistory)
    with pytest.raises(ConfigError, match="LossHistory"):
        resume(engine, True)


if __name__ == "__main__":
    _resume_in_this_process(json.loads(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
