"""Best-model scenarios of transformers' test_trainer_checkpointing.py (TrainerBestModelTest) not ported before.

transformers' tests decide the best checkpoint with metrics forced through ``patch.object(trainer, "_evaluate",
side_effect=...)`` on the instance, and read the best model back with ``from_pretrained``. Both are ported
here as they are written: a ported test suite patches the same private method.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from unittest.mock import patch

import pytest
import safetensors.torch
import torch
from hf_diff import (
    AlmostAccuracy,
    RegressionModel,
    RegressionPreTrainedModel,
    assert_same_weights,
    checkpoint_names,
    read_state,
    regression_trainer,
    run_both,
)

CASE_4_REASON = (
    "evaluated each epoch, saved every step: trainbus sets best_model_checkpoint only when it saves at the best "
    "evaluation, transformers links the best step's checkpoint-8 (plugins/checkpoints/checkpoint.py; NOTES.md, "
    "helper-ckpt)"
)


def _forced(values):
    """The metrics each evaluation returns, the last one repeated (transformers' evaluate_side_effect_factory)."""
    return itertools.chain(values, itertools.repeat(values[-1]))


SAVE_BEST_CASES = {
    "accuracy": ("accuracy", [(0.03, 0.60), (0.02, 0.65), (0.01, 0.64)]),
    "loss": ("loss", [(0.03, 0.60), (0.02, 0.65), (0.03, 0.66)]),
}


@pytest.mark.parametrize("case", list(SAVE_BEST_CASES))
def test_save_best_forced_metrics__mirrors_test_save_best_checkpoint(tmp_path, case):
    metric, values = SAVE_BEST_CASES[case]
    forced = [{"eval_loss": loss, "eval_accuracy": acc, "epoch": float(i + 1)} for i, (loss, acc) in enumerate(values)]

    def scenario(impl, d):
        trainer = regression_trainer(
            impl,
            d,
            a=1.5,
            b=2.5,
            learning_rate=0.1,
            eval_strategy="epoch",
            save_strategy="best",
            metric_for_best_model=metric,
            trainer_kwargs={"compute_metrics": AlmostAccuracy()},
        )
        with patch.object(trainer, "_evaluate", side_effect=list(forced)):
            trainer.train()
        return sorted(os.listdir(d)), trainer.state.best_metric

    hf, tb = run_both(scenario, tmp_path)
    # epochs 1 and 2 improve the metric, epoch 3 does not: two checkpoints, the first two epochs'
    assert hf == (["checkpoint-16", "checkpoint-8"], 0.65 if metric == "accuracy" else 0.02)
    assert tb == hf


BEHAVIOR_CASES = {
    # case: (arguments, forced accuracies, (best_metric, best_global_step, best checkpoint name, checkpoints))
    "3_eval_and_save_each_epoch": (
        {"eval_strategy": "epoch", "save_strategy": "epoch"},
        [0.59, 0.57, 0.55],
        (0.59, 8, "checkpoint-8", 3),
    ),
    "4_eval_each_epoch_save_each_step": (
        {"eval_strategy": "epoch", "save_strategy": "steps", "save_steps": 1},
        [0.59, 0.57, 0.55],
        (0.59, 8, "checkpoint-8", 24),
    ),
    "5_eval_and_save_each_step_limit_1": (
        {"eval_strategy": "steps", "eval_steps": 1, "save_steps": 1, "save_total_limit": 1},
        [0.90, 0.80, 0.70],
        (0.90, 1, "checkpoint-1", 1),
    ),
    "6_eval_every_3_save_every_2": (
        {"eval_strategy": "steps", "eval_steps": 3, "save_steps": 2},
        [0.90, 0.80, 0.70],
        (0.90, 3, None, 12),
    ),
}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, marks=pytest.mark.xfail(strict=True, reason=CASE_4_REASON))
        if case.startswith("4_")
        else case
        for case in BEHAVIOR_CASES
    ],
)
def test_best_checkpoint_forced_metrics__mirrors_test_best_model_checkpoint_behavior(tmp_path, case):
    kwargs, accuracies, expected = BEHAVIOR_CASES[case]

    def scenario(impl, d):
        trainer = regression_trainer(
            impl,
            d,
            metric_for_best_model="accuracy",
            greater_is_better=True,
            trainer_kwargs={"compute_metrics": AlmostAccuracy()},
            **kwargs,
        )
        with patch.object(trainer, "_evaluate", side_effect=_forced([{"eval_accuracy": v} for v in accuracies])):
            trainer.train()
        state = trainer.state
        best = state.best_model_checkpoint
        return state.best_metric, state.best_global_step, best and os.path.relpath(best, d), len(os.listdir(d))

    hf, tb = run_both(scenario, tmp_path)
    assert hf == expected
    assert tb == hf


BEST_LOADED_CASES = {
    "eval_loss_pretrained": ({}, "eval_loss", True),
    "accuracy_pretrained": ({"metric_for_best_model": "accuracy"}, "eval_accuracy", True),
    "eval_loss_plain_module": ({}, "eval_loss", False),
}


@pytest.mark.parametrize("case", list(BEST_LOADED_CASES))
def test_best_model_read_back__mirrors_test_load_best_model_at_end(tmp_path, case):
    """Also test_load_best_model_from_safetensors: the model in memory after training is the best checkpoint's
    model.safetensors as from_pretrained (or load_state_dict) reads it, and it evaluates to the best value."""
    kwargs, metric, pretrained = BEST_LOADED_CASES[case]
    greater = metric == "eval_accuracy"

    def scenario(impl, d):
        trainer = regression_trainer(
            impl,
            d,
            a=1.5,
            b=2.5,
            learning_rate=0.1,
            eval_steps=5,
            eval_strategy="steps",
            save_steps=5,
            load_best_model_at_end=True,
            pretrained=pretrained,
            trainer_kwargs={"compute_metrics": AlmostAccuracy()} if greater else None,
            **kwargs,
        )
        trainer.train()
        history = read_state(d / "checkpoint-24")["log_history"]
        values = [r[metric] for r in history if metric in r]
        eval_steps = [r["step"] for r in history if metric in r]
        best_step = eval_steps[values.index((max if greater else min)(values))]
        folder = d / f"checkpoint-{best_step}"
        if pretrained:
            best = RegressionPreTrainedModel.from_pretrained(str(folder))
        else:
            best = RegressionModel()
            best.load_state_dict(safetensors.torch.load_file(str(folder / "model.safetensors")))
        torch.testing.assert_close(best.a, trainer.model.a)
        torch.testing.assert_close(best.b, trainer.model.b)
        return best_step, trainer.evaluate()[metric] == (max if greater else min)(values), checkpoint_names(d), trainer

    (hf_step, hf_ok, hf_names, hf), (tb_step, tb_ok, tb_names, tb) = run_both(scenario, tmp_path)
    assert hf_ok and tb_ok
    assert hf_step == tb_step
    assert hf_names == tb_names
    assert_same_weights(hf.model, tb.model)
    assert Path(hf.state.best_model_checkpoint).name == Path(tb.state.best_model_checkpoint).name
