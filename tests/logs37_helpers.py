"""Small runs for the #37 tests (logs, run identity, tidying under the lock, refused checkpoints): a bare Engine
with Checkpointing and the file sinks, and a Trainer, each a few steps on a toy regression."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from tests.facade_helpers import Regressor, quiet_args, regression_data
from trainbus.engine import Engine, Event
from trainbus.plugins import FlowControl, Trainer, TrainLogger
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, list_checkpoints
from trainbus.plugins.observability.sinks import CsvSink, JsonlSink


class Crash(Exception):
    pass


class Wide(torch.nn.Module):
    """Another model: its parameter names are none of ``torch.nn.Linear``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x)  # type: ignore[no-any-return]


def engine(
    out: Path,
    max_steps: int,
    *,
    seed: int = 0,
    logger: bool = True,
    sinks: Path | None = None,
    limit: int | None = None,
    save_steps: int = 2,
    model: torch.nn.Module | None = None,
    optimizer: str = "sgd",
    save: bool = True,
    crash_at: int | None = None,
) -> Engine:
    """A bare Engine training a toy regression for ``max_steps``, saving every ``save_steps`` into ``out``; with
    ``sinks`` (a folder) a JSONL and a CSV sink there; ``logger``: a TrainLogger logging every step."""
    torch.manual_seed(seed)
    net = model if model is not None else torch.nn.Linear(2, 1)
    data = [(torch.randn(2, 2), torch.randn(2, 1)) for _ in range(4)]
    plugins: list[Any] = []
    if save:
        plugins.append(Checkpointing(out, save_total_limit=limit, save_strategy="steps", save_steps=save_steps))
    if logger:
        plugins += [TrainLogger(), FlowControl(logging_steps=1)]
    if sinks is not None:
        plugins += [JsonlSink(sinks / "logs.jsonl"), CsvSink(sinks / "logs.csv")]
    opt = (torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam)(net.parameters(), lr=0.1)
    built = Engine(net, opt, max_steps=max_steps, train_data=data, loss_fn=torch.nn.MSELoss(), plugins=plugins)
    if crash_at is not None:

        def crash(ev: Any) -> None:
            if built.state.global_step == crash_at:
                raise Crash(f"killed at step {crash_at}")

        built.on(Event.STEP_END, crash)
    return built


def trainer(out: Path, *, seed: int = 0, **kwargs: Any) -> Trainer:
    torch.manual_seed(seed)
    kwargs = {"max_steps": 8, "learning_rate": 0.05, "logging_steps": 1, **kwargs}
    return Trainer(Regressor(), quiet_args(out, **kwargs), train_dataset=regression_data(48, seed=seed))


def steps(root: Path) -> list[int]:
    return [step for step, _ in list_checkpoints(root)]


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root``, by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
