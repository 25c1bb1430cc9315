"""docs/events.md with the default Trainer's handlers: ``python -m trainbus.plugins.cli.describe --write``.

The engine renders the page from the payload docstrings (``trainbus.engine.testing.describe``) but knows no
plugin; this module builds the default Trainer and hands the page its ``describe()``, so each event
lists the built-in plugins' handlers in the order they run. tests/test_events_doc.py fails when the
committed page differs: a plugin whose handlers or order changed shows there.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any

import torch

from trainbus.engine.testing.describe import main as write_page
from trainbus.engine.testing.describe import render

#: which Trainer the page describes
SETUP = (
    "Handler orders below are the default Trainer's for `TrainingArguments(eval_strategy='steps', "
    "save_strategy='steps', logging_steps=2, eval_steps=2, save_steps=2, max_grad_norm=1.0, "
    "gradient_accumulation_steps=2, report_to='none', disable_tqdm=True)` (`trainer.describe()`)."
)


class _Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.linear(x).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def default_trainer_order() -> dict[str, list[str]]:
    """``describe()`` of the Trainer that SETUP names (built, never trained: nothing is written)."""
    from trainbus.plugins.facade.arguments import TrainingArguments
    from trainbus.plugins.facade.trainer import Trainer

    rows: list[dict[str, Any]] = [{"x": torch.zeros(2), "labels": torch.tensor(0.0)} for _ in range(8)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out, eval_strategy="steps", save_strategy="steps", logging_steps=2, eval_steps=2, save_steps=2,
            max_grad_norm=1.0, gradient_accumulation_steps=2, max_steps=4, report_to="none", disable_tqdm=True,
            use_cpu=True,
        )  # fmt: skip
        return Trainer(_Regressor(), args, train_dataset=rows, eval_dataset=rows).describe()


def render_page() -> str:
    """docs/events.md as committed: the events, their payloads and the default Trainer's handler order."""
    return render(orders=default_trainer_order(), setup=SETUP)


def main(argv: list[str] | None = None) -> int:
    return write_page(argv, text=render_page(), prog="python -m trainbus.plugins.cli.describe")


if __name__ == "__main__":
    sys.exit(main())
