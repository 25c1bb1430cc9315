"""The Trainer's methods that compose other modules: hyperparameter_search, create_model_card, save_model with EMA."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import safetensors.torch as st
import torch
from facade_helpers import Regressor, quiet_args, regression_data

from trainbus.plugins import EMA, Trainer
from trainbus.plugins.facade.search import BestRun


def test_hyperparameter_search_is_a_trainer_method_and_model_init_may_take_the_trial(tmp_path: Path) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    calls: list[Any] = []

    def model_init(trial: Any) -> torch.nn.Module:  # HF's usual signature: None outside a search
        calls.append(trial)
        return Regressor()

    args = quiet_args(tmp_path, max_steps=4, eval_strategy="steps", eval_steps=2, report_to="none")
    trainer = Trainer(model_init=model_init, args=args, train_dataset=regression_data(16),
                      eval_dataset=regression_data(8, 1))  # fmt: skip
    assert calls == [None]
    best = trainer.hyperparameter_search(
        hp_space=lambda t: {"learning_rate": t.suggest_float("learning_rate", 1e-3, 1e-1, log=True)},
        n_trials=2, sampler=optuna.samplers.TPESampler(seed=0),
    )  # fmt: skip
    assert isinstance(best, BestRun) and "learning_rate" in best.hyperparameters
    assert [type(c).__name__ for c in calls[1:]] == ["Trial", "Trial"]
    assert len(best.run_summary.trials) == 2  # the optuna study


def test_create_model_card_writes_readme_next_to_the_model(tmp_path: Path) -> None:
    args = quiet_args(tmp_path, max_steps=2, logging_steps=1)
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(8))
    trainer.train()
    trainer.save_model()
    trainer.create_model_card(model_name="regressor")
    assert "# regressor" in (tmp_path / "README.md").read_text().splitlines()


def test_save_model_writes_the_ema_weights(tmp_path: Path) -> None:
    for save_averaged in (True, False):
        out = tmp_path / str(save_averaged)
        ema = EMA(decay=0.5, warmup=False, save_averaged=save_averaged)
        args = quiet_args(out, max_steps=4, learning_rate=0.1)
        trainer = Trainer(Regressor(), args, train_dataset=regression_data(16), callbacks=[ema])
        trainer.train()
        trainer.save_model()
        saved = st.load_file(str(out / "model.safetensors"))
        expected = ema.averaged_state_dict() if save_averaged else trainer.model.state_dict()
        assert sorted(saved) == sorted(expected)
        for key, value in saved.items():
            assert torch.equal(value, expected[key]), key
        averaged = ema.averaged_state_dict()
        assert any(not torch.equal(averaged[k], v) for k, v in trainer.model.state_dict().items())
