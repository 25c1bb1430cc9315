"""docs/events.md with the default Trainer's handlers: ``python -m trainbus.plugins.cli.describe --write``.

The engine renders the page from the payload docstrings (``trainbus.engine.testing.describe``) but knows no
plugin; this module builds the default Trainer and hands the page its ``describe()``, so each event
lists the built-in plugins' handlers in the order they run. tests/test_events_doc.py fails when the
committed page differs: a plugin whose handlers or order changed shows there.
"""

from __future__ import annotations

import ast
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
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
    order: dict[str, list[str]] = _default_trainer(lambda trainer: trainer.describe())
    return order


def _default_trainer(read: Callable[[Any], Any]) -> Any:
    """``read(trainer)`` of the Trainer that SETUP names, built in a temporary directory."""
    from trainbus.plugins.facade.arguments import TrainingArguments
    from trainbus.plugins.facade.trainer import Trainer

    rows: list[dict[str, Any]] = [{"x": torch.zeros(2), "labels": torch.tensor(0.0)} for _ in range(8)]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            out, eval_strategy="steps", save_strategy="steps", logging_steps=2, eval_steps=2, save_steps=2,
            max_grad_norm=1.0, gradient_accumulation_steps=2, max_steps=4, report_to="none", disable_tqdm=True,
            use_cpu=True,
        )  # fmt: skip
        return read(Trainer(_Regressor(), args, train_dataset=rows, eval_dataset=rows))


def hook_wrappers() -> dict[str, list[tuple[str, str, str]]]:
    """Per hook, the built-in wrappers: (class, wrapper expression, module path), read from the source.

    Every ``wrap_hook`` call in ``plugins/`` whose hook is a string literal, with the class it sits in;
    generated, so a plugin that starts wrapping a hook shows on the page (the docs test fails until then).
    """
    root = Path(__file__).resolve().parent.parent
    found: dict[str, list[tuple[str, str, str]]] = {}
    for path in sorted(root.rglob("*.py")):
        for cls, hook, wrapper in _wrap_calls(ast.parse(path.read_text(encoding="utf-8"))):
            entry = (cls, wrapper, "plugins/" + path.relative_to(root).as_posix())
            if entry not in found.setdefault(hook, []):
                found[hook].append(entry)
    return found


def _wrap_calls(tree: ast.Module) -> list[tuple[str, str, str]]:
    """(class, hook, wrapper source) of each ``*.wrap_hook(..., "hook", wrapper)`` call inside a class."""
    calls = []
    for cls in (node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)):
        for call in (node for node in ast.walk(cls) if isinstance(node, ast.Call)):
            if not (isinstance(call.func, ast.Attribute) and call.func.attr == "wrap_hook"):
                continue
            args = call.args
            first = next(
                (i for i, a in enumerate(args) if isinstance(a, ast.Constant) and isinstance(a.value, str)), None
            )
            if first is not None and first + 1 < len(args):
                calls.append((cls.name, str(args[first].value), ast.unparse(args[first + 1])))  # type: ignore[attr-defined]
    return calls


#: a bare Engine with plugins a user would pick, and a user's wrappers, for the page's hook stacks
EXAMPLE = (
    "`Engine(model, opt, plugins=[MixedPrecision('bf16'), LabelSmoothing(0.1), EvalCollector(), "
    "HalfPrecisionEval()])`, then `engine.wrap_hook('forward', probe, owner='probe')` and "
    "`engine.wrap_hook('forward', inner_probe, owner='inner_probe', innermost=True)`"
)


def example_stacks() -> dict[str, list[str]]:
    """``describe_hooks()`` of EXAMPLE's engine."""
    from trainbus.engine import Engine
    from trainbus.plugins import EvalCollector, HalfPrecisionEval, LabelSmoothing, MixedPrecision

    model = torch.nn.Linear(2, 1)
    plugins = [MixedPrecision("bf16"), LabelSmoothing(0.1), EvalCollector(), HalfPrecisionEval()]
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), plugins=plugins)
    engine.wrap_hook("forward", lambda inner: lambda model, batch: inner(model, batch), owner="probe")
    engine.wrap_hook("forward", lambda inner: lambda m, b: inner(m, b), owner="inner_probe", innermost=True)
    return engine.describe_hooks()


def hook_lines() -> dict[str, list[str]]:
    """Per hook, the page's lines on its wrappers: the built-in ones, the default Trainer's and EXAMPLE's stacks."""
    catalogue = hook_wrappers()
    trainer, example = _default_trainer(lambda trainer: trainer.describe_hooks()), example_stacks()
    lines: dict[str, list[str]] = {}
    for hook in trainer:
        wrappers = catalogue.get(hook, [])
        listed = ", ".join(f"`{cls}` (`{fn}`, {where})" for cls, fn, where in wrappers) or "none"
        lines[hook] = [
            f"- Built-in wrappers: {listed}.",
            f"- The default Trainer's stack, innermost first: {_stack(trainer[hook])}.",
            f"- In the example engine: {_stack(example[hook])}.",
        ]
    return lines


def _stack(layers: list[str]) -> str:
    base, *wrappers = layers
    return " <- ".join([f"`{base}` (base)", *(f"`{w}`" for w in wrappers)])


HOOKS_SETUP = (
    "Under each hook: the wrappers the built-in plugins register (read from their source), and the stacks, base "
    f"function first, then each wrapper around the one before, of the default Trainer above and of {EXAMPLE}."
)


def render_page() -> str:
    """docs/events.md as committed: the events, their payloads, the default Trainer's handler order, the hooks."""
    return render(orders=default_trainer_order(), setup=SETUP, hooks=hook_lines(), hooks_setup=HOOKS_SETUP)


def main(argv: list[str] | None = None) -> int:
    return write_page(argv, text=render_page(), prog="python -m trainbus.plugins.cli.describe")


if __name__ == "__main__":
    sys.exit(main())
