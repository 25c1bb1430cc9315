"""Training curves: read from a run's logs, drawn with matplotlib, by the CLI and by the plugin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from facade_helpers import Regressor, quiet_args, regression_data

from trainbus.engine import ConfigError
from trainbus.plugins import PlotCurves, Trainer
from trainbus.plugins.cli.demo import main
from trainbus.plugins.observability.plots import curves, read_log_history

PNG = b"\x89PNG\r\n\x1a\n"
HISTORY = [
    {"loss": 2.0, "grad_norm": 1.5, "learning_rate": 0.1, "epoch": 0.5, "step": 1},
    {"loss": 1.0, "grad_norm": 0.5, "learning_rate": 0.05, "epoch": 1.0, "step": 2},
    {"eval_loss": 1.2, "eval_accuracy": 0.5, "eval_runtime": 0.1, "eval_samples_per_second": 9.0, "step": 2},
    {"train_runtime": 1.0, "train_loss": 1.5, "step": 2},
]


def test_curves_take_losses_eval_metrics_lr_and_grad_norm_but_no_timings() -> None:
    panels = curves(HISTORY)
    assert panels["loss"] == {"loss": [(1.0, 2.0), (2.0, 1.0)]}
    assert panels["eval"] == {"eval_loss": [(2.0, 1.2)], "eval_accuracy": [(2.0, 0.5)]}
    assert panels["learning_rate"]["learning_rate"][-1] == (2.0, 0.05)
    assert set(panels) == {"loss", "eval", "learning_rate", "grad_norm"}


def test_trainer_run_is_plotted_by_the_plugin_and_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = quiet_args(tmp_path, max_steps=6, logging_steps=2, eval_strategy="steps", eval_steps=3,
                      report_to=["jsonl"], save_strategy="steps", save_steps=3)  # fmt: skip
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(24), eval_dataset=regression_data(8),
                      callbacks=[PlotCurves(tmp_path)])  # fmt: skip
    trainer.train()
    figure = tmp_path / "training_curves.png"
    assert figure.read_bytes()[:8] == PNG and figure.stat().st_size > 5000
    assert_four_drawn_panels(figure)
    figure.unlink()
    capsys.readouterr()  # the training's printed logs
    assert main(["plot", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(figure) and figure.read_bytes()[:8] == PNG
    # without logs.jsonl the newest checkpoint's log_history is read
    (tmp_path / "logs.jsonl").unlink()
    history = read_log_history(tmp_path)
    assert [r["step"] for r in history if "loss" in r] == [2, 4, 6]
    assert main(["plot", str(tmp_path), "--output", str(tmp_path / "other.png")]) == 0
    assert (tmp_path / "other.png").read_bytes()[:8] == PNG


def assert_four_drawn_panels(figure: Path) -> None:
    """The PNG is the 2 x 2 figure (loss, eval, lr, grad norm) with lines drawn in every panel."""
    import matplotlib.image

    pixels = matplotlib.image.imread(str(figure))
    height, width = pixels.shape[:2]
    assert (width, height) == (1200, 720)
    for top in (0, height // 2):
        for left in (0, width // 2):
            panel = pixels[top + 60 : top + height // 2 - 60, left + 90 : left + width // 2 - 30, :3]
            blue = (panel[..., 2] > 0.6) & (panel[..., 0] < 0.3)  # matplotlib's first line colour
            assert blue.sum() > 100, f"no curve in the panel at {(top, left)}"


def test_plot_of_a_folder_without_logs_says_what_it_needs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path / "missing")]) == 2
    missing = capsys.readouterr().err
    assert "no logs in" in missing and "found: nothing" in missing
    (tmp_path / "notes.txt").write_text("x")
    assert main(["plot", str(tmp_path)]) == 2
    assert "needs logs.jsonl (report_to='jsonl') or a checkpoint-*/trainer_state.json; found: ['notes.txt']" in (
        capsys.readouterr().err
    )
    (tmp_path / "logs.jsonl").write_text(json.dumps({"epoch": 1.0, "step": 1}) + "\n")
    with pytest.raises(ConfigError, match="no loss, eval metric"):
        from trainbus.plugins import plot_run

        plot_run(tmp_path)
    assert torch.get_num_threads() >= 1


def test_a_long_run_is_read_whole_from_its_checkpoint(tmp_path: Path) -> None:
    """Without logs.jsonl the newest checkpoint is read, with the older records it keeps in segments."""
    args = quiet_args(tmp_path, max_steps=300, logging_steps=1, save_strategy="steps", save_steps=300,
                      per_device_train_batch_size=1)  # fmt: skip
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(8))
    trainer.train()
    assert list(tmp_path.glob("checkpoint-300/log_history-*.json"))  # the history is segmented
    history = read_log_history(tmp_path)
    assert [r.get("step") for r in history if "loss" in r] == list(range(1, 301))
