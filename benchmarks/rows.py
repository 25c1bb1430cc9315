"""Benchmark rows beyond the bare engine: plugin stacks and the facade, each with its own baseline.

``extra_runs(batches)`` returns ``{name: (run, baseline_name)}``; a baseline_name of None marks a
run that is only a baseline for others (a raw loop doing the same extra work).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Run = Callable[[], None]


def extra_runs(batches: list[Any]) -> dict[str, tuple[Run, str | None]]:
    return {}
