"""The ``trainbus`` command: ``trainbus demo`` trains a small MLP on scikit-learn's digits.

The demo goes through the Hugging Face style facade with the features most runs use: evaluation
and checkpoints every epoch, accuracy from ``compute_metrics``, gradient accumulation, clipping, a
cosine schedule with warmup, checkpoint rotation, the best model loaded at the end, early
stopping, and the JSONL / CSV log sinks; then it predicts on a held-out test split. The digits
(1797 8x8 images, 10 classes) ship inside scikit-learn, so nothing is downloaded::

    trainbus demo --output-dir demo_out          # or: python -m trainbus.plugins.cli demo
    trainbus demo --quick                        # fewer epochs, a few seconds
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from trainbus.engine import ConfigError, EvalEndEvent, Event, Plugin, Priority

from ..checkpoints.directory import set_aside
from ..checkpoints.lock import hold_output_dir

#: epochs of the default and of the quick demo (early stopping may end a run sooner)
DEMO_EPOCHS = 20
QUICK_EPOCHS = 6


class DigitsMLP(torch.nn.Module):
    """A two-layer MLP over the 64 pixels, with an HF-style forward (loss when labels are given)."""

    def __init__(self, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(hidden, classes)
        )

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.net(pixels)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits, labels)
        return out


def digits_splits(seed: int = 42) -> dict[str, list[dict[str, torch.Tensor]]]:
    """scikit-learn's digits as train / validation / test lists of ``{"pixels", "labels"}`` (60/20/20, stratified)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ConfigError("trainbus demo needs scikit-learn: pip install 'trainbus[demo]'") from None
    x, y = load_digits(return_X_y=True)
    x = x / 16.0  # pixel intensities are 0..16
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)
    x_train, x_val, y_train, y_val = train_test_split(
        x_train, y_train, test_size=0.25, stratify=y_train, random_state=seed
    )

    def rows(xs: Any, ys: Any) -> list[dict[str, torch.Tensor]]:
        pixels = torch.as_tensor(xs, dtype=torch.float32)
        labels = torch.as_tensor(ys, dtype=torch.long)
        return [{"pixels": pixels[i], "labels": labels[i]} for i in range(len(labels))]

    return {"train": rows(x_train, y_train), "validation": rows(x_val, y_val), "test": rows(x_test, y_test)}


def accuracy(prediction: Any) -> dict[str, float]:
    """``compute_metrics``: the share of argmax predictions equal to the labels."""
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


class EpochTable(Plugin):
    """Prints one row per evaluation: epoch, step, the epoch's train loss, eval loss and accuracy.

    A plain event handler on EVAL_END; it runs last, after the loggers and the best-metric tracker.
    """

    priority = Priority.LAST
    columns = ("epoch", "step", "train loss", "eval loss", "eval acc", "lr")

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def attach(self, engine: Any) -> None:
        self.on(engine, Event.EVAL_END, self.eval_end)

    def header(self) -> None:
        self.stream.write("".join(f"{c:>11}" for c in self.columns) + "\n")

    def eval_end(self, ev: EvalEndEvent) -> None:
        state = ev.engine.state
        train: dict[str, Any] = next((r for r in reversed(state.log_history) if "loss" in r), {})
        cells = (
            f"{state.epoch:.0f}",
            str(state.global_step),
            f"{train.get('loss', float('nan')):.4f}",
            f"{ev.metrics.get('eval_loss', float('nan')):.4f}",
            f"{ev.metrics.get('eval_accuracy', float('nan')):.4f}",
            f"{train.get('learning_rate', float('nan')):.2e}",
        )
        self.stream.write("".join(f"{c:>11}" for c in cells) + "\n")
        self.stream.flush()


def run_demo(output_dir: str, epochs: int, seed: int = 42, stream: TextIO | None = None) -> dict[str, Any]:
    """Train, evaluate and predict on the digits; print the progress and a summary; return the figures."""
    threads = torch.get_num_threads()
    # a 64-128-10 MLP gains nothing from intra-op threads, and loses a lot when cores are shared
    torch.set_num_threads(1)
    try:
        return _demo(output_dir, epochs, seed, stream or sys.stdout)
    finally:
        torch.set_num_threads(threads)


def _demo_settings(epochs: int, seed: int) -> dict[str, Any]:
    """The demo's TrainingArguments: accumulation, clipping, a cosine schedule, epoch evaluation, the best model."""
    return {
        "num_train_epochs": epochs,
        "per_device_train_batch_size": 32,
        "per_device_eval_batch_size": 256,
        "gradient_accumulation_steps": 2,
        "learning_rate": 5e-3,
        "weight_decay": 0.01,
        "max_grad_norm": 1.0,
        "lr_scheduler_type": "cosine",
        "warmup_ratio": 0.05,
        "logging_strategy": "epoch",
        "eval_strategy": "epoch",
        "save_strategy": "epoch",
        "save_total_limit": 2,
        "load_best_model_at_end": True,
        "metric_for_best_model": "accuracy",
        "report_to": ["jsonl", "csv"],
        "disable_tqdm": True,
        "use_cpu": True,
        "seed": seed,
    }


def _demo(output_dir: str, epochs: int, seed: int, out: TextIO) -> dict[str, Any]:
    from ..control.early_stopping import EarlyStopping
    from ..facade.arguments import TrainingArguments
    from ..facade.composition import set_seed
    from ..facade.trainer import Trainer
    from ..observability.plots import PlotCurves
    from ..observability.progress import Printer

    started = time.perf_counter()
    data = digits_splits(seed)
    args = TrainingArguments(output_dir, **_demo_settings(epochs, seed))
    table = EpochTable(out)
    extras: list[Any] = []
    try:
        extras.append(PlotCurves(output_dir))  # training_curves.png at the end (the demo extra has matplotlib)
    except ConfigError:
        out.write("(no training_curves.png: matplotlib is not installed; pip install 'trainbus[plots]')\n")
    set_seed(seed)  # before the model is built, so its initial weights are the seed's too
    trainer = Trainer(
        DigitsMLP(),
        args,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        compute_metrics=accuracy,
        callbacks=[EarlyStopping("accuracy", patience=3), table, *extras],
    )
    trainer.remove_callback(Printer)  # the table replaces the per-record printer
    out.write(
        f"trainbus demo: MLP on scikit-learn digits ({len(data['train'])} train / {len(data['validation'])} "
        f"validation / {len(data['test'])} test images), up to {epochs} epochs\n"
    )
    table.header()
    result = trainer.train()
    test = trainer.predict(data["test"])
    trainer.save_model()
    metrics = dict(test.metrics or {})
    summary = {
        "test_accuracy": float(metrics["test_accuracy"]),
        "test_loss": float(metrics["test_loss"]),
        "best_checkpoint": trainer.state.best_model_checkpoint,
        "best_metric": trainer.state.best_metric,
        "epochs_run": trainer.state.epoch,
        "global_step": result.global_step,
        "checkpoints": [p.name for p in sorted(Path(output_dir).glob("checkpoint-*"), key=_step_of) if p.is_dir()],
        "files": sorted(p.name for p in Path(output_dir).iterdir() if p.is_file()),
        "seconds": time.perf_counter() - started,
    }
    _print_summary(out, summary, epochs, output_dir)
    return summary


def _step_of(path: Path) -> int:
    suffix = path.name.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else -1


def _print_summary(out: TextIO, s: dict[str, Any], epochs: int, output_dir: str) -> None:
    stopped = "early stopping" if s["epochs_run"] < epochs else "all epochs"
    rows = [
        ("test accuracy", f"{s['test_accuracy']:.4f}"),
        ("test loss", f"{s['test_loss']:.4f}"),
        ("best checkpoint", f"{s['best_checkpoint']} (eval_accuracy {s['best_metric']:.4f}, loaded)"),
        ("checkpoints kept", ", ".join(s["checkpoints"])),
        ("training", f"{s['global_step']} steps, {s['epochs_run']:.0f} epochs ({stopped})"),
        ("files written", f"{output_dir}: " + ", ".join(s["files"])),
        ("time", f"{s['seconds']:.1f} s"),
    ]
    width = max(len(name) for name, _ in rows)
    out.write("\nSummary\n")
    for name, value in rows:
        out.write(f"  {name:<{width}}  {value}\n")
    out.flush()


def _clear_old_checkpoints(output_dir: str, overwrite: bool) -> None:
    """Old checkpoints would take part in this run's rotation and resume: set them aside, or refuse.

    Set aside, never deleted: they move to ``output_dir/previous-runs/<time>/`` (``directory.set_aside``).
    """
    old = [p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir()]
    if not old:
        return
    if not overwrite:
        names = ", ".join(p.name for p in sorted(old, key=_step_of))
        raise ConfigError(
            f"{output_dir} holds checkpoints of a previous run ({names}); "
            "pass --overwrite-output-dir to move them into previous-runs/, or choose another --output-dir"
        )
    with hold_output_dir(output_dir):  # under the lock: a run writing there (another container's too) is never touched
        folder = set_aside(output_dir)
    print(f"trainbus demo: the previous run's checkpoints moved to {folder}", file=sys.stderr)


def installed_version() -> str:
    """The installed distribution's version (``importlib.metadata``), as ``trainbus.__version__`` gives it."""
    try:
        return importlib.metadata.version("trainbus")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


def build_parser() -> argparse.ArgumentParser:
    """The ``trainbus`` argument parser (subcommands: demo, plot)."""
    parser = argparse.ArgumentParser(prog="trainbus", description="trainbus: a plugin-composed training engine.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {installed_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo = commands.add_parser(
        "demo",
        help="train a small MLP on scikit-learn's digits and show the features at work",
        description="Train an MLP on scikit-learn's digits (no download) through the Trainer facade.",
    )
    demo.add_argument("--output-dir", default="trainbus_demo", help="where checkpoints and logs go")
    demo.add_argument("--epochs", type=int, default=None, help=f"epochs (default {DEMO_EPOCHS}, {QUICK_EPOCHS} quick)")
    demo.add_argument("--quick", action="store_true", help=f"a short run: {QUICK_EPOCHS} epochs")
    demo.add_argument(
        "--overwrite-output-dir",
        action="store_true",
        help="move the checkpoint-* folders a previous run left in --output-dir into previous-runs/ "
        "(else the demo refuses to start)",
    )
    demo.add_argument("--seed", type=int, default=42, help="seed of the split, the model and the data order")
    plot = commands.add_parser(
        "plot",
        help="draw a run's training curves (loss, eval metrics, learning rate, grad norm) as a PNG",
        description="Draw RUN_DIR's curves from its logs.jsonl or newest checkpoint (needs matplotlib).",
    )
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a run's output_dir")
    plot.add_argument("--output", default=None, help="the PNG to write (default RUN_DIR/training_curves.png)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trainbus`` console script; returns the exit status."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "demo":
        epochs = ns.epochs if ns.epochs is not None else (QUICK_EPOCHS if ns.quick else DEMO_EPOCHS)
        if epochs < 1:
            parser.error(f"--epochs must be >= 1, got {epochs}")
        try:
            _clear_old_checkpoints(ns.output_dir, ns.overwrite_output_dir)
            run_demo(ns.output_dir, epochs, ns.seed)
        except ConfigError as exc:
            print(f"trainbus demo: {exc}", file=sys.stderr)
            return 2
    elif ns.command == "plot":
        from ..observability.plots import plot_run

        try:
            print(plot_run(ns.run_dir, ns.output))
        except ConfigError as exc:
            print(f"trainbus plot: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
