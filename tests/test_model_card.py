"""The model card: README.md next to the saved model, with results, curves, data sizes, arguments, versions."""

from __future__ import annotations

from pathlib import Path

import torch
from facade_helpers import Regressor, quiet_args, regression_data

from trainbus.plugins import Trainer
from trainbus.plugins.facade.model_card import results_table, write_model_card


def test_model_card_describes_the_run(tmp_path: Path) -> None:
    args = quiet_args(tmp_path, max_steps=6, logging_steps=2, eval_strategy="steps", eval_steps=3,
                      learning_rate=0.05, gradient_accumulation_steps=2)  # fmt: skip
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(24), eval_dataset=regression_data(8))
    trainer.train()
    trainer.save_model()
    saved_card = (tmp_path / "README.md").read_text()  # save_model writes the card
    rows = [line for line in saved_card.splitlines() if line.startswith("| ") and "Training Loss" not in line]
    evals = [r for r in trainer.state.log_history if "eval_loss" in r]
    losses = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == len(evals) == 2
    for row, record in zip(rows, evals):  # each row: the loss logged before that evaluation, and its metrics
        cells = [c.strip() for c in row.strip("|").split("|")]
        before = [r["loss"] for r in losses if r["step"] <= record["step"]][-1]
        assert cells == [f"{before:.4g}", f"{record['epoch']:.4g}", str(record["step"]), f"{record['eval_loss']:.4g}"]
    card = write_model_card(trainer, model_name="tiny-regressor", license="apache-2.0", tags=["regression"],
                            finetuned_from="nothing/scratch")  # fmt: skip
    text = card.read_text()
    assert card == tmp_path / "README.md"
    assert text.startswith('---\nlibrary_name: "trainbus"\ntags: ["trainbus", "regression"]')
    assert (
        'license: "apache-2.0"' in text
        and "# tiny-regressor" in text
        and "fine-tuned version of nothing/scratch" in text
    )
    final = [r for r in trainer.state.log_history if "eval_loss" in r][-1]
    assert f"- Loss: {final['eval_loss']:.4g}" in text
    assert "- training samples: 24" in text and "- evaluation samples: 8" in text
    assert "- learning_rate: 0.05" in text and "- gradient_accumulation_steps: 2" in text
    assert "- total train batch size: 8" in text
    assert "| Training Loss | Epoch | Step | Loss |" in text and text.count("\n| ") >= 3
    assert "![training curves](training_curves.png)" in text and (tmp_path / "training_curves.png").is_file()
    assert f"- torch {torch.__version__}" in text and "- trainbus " in text
    assert (tmp_path / "model.safetensors").is_file()  # the card sits next to the saved model


def test_results_table_rows_follow_the_evaluations() -> None:
    history = [
        {"loss": 2.0, "epoch": 0.5, "step": 1},
        {"eval_loss": 1.5, "eval_accuracy": 0.25, "eval_runtime": 0.1, "epoch": 0.5, "step": 1},
        {"eval_loss": 1.0, "eval_accuracy": 0.5, "epoch": 1.0, "step": 2},
    ]
    assert results_table(history) == [
        "| Training Loss | Epoch | Step | Loss | Accuracy |",
        "|---|---|---|---|---|",
        "| 2 | 0.5 | 1 | 1.5 | 0.25 |",  # floats to 4 significant digits
        "| 2 | 1 | 2 | 1 | 0.5 |",
    ]
    assert results_table([{"loss": 1.0, "step": 1}]) == []
