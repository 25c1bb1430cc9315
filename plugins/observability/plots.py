"""Training curves as PNG files, with matplotlib (the ``plots`` extra): ``trainbus plot RUN_DIR`` and ``PlotCurves``.

One figure, ``training_curves.png``, with up to four panels: the training loss, the evaluation
metrics (one line per ``eval_*`` value, times and rates left out), the learning rate and the
gradient norm, each against the global step. The records come from a run's ``logs.jsonl`` (the
JSONL sink) or, without it, from the ``log_history`` of its newest checkpoint's ``trainer_state.json``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import check_path

if TYPE_CHECKING:
    from trainbus.engine import Engine, TrainEndEvent

FIGURE = "training_curves.png"
#: keys of eval records that measure time, not the model
_TIMING = ("_runtime", "_samples_per_second", "_steps_per_second")


def read_log_history(run_dir: str | Path) -> list[dict[str, Any]]:
    """A run's log records: ``logs.jsonl``, else the newest checkpoint's ``trainer_state.json``."""
    root = Path(run_dir)
    jsonl = root / "logs.jsonl"
    if jsonl.is_file():
        return [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines() if line.strip()]
    states = sorted(root.glob("checkpoint-*/trainer_state.json"), key=lambda p: int(p.parent.name.split("-")[1]))
    if states:  # the whole history: a long run keeps its older records in segments beside the state
        from ..checkpoints.reading import read_trainer_state

        history = read_trainer_state(states[-1].parent).log_history
        return [dict(r) for r in history if isinstance(r, Mapping)]
    seen = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    raise ConfigError(
        f"no logs in {root}: it needs logs.jsonl (report_to='jsonl') or a checkpoint-*/trainer_state.json; "
        f"found: {seen or 'nothing'}"
    )


def curves(history: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """Panel -> line -> (step, value) points: ``loss``, ``eval``, ``learning_rate``, ``grad_norm``."""
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for record in history:
        step = record.get("step")
        if not isinstance(step, int | float):
            continue
        for key, value in record.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if key in ("loss", "learning_rate", "grad_norm"):
                panel, line = key, key
            elif key.startswith("eval_") and not key.endswith(_TIMING):
                panel, line = "eval", key
            else:
                continue
            panels.setdefault(panel, {}).setdefault(line, []).append((float(step), float(value)))
    return panels


TITLES = {"loss": "training loss", "eval": "evaluation", "learning_rate": "learning rate", "grad_norm": "gradient norm"}


def plot_history(history: Sequence[Mapping[str, Any]], path: str | Path) -> Path:
    """Draw the curves of ``history`` into the PNG ``path``; returns it. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ConfigError("plots need matplotlib: pip install 'trainbus[plots]' (or pip install matplotlib)") from exc
    panels = curves(history)
    if not panels:
        raise ConfigError("the log records hold no loss, eval metric, learning rate or grad norm to plot")
    names = [name for name in TITLES if name in panels]
    columns = 2 if len(names) > 1 else 1
    rows = -(-len(names) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for line, points in panels[name].items():
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, markersize=3, label=line)
        ax.set_title(TITLES[name])
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if name == "eval":
            ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    figure.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=100)
    plt.close(figure)
    return out


def plot_run(run_dir: str | Path, output: str | Path | None = None) -> Path:
    """``trainbus plot RUN_DIR``: the run's curves into ``RUN_DIR/training_curves.png`` (or ``output``)."""
    return plot_history(read_log_history(run_dir), output or Path(run_dir) / FIGURE)


class PlotCurves(Plugin):
    """Writes ``training_curves.png`` into ``output_dir`` at the end of training (main process only).

    Args:
        output_dir: the folder of the figure (the Trainer's output_dir).
        filename: the figure's file name.
    """

    priority = Priority.LAST  # after the logger's closing record

    def __init__(self, output_dir: str | Path, filename: str = FIGURE) -> None:
        try:
            import matplotlib  # noqa: F401  (fail at construction, not after training)
        except ImportError as exc:
            raise ConfigError("PlotCurves needs matplotlib: pip install 'trainbus[plots]'") from exc
        check_path("output_dir", output_dir)
        check_path("filename", filename)
        self.path = Path(output_dir) / filename
        self.written: Path | None = None

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_END, self.draw)

    def draw(self, ev: TrainEndEvent) -> None:
        state = ev.engine.state
        if state.is_world_process_zero and curves(state.log_history):
            self.written = plot_history(state.log_history, self.path)


__all__ = ["FIGURE", "PlotCurves", "curves", "plot_history", "plot_run", "read_log_history"]
