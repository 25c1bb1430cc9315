"""Shared pieces of the benchmarks: the tiny job, a raw PyTorch loop, alternating timing, sync counting."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

FEATURES, HIDDEN, CLASSES, BATCH = 32, 64, 4, 8


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, CLASSES))


class ClassifierWithLoss(torch.nn.Module):
    """``net`` in the HF calling convention: ``forward(x, labels) -> {"loss", "logits"}`` (cross-entropy)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits, labels)
        return out


def make_batches(n: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)) for _ in range(n)
    ]


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)


def raw_loop(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[Any], loss_fn: Callable[..., Any]
) -> None:
    """What a user writes by hand: the reference every ratio is measured against."""
    model.train()
    for x, y in batches:
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def paired_ratio(
    baseline: Callable[[], None], run: Callable[[], None], rounds: int
) -> tuple[float, float, float, float]:
    """Median over rounds of time(run) / time(baseline), the two run back to back, order alternating.

    Returns (median ratio, interquartile range of the ratios, median baseline s, median run s).
    Times are this thread's CPU time; pairing adjacent runs cancels the slow drifts of a shared VM,
    which dwarf a few percent between medians taken apart. The IQR says how far to trust the median.
    """
    baseline()  # warm-up: lazy optimizer state, allocator caches
    run()
    ratios: list[float] = []
    base_times: list[float] = []
    run_times: list[float] = []
    for round_ in range(rounds):
        pair = ((baseline, base_times), (run, run_times))
        for fn, times in pair if round_ % 2 == 0 else pair[::-1]:
            start = time.thread_time()
            fn()
            times.append(time.thread_time() - start)
        ratios.append(run_times[-1] / base_times[-1])
    quartiles = statistics.quantiles(ratios, n=4)
    return (
        statistics.median(ratios),
        quartiles[2] - quartiles[0],
        statistics.median(base_times),
        statistics.median(run_times),
    )


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    print(f"\n{title}")
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |")
