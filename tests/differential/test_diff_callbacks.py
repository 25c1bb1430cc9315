"""Callback and control-flow scenarios of transformers' test_trainer_callback.py (and test_trainer.py's early
stopping): the exact event order, control flags, stopping, early stopping, callback state on resume."""

from __future__ import annotations

import hf_release
import pytest
from hf_diff import AlmostAccuracy, regression_trainer, run_both, with_newest_flow

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_substep_end",
    "on_step_end",
    "on_evaluate",
    "on_predict",
    "on_save",
    "on_log",
    "on_prediction_step",
)


def recorder(base):
    """A callback of ``base`` (the implementation's TrainerCallback) that records every event it gets."""

    def record(name):
        def method(self, args, state, control, **kwargs):
            self.events.append(name)

        return method

    namespace = {name: record(name) for name in EVENTS}
    namespace["__init__"] = lambda self: setattr(self, "events", [])
    return type("EventRecorder", (base,), namespace)()


FLOW_CONFIGS = {
    "defaults": {},
    "logging_steps_5": {"logging_steps": 5},
    "save_steps_5": {"save_steps": 5},
    "eval_steps_5": {"eval_steps": 5, "eval_strategy": "steps"},
    "eval_epoch": {"eval_strategy": "epoch"},
    "everything": {"logging_steps": 3, "save_steps": 10, "eval_steps": 5, "eval_strategy": "steps"},
}


@pytest.mark.parametrize("config", list(FLOW_CONFIGS))
def test_event_order__mirrors_test_event_flow(tmp_path, config):
    def scenario(impl, d):
        cb = recorder(impl.TrainerCallback)
        trainer = regression_trainer(impl, d, trainer_kwargs={"callbacks": [cb]}, **FLOW_CONFIGS[config])
        with_newest_flow(impl, trainer).train()
        return cb.events

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb
    assert tb[:2] == ["on_init_end", "on_train_begin"] and tb[-2:] == ["on_log", "on_train_end"]


def test_last_step_evaluation_by_release(tmp_path):
    """24 steps, eval_steps 5: the newest transformers also evaluates after step 24 (no multiple of 5), 4.57 - 5.0
    do not; trainbus does, on every release (as the newest). The steps evaluated, by an independent rule."""

    def scenario(impl, d):
        trainer = regression_trainer(impl, d, eval_strategy="steps", eval_steps=5, save_strategy="no")
        trainer.train()
        return [r["step"] for r in trainer.state.log_history if "eval_loss" in r]

    hf, tb = run_both(scenario, tmp_path)
    multiples = [5, 10, 15, 20]
    assert tb == [*multiples, 24]
    assert hf == ([*multiples, 24] if hf_release.evaluates_after_last_step() else multiples)


def test_stop_from_callback__mirrors_test_callback_can_stop_training(tmp_path):
    def scenario(impl, d):
        class Stop(impl.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step >= 1:
                    control.should_training_stop = True
                return control

        trainer = regression_trainer(
            impl, d, max_steps=10, logging_steps=1, save_strategy="no", trainer_kwargs={"callbacks": [Stop()]}
        )
        trainer.train()
        return trainer.state.global_step, [sorted(r) for r in trainer.state.log_history]

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb and tb[0] == 1


def test_flags_seen_at_step_end__mirrors_test_callback_receives_control_flags(tmp_path):
    def scenario(impl, d):
        class Flags(impl.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                self.seen.append((state.global_step, control.should_log, control.should_save, control.should_evaluate))

        cb = Flags()
        cb.seen = []  # set on the instance: the base class's __init__ differs between implementations
        trainer = regression_trainer(
            impl, d, max_steps=4, logging_steps=2, save_steps=3, trainer_kwargs={"callbacks": [cb]}
        )
        trainer.train()
        return cb.seen

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb and len(tb) == 4


def test_one_save_per_epoch__mirrors_test_no_duplicate_save_on_epoch_strategy(tmp_path):
    def scenario(impl, d):
        class Count(impl.TrainerCallback):
            saves = 0

            def on_step_end(self, args, state, control, **kwargs):
                self.saves += bool(control.should_save)

            def on_epoch_end(self, args, state, control, **kwargs):
                self.saves += bool(control.should_save)

        cb = Count()
        regression_trainer(impl, d, max_steps=2, save_strategy="epoch", trainer_kwargs={"callbacks": [cb]}).train()
        return cb.saves

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb == 1


def test_add_pop_remove__mirrors_test_add_remove_callback(tmp_path):
    def scenario(impl, d):
        trainer = regression_trainer(impl, d, max_steps=2)
        first, second = recorder(impl.TrainerCallback), recorder(impl.TrainerCallback)
        trainer.add_callback(first)
        trainer.add_callback(second)
        popped = trainer.pop_callback(first)
        trainer.remove_callback(second)
        absent = trainer.pop_callback(first)  # no longer there
        trainer.train()
        return popped is first, absent, first.events, second.events

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb == (True, None, [], [])


@pytest.mark.parametrize("load_best", [True, False])
def test_early_stopping__mirrors_test_early_stopping_callback(tmp_path, load_best):
    def scenario(impl, d):
        trainer = regression_trainer(
            impl,
            d,
            num_train_epochs=20,
            per_device_train_batch_size=16,
            load_best_model_at_end=load_best,
            eval_strategy="epoch",
            save_strategy="epoch",
            metric_for_best_model="accuracy",
            trainer_kwargs={"compute_metrics": AlmostAccuracy()},
        )
        trainer.add_callback(impl.EarlyStoppingCallback(1, 0.0001))
        output = trainer.train()
        best = trainer.state.best_model_checkpoint
        return output.global_step, trainer.state.best_metric, best and best.rsplit("/", 1)[-1]

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb
    assert tb[0] < 20 * 64 / 16 and tb[2] is not None  # stopped early; the best checkpoint is known either way


@pytest.mark.parametrize(
    ("best", "value", "threshold", "counter"),
    [(0.9, 0.8, 0.0, 1), (0.8, 0.95, 0.0, 0), (0.8, 0.85, 0.1, 1)],
    ids=["worse", "better", "within_threshold"],
)
def test_patience_counter__mirrors_EarlyStoppingCallbackTest(tmp_path, best, value, threshold, counter):
    def scenario(impl, d):
        callback = impl.EarlyStoppingCallback(early_stopping_patience=3, early_stopping_threshold=threshold)
        callback.early_stopping_patience_counter = 2 if counter == 0 else 0
        trainer = regression_trainer(impl, d, max_steps=1)
        trainer.state.best_metric = best
        args = impl.args(d, greater_is_better=True, metric_for_best_model="accuracy", eval_strategy="no")
        callback.check_metric_value(args, trainer.state, trainer.control, value)
        return callback.early_stopping_patience_counter, callback.state()

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb and tb[0] == counter


def test_early_stopping_state_restored__mirrors_test_early_stopping_state_persists(tmp_path):
    def scenario(impl, d):
        common = {
            "load_best_model_at_end": True,
            "save_strategy": "steps",
            "eval_strategy": "steps",
            "save_steps": 2,
            "eval_steps": 2,
            "max_steps": 2,
        }
        first = impl.EarlyStoppingCallback(early_stopping_patience=5, early_stopping_threshold=0.2)
        regression_trainer(impl, d, trainer_kwargs={"callbacks": [first]}, **common).train()
        fresh = impl.EarlyStoppingCallback()
        trainer = regression_trainer(
            impl, d, trainer_kwargs={"callbacks": [fresh]}, restore_callback_states_from_checkpoint=True, **common
        )
        trainer.train(resume_from_checkpoint=str(d / "checkpoint-2"))
        restored = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, impl.EarlyStoppingCallback)]
        return [(cb.early_stopping_patience, cb.early_stopping_threshold) for cb in restored]

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb == [(5, 0.2)]
