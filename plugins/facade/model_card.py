"""A model card: ``README.md`` next to the saved model (HF's ``Trainer.create_model_card``, without the hub).

It holds the run's results (the final evaluation, a table of the logged training and evaluation
values), the training curves (``training_curves.png``, drawn when matplotlib is there), the data
sizes, the arguments that differ from their defaults, and the versions of trainbus, torch and the
libraries the model comes from.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainbus.engine import ConfigError

from ..observability.plots import FIGURE, curves, plot_history

_TIMING = ("_runtime", "_samples_per_second", "_steps_per_second")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _size(dataset: Any) -> str:
    try:
        return str(len(dataset))
    except TypeError:
        return "unknown (an iterable data set)"


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def results_table(history: Sequence[Mapping[str, Any]]) -> list[str]:
    """HF's "Training results" table: one row per evaluation (the training loss logged before it)."""
    rows: list[list[str]] = []
    last_loss: Any = "No log"
    keys: list[str] = []
    for record in history:
        if "loss" in record:
            last_loss = record["loss"]
        metrics = {k: v for k, v in record.items() if k.startswith("eval_") and not k.endswith(_TIMING)}
        if not metrics:
            continue
        keys += [k for k in metrics if k not in keys]
        rows.append([_number(last_loss), _number(record.get("epoch", "")), str(record.get("step", "")),
                     *(_number(metrics.get(k, "")) for k in keys)])  # fmt: skip
    if not rows:
        return []
    header = ["Training Loss", "Epoch", "Step", *(k.removeprefix("eval_").replace("_", " ").title() for k in keys)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row + [""] * (len(header) - len(row))) + " |" for row in rows]
    return lines


def write_model_card(
    trainer: Any,
    output_dir: str | Path | None = None,
    *,
    model_name: str | None = None,
    language: str | list[str] | None = None,
    license: str | None = None,
    tags: str | list[str] | None = None,
    finetuned_from: str | None = None,
    tasks: str | list[str] | None = None,
    dataset: str | list[str] | None = None,
) -> Path:
    """Write ``README.md`` describing ``trainer``'s run into ``output_dir`` (default ``args.output_dir``)."""
    args = trainer.args
    root = Path(output_dir or args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    history = list(trainer.state.log_history)
    name = model_name or root.name
    as_list = lambda v: [v] if isinstance(v, str) else list(v or [])  # noqa: E731
    front = {"library_name": "trainbus", "tags": ["trainbus", *as_list(tags)]}
    for key, value in (("language", language), ("license", license), ("base_model", finetuned_from),
                       ("pipeline_tag", tasks), ("datasets", dataset)):  # fmt: skip
        if value:
            front[key] = value
    lines = ["---", *(f"{k}: {json.dumps(v)}" for k, v in front.items()), "---", "", f"# {name}", ""]
    base = (
        f" a fine-tuned version of {finetuned_from}" if finetuned_from else f" a {type(_plain(trainer.model)).__name__}"
    )
    lines += [f"This model is{base}, trained with trainbus.", ""]
    final = next((r for r in reversed(history) if any(k.startswith("eval_") for k in r)), None)
    if final is not None:
        lines += ["It achieves the following results on the evaluation set:", ""]
        lines += [f"- {k.removeprefix('eval_').replace('_', ' ').title()}: {_number(v)}"
                  for k, v in final.items() if k.startswith("eval_") and not k.endswith(_TIMING)]  # fmt: skip
        lines.append("")
    lines += ["## Training data", "", f"- training samples: {_size(trainer.train_dataset)}"]
    if trainer.eval_dataset is not None:
        lines.append(f"- evaluation samples: {_size(trainer.eval_dataset)}")
    lines += ["", "## Training procedure", "", "### Training hyperparameters", ""]
    defaults = type(args)()
    changed = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
               if f.name != "output_dir" and getattr(args, f.name) != getattr(defaults, f.name)}  # fmt: skip
    lines += [f"- {k}: {getattr(v, 'value', v)}" for k, v in changed.items()] or ["- the defaults"]
    total = args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
    lines.append(f"- total train batch size: {total}")
    lines += _results_and_versions(history, root)
    path = root / "README.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _results_and_versions(history: list[dict[str, Any]], root: Path) -> list[str]:
    """The card's training results table, its curves (drawn into ``root`` when matplotlib is there), versions."""
    lines: list[str] = []
    table = results_table(history)
    if table:
        lines += ["", "### Training results", "", *table]
    if curves(history):
        figure = root / FIGURE
        try:
            if not figure.exists():
                plot_history(history, figure)
            lines += ["", "### Training curves", "", f"![training curves]({FIGURE})"]
        except ConfigError:
            pass  # no matplotlib: the card goes without the picture
    lines += ["", "### Framework versions", ""]
    for package in ("trainbus", "torch", "transformers", "peft", "accelerate", "datasets"):
        version = _version(package)
        if version is not None:
            lines.append(f"- {package} {version}")
    return lines


def _plain(model: Any) -> Any:
    return getattr(model, "module", model)


__all__ = ["results_table", "write_model_card"]
