"""The metrics TRL's trainers log, as a plugin: values kept on the device, read once per logging point.

TRL's definition, kept so the logged numbers are TRL's: every micro-batch (training) or eval batch adds
one value per metric, a ratio of two sums over the batch (summed over processes first), 0 where the
denominator is 0; a logging point logs each metric's plain mean over the values added since the last one
(training), an evaluation its mean over the eval batches under ``eval_<name>``. ``num_tokens`` is the
running count of input tokens trained on (attention-mask ones, or the packed row length without one).

Unlike TRL, which reads every value back to the host as it is made (``.item()``, a sync per micro-batch
and metric), the ratios' sums stay tensors until the logging point reads them all in one transfer; and
the running token count and the values not yet logged are checkpointed, so a resumed run logs what the
uninterrupted one logs (TRL restarts ``num_tokens`` at 0 and drops the open window's values).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from trainbus.engine import Event, Plugin, Priority
from trainbus.plugins.distributed.processes import all_reduce_sum, collective_device, world_size

if TYPE_CHECKING:
    from trainbus.engine import Engine
    from trainbus.engine.payloads import BatchStartEvent, EvalEndEvent, LogEvent

MODES = ("train", "eval")


def tokens_in(batch: Any) -> int:
    """Input tokens of a batch as TRL counts them: the attention mask's ones, else a padding-free row's length."""
    mask = batch.get("attention_mask") if isinstance(batch, dict) else None
    if isinstance(mask, torch.Tensor):
        if mask.device.type == "cpu":
            return int(np.asarray(mask.numpy()).sum())
        return int(mask.sum())  # pragma: no cover - the loop's BATCH_START batch is still on the host
    positions = batch.get("position_ids") if isinstance(batch, dict) else None
    if isinstance(positions, torch.Tensor):
        return int(positions.size(1))
    raise ValueError("Expected 'attention_mask' or 'position_ids' in the batch to count its tokens")


class TRLMetrics(Plugin):  # type: ignore[misc]  # mypy reads trainbus.* as Any
    """Collects TRL's per-batch metrics and adds their means to the log records and eval metrics.

    The loss hooks call ``add(mode, name, numerator, denominator)`` with 0-dim tensors; nothing is read
    until a logging point (training) or the end of an evaluation.
    """

    priority = Priority.PRODUCER

    def __init__(self) -> None:
        self.total_train_tokens = 0  # over every process (TRL gathers each batch's count)
        self._local_tokens = 0  # this process's, since the last logging point or save
        self._values: dict[str, dict[str, list[tuple[Any, Any]]]] = {m: defaultdict(list) for m in MODES}
        self._pooled: set[str] = set()
        self._engine: Any = None

    def attach(self, engine: Engine) -> None:
        self._engine = engine
        self.on(engine, Event.BATCH_START, self.count_tokens)
        self.on(engine, Event.LOG, self.add_to_log)
        self.on(engine, Event.SAVE, self.settle_tokens, before="Checkpointing")  # a checkpoint holds the total
        self.on(engine, Event.EVAL_END, self.add_to_eval, before="TrainLogger")  # before it logs the metrics

    # -- collecting --------------------------------------------------------------------------------
    def mode(self) -> str:
        return "train" if self._engine is not None and self._engine.model.training else "eval"

    def add(self, mode: str, name: str, numerator: Any, denominator: Any, pooled: bool = False) -> None:
        """One batch's value of ``name``; ``pooled``: the metric is the ratio of the sums over batches (an exact
        mean over every token), not TRL's mean of the per-batch ratios."""
        self._values[mode][name].append((numerator, denominator))
        if pooled:
            self._pooled.add(name)

    def count_tokens(self, ev: BatchStartEvent) -> None:
        self._local_tokens += tokens_in(ev.batch)  # on the host, before the batch moves: no sync

    def settle_tokens(self, ev: Any = None) -> None:
        """Add every process's tokens since the last settling to the total (one collective, at logs and saves)."""
        local, self._local_tokens = self._local_tokens, 0
        if world_size() > 1:
            local = int(all_reduce_sum(torch.tensor([local], dtype=torch.int64, device=collective_device())).item())
        self.total_train_tokens += local

    # -- reading -------------------------------------------------------------------------------------
    def means(self, mode: str) -> dict[str, float]:
        """Each metric's mean of its per-batch ratios (TRL's; a pooled one: its sums' ratio), read in one
        transfer; the values are cleared."""
        values = self._values[mode]
        if not values:
            return {}
        names = list(values)
        pairs = [pair for name in names for pair in values[name]]
        device = next((v.device for pair in pairs for v in pair if isinstance(v, torch.Tensor)), None)
        stacked = torch.stack([torch.stack([_as_tensor(n, device), _as_tensor(d, device)]) for n, d in pairs])
        if world_size() > 1:
            stacked = all_reduce_sum(stacked)  # TRL gathers each batch's sums over processes
        sums = stacked.tolist()  # the one host read: [numerator, denominator] per batch, float64
        ratios = [n / d if d > 0 else 0.0 for n, d in sums]
        out, start = {}, 0
        for name in names:
            count = len(values[name])
            if name in self._pooled:
                total, tokens = (sum(column) for column in zip(*sums[start : start + count], strict=True))
                out[name] = float(total / tokens) if tokens > 0 else 0.0
            else:
                out[name] = float(sum(ratios[start : start + count]) / count)
            start += count
        values.clear()
        return out

    def add_to_log(self, ev: LogEvent) -> None:
        """Training records (a logging point, or the run's closing record) get the train means (TRL's ``log``)."""
        if not ev.logs or not ev.engine.model.training:
            return
        if not ev.window and "train_runtime" not in ev.logs:
            return
        means = self.means("train")
        self.settle_tokens()
        if means or ev.window:
            means["num_tokens"] = float(self.total_train_tokens)
        ev.logs.update(means)

    def add_to_eval(self, ev: EvalEndEvent) -> None:
        if ev.error is not None:
            self._values["eval"].clear()
            return
        means = self.means("eval")
        self.settle_tokens()
        if means:
            means["num_tokens"] = float(self.total_train_tokens)
        ev.metrics.update({f"eval_{k}": v for k, v in means.items()})

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if world_size() == 1:  # no collective: a save outside SAVE (engine.save) holds the count too
            self.settle_tokens()
        pending = {name: [[float(n), float(d)] for n, d in pairs] for name, pairs in self._values["train"].items()}
        return {"total_train_tokens": self.total_train_tokens, "pending": pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total_train_tokens = int(state.get("total_train_tokens", 0))
        self._values["train"].clear()
        for name, pairs in dict(state.get("pending", {})).items():
            self._values["train"][name] = [(torch.tensor(n), torch.tensor(d)) for n, d in pairs]


def _as_tensor(value: Any, device: Any) -> torch.Tensor:
    """A 0-dim float64 tensor on ``device``: the loss hooks' sums stay where they are (no host read)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device=device, dtype=torch.float64)
    return torch.tensor(float(value), dtype=torch.float64, device=device)
