"""Extractive QA with a ``QuestionAnsweringTrainer`` subclass (overridden evaluate / predict): transformers.Trainer
vs trainbus, with evaluation every few steps choosing the best checkpoint by the subclass's F1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import run_qa
from families import BERT, listing, qa_rows, resume_differences
from harness import assert_same, check_losses_logged, common_argv, run_both, write_json_lines, write_tokenizer

#: evaluation (by the subclass) and a save every 4 steps, the best by F1 loaded at the end. 20 steps: the last
#: is an evaluation step under transformers 4 too (4.x does not evaluate an off-schedule last step, 5.x does)
BEST_BY_F1 = {
    "eval_strategy": "steps", "eval_steps": 4, "save_strategy": "steps", "save_steps": 4, "save_total_limit": 2,
    "load_best_model_at_end": True, "metric_for_best_model": "f1", "num_train_epochs": 2,
}  # fmt: skip


def argv_for(tmp_path: Path, dropout: float, **overrides: object):
    rows = qa_rows(42, seed=5)
    files = {
        split: write_json_lines(tmp_path / f"{split}.json", part)
        for split, part in (("train", rows[:24]), ("validation", rows[24:34]), ("test", rows[34:]))
    }
    tokenizer = write_tokenizer(tmp_path / "tokenizer", [r["question"] + " " + r["context"] for r in rows])

    def argv(name: str) -> list[str]:
        arguments = {**BEST_BY_F1, **overrides}
        return common_argv(
            tmp_path / name, tokenizer_name=tokenizer, config_overrides=BERT, dropout=dropout,
            cache_dir=tmp_path / f"cache-{name}", train_file=files["train"], validation_file=files["validation"],
            test_file=files["test"], **arguments,
        )  # fmt: skip

    return argv


def test_qa_matches_transformers(tmp_path: Path) -> None:
    hf, tb = run_both(run_qa.main, argv_for(tmp_path, 0.1))
    check_losses_logged(hf)
    # the comparison has teeth: the subclass's metrics were logged during training and chose a checkpoint
    state = json.loads((hf.output_dir / "trainer_state.json").read_text())
    f1 = [r["eval_f1"] for r in state["log_history"] if "eval_f1" in r]
    assert len(f1) >= 3 and len(set(f1)) > 1, f"transformers' eval F1 over training: {f1}"
    assert state["best_model_checkpoint"] is not None and state["best_metric"] == max(f1)
    assert "eval_predictions.json" in hf.files and "predict_predictions.json" in hf.files
    assert_same(hf, tb)
    tb_state = json.loads((tb.output_dir / "trainer_state.json").read_text())
    for key in ("best_metric", "best_global_step"):
        assert tb_state.get(key) == pytest.approx(state.get(key)), f"{key}: {state.get(key)} vs {tb_state.get(key)}"
    assert Path(tb_state["best_model_checkpoint"]).name == Path(state["best_model_checkpoint"]).name


def test_qa_early_stopping_matches_transformers(tmp_path: Path) -> None:
    """transformers' EarlyStoppingCallback reads the subclass's F1 (its evaluate() is the only evaluation):
    training stops after an evaluation without a better F1, at the same step, and the best is loaded."""
    hf, tb = run_both(run_qa.main, argv_for(tmp_path, 0.1, early_stopping_patience=1))
    check_losses_logged(hf)
    state = json.loads((hf.output_dir / "trainer_state.json").read_text())
    assert state["global_step"] < state["max_steps"], "transformers did not stop early: the test has no teeth"
    assert_same(hf, tb)
    assert json.loads((tb.output_dir / "trainer_state.json").read_text())["global_step"] == state["global_step"]


def test_qa_save_best_matches_transformers(tmp_path: Path) -> None:
    """``save_strategy="best"``: a checkpoint only where the subclass's F1 is a new best, and the best loaded
    at the end. transformers before 5.x's fix leaves ``best_model_checkpoint`` None there (4.57, 5.0), so
    nothing is loaded: its run is then no reference, and trainbus's is pinned by its own logged F1."""
    hf, tb = run_both(run_qa.main, argv_for(tmp_path, 0.1, save_strategy="best"))
    check_losses_logged(hf)
    if json.loads((hf.output_dir / "trainer_state.json").read_text())["best_model_checkpoint"] is not None:
        assert_same(hf, tb)
    state = json.loads((tb.output_dir / "trainer_state.json").read_text())
    f1 = [(r["step"], r["eval_f1"]) for r in state["log_history"] if "eval_f1" in r]
    new_best = [step for i, (step, value) in enumerate(f1) if all(value > earlier for _, earlier in f1[:i])]
    saved = sorted(int(name.split("/")[0].split("-")[1]) for name in tb.files if name.endswith("/trainer_state.json"))
    assert len(new_best) >= 2 and new_best[-1] < state["global_step"], f"F1 over training {f1}: no teeth"
    assert saved == new_best[-2:], f"trainbus saved at steps {saved}, new best F1 at {new_best} (save_total_limit 2)"
    assert state["best_model_checkpoint"].endswith(f"checkpoint-{new_best[-1]}")
    assert tb.eval_metrics["eval_f1"] == state["best_metric"] == max(value for _, value in f1)


def test_qa_resume_matches_transformers(tmp_path: Path) -> None:
    """Resumed from checkpoint-8 (mid-epoch, with a best metric already recorded) in a fresh output_dir."""
    argv = argv_for(tmp_path, 0.1, save_total_limit=8)  # checkpoint-8 outlives the rotation
    found, runs = resume_differences(run_qa.main, argv, tmp_path, step=8)
    check_losses_logged(runs["transformers"][1])
    assert not found, listing(found)
