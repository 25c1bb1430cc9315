"""HF TrainerCallback compatibility: event order, kwargs, returned control, transformers' own callbacks."""

from __future__ import annotations

import contextlib
import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from facade_helpers import HF_EVENTS, RecordingCallback, Regressor, quiet_args, regression_data
from hypothesis import given, settings
from hypothesis import strategies as st

from trainbus.engine import Event
from trainbus.plugins.facade.callbacks import CallbackAdapter, TrainerCallback
from trainbus.plugins.facade.early_stopping_callback import EarlyStoppingCallback
from trainbus.plugins.facade.trainer import Trainer


def hf_reference(
    batches: int, k: int, epochs: int, log_every: int, eval_every: int, save_every: int, eval_batches: int
) -> list[str]:
    """The callback sequence HF documents for a run with steps eval/save strategies and logging."""
    names = ["on_init_end", "on_train_begin"]
    per_epoch = math.ceil(batches / k)
    max_steps = per_epoch * epochs
    step = 0
    for _ in range(epochs):
        names.append("on_epoch_begin")
        for w in range(per_epoch):
            size = min(k, batches - w * k)
            names.append("on_step_begin")
            names += ["on_substep_end"] * (size - 1)
            names += ["on_pre_optimizer_step", "on_optimizer_step"]
            step += 1
            names.append("on_step_end")
            if step % log_every == 0:
                names.append("on_log")
            if step % eval_every == 0 or step == max_steps:
                names += ["on_prediction_step"] * eval_batches + ["on_log", "on_evaluate"]
            if step % save_every == 0 or step == max_steps:
                names.append("on_save")
        names.append("on_epoch_end")
    return [*names, "on_log", "on_train_end"]


def run_trace(tmp_path: Any, n: int, bs: int, k: int, epochs: int, log: int, ev: int, save: int) -> list[str]:
    rec = RecordingCallback()
    args = quiet_args(
        tmp_path,
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=k,
        num_train_epochs=epochs,
        logging_steps=log,
        eval_strategy="steps",
        eval_steps=ev,
        save_strategy="steps",
        save_steps=save,
        per_device_eval_batch_size=2,
    )
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(n), eval_dataset=regression_data(3, 1))
    trainer.add_callback(rec)
    rec.names.append("on_init_end")  # added after __init__: on_init_end already fired
    trainer.train()
    return rec.names


def test_trace_equals_documented_sequence(tmp_path: Any) -> None:
    names = run_trace(tmp_path, n=10, bs=2, k=2, epochs=2, log=1, ev=2, save=2)
    assert names == hf_reference(5, 2, 2, 1, 2, 2, eval_batches=2)


def test_trace_equals_transformers_trainer(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")

    class Rec(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.names: list[str] = []

    rec_hf = Rec()
    for name in HF_EVENTS:
        setattr(Rec, name, (lambda n: lambda self, a, s, c, **kw: self.names.append(n))(name))
    common: dict[str, Any] = dict(
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=True,
        report_to="none",
    )
    data, eval_data = regression_data(10), regression_data(3, 1)
    hf_args = transformers.TrainingArguments(str(tmp_path / "hf"), **common)
    transformers.Trainer(Regressor(), hf_args, train_dataset=data, eval_dataset=eval_data, callbacks=[rec_hf]).train()
    ours = Rec()
    args = quiet_args(tmp_path / "tb", **common)
    Trainer(Regressor(), args, train_dataset=data, eval_dataset=eval_data, callbacks=[ours]).train()
    assert ours.names == rec_hf.names


@settings(max_examples=12)
@given(
    n=st.integers(1, 9),
    bs=st.integers(1, 3),
    k=st.integers(1, 3),
    epochs=st.integers(1, 2),
    log=st.integers(1, 3),
    ev=st.integers(1, 3),
    save=st.integers(1, 4),
)
def test_trace_matches_reference_for_any_config(
    tmp_path_factory: Any, n: int, bs: int, k: int, epochs: int, log: int, ev: int, save: int
) -> None:
    names = run_trace(tmp_path_factory.mktemp("t"), n, bs, k, epochs, log, ev, save)
    batches = math.ceil(n / bs)
    assert names == hf_reference(batches, k, epochs, log, ev, save, eval_batches=2)


def test_kwargs_are_hf_kwargs(tmp_path: Any) -> None:
    rec = RecordingCallback()
    args = quiet_args(tmp_path, max_steps=2, logging_steps=1, eval_strategy="steps", eval_steps=2)
    trainer = Trainer(
        Regressor(), args, train_dataset=regression_data(8), eval_dataset=regression_data(4), callbacks=[rec]
    )
    trainer.train()
    base = {"model", "processing_class", "optimizer", "lr_scheduler", "train_dataloader", "eval_dataloader"}
    assert rec.kwargs["on_step_end"] == base
    assert rec.kwargs["on_log"] == base | {"logs"}
    assert rec.kwargs["on_evaluate"] == base | {"metrics"}


def test_kwargs_values(tmp_path: Any) -> None:
    seen: dict[str, Any] = {}

    class Check(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            seen.update(kw)

        def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kw: Any) -> None:
            seen["metrics"] = dict(metrics)

    args = quiet_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=2)
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(8), eval_dataset=regression_data(4))
    trainer.add_callback(Check)
    trainer.train()
    assert seen["model"] is trainer.model
    assert seen["optimizer"] is trainer.optimizer
    assert seen["lr_scheduler"] is trainer.lr_scheduler and seen["lr_scheduler"] is not None
    assert seen["train_dataloader"] is trainer.train_data
    assert "eval_loss" in seen["metrics"]


def test_user_callback_stops_training(tmp_path: Any) -> None:
    class StopAt3(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 3:
                control.should_training_stop = True

    args = quiet_args(tmp_path, max_steps=10)
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(40), callbacks=[StopAt3()])
    assert trainer.train().global_step == 3


def test_returned_control_object_is_honoured(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")

    class ReturnsNew:
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
            new = transformers.TrainerControl()
            new.should_training_stop = state.global_step == 2
            return new

    args = quiet_args(tmp_path, max_steps=10)
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(40), callbacks=[ReturnsNew()])
    assert trainer.train().global_step == 2


def test_callback_can_cancel_flow_flags(tmp_path: Any) -> None:
    """Flow sets flags at PRODUCER priority; an HF callback's on_step_end can still clear them."""

    class NoLogs(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            control.should_log = False

    args = quiet_args(tmp_path, max_steps=4, logging_steps=1)
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(16), callbacks=[NoLogs])
    trainer.train()
    assert [h for h in trainer.state.log_history if "loss" in h] == []


def _early_stop_args(tmp_path: Any, lib: Any) -> dict[str, Any]:
    return dict(
        max_steps=10,
        learning_rate=0.0,  # the eval loss never improves: stop after `patience` evaluations
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="no",
        metric_for_best_model="loss",
        per_device_train_batch_size=2,
        disable_tqdm=True,
        use_cpu=True,
        report_to="none",
    )


def test_transformers_early_stopping_callback_runs_unchanged(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    data, eval_data = regression_data(40), regression_data(4, 1)
    kwargs = _early_stop_args(tmp_path, transformers)
    hf = transformers.Trainer(
        Regressor(),
        transformers.TrainingArguments(str(tmp_path / "hf"), **kwargs),
        train_dataset=data,
        eval_dataset=eval_data,
        callbacks=[transformers.EarlyStoppingCallback(early_stopping_patience=2)],
    )
    hf_steps = hf.train().global_step
    ours = Trainer(
        Regressor(),
        quiet_args(tmp_path / "tb", **kwargs),
        train_dataset=data,
        eval_dataset=eval_data,
        callbacks=[transformers.EarlyStoppingCallback(early_stopping_patience=2)],
    )
    assert ours.train().global_step == hf_steps == 3


def test_our_early_stopping_callback_matches(tmp_path: Any) -> None:
    trainer = Trainer(
        Regressor(),
        quiet_args(tmp_path, **_early_stop_args(tmp_path, None)),
        train_dataset=regression_data(40),
        eval_dataset=regression_data(4, 1),
        callbacks=[EarlyStoppingCallback(early_stopping_patience=2)],
    )
    assert trainer.train().global_step == 3


def test_early_stopping_counter_is_checkpointed_and_restored_when_asked(tmp_path: Any) -> None:
    adapter = CallbackAdapter([EarlyStoppingCallback(3)])
    adapter.callbacks[0].early_stopping_patience_counter = 2
    saved = adapter.state_dict()
    asked = quiet_args(tmp_path, restore_callback_states_from_checkpoint=True)
    fresh = CallbackAdapter([EarlyStoppingCallback(3)], asked)
    fresh.load_state_dict(saved)
    assert fresh.callbacks[0].early_stopping_patience_counter == 2
    default = CallbackAdapter([EarlyStoppingCallback(3)], quiet_args(tmp_path))
    default.load_state_dict(saved)  # HF's default: callback states start afresh on resume
    assert default.callbacks[0].early_stopping_patience_counter == 0


def test_transformers_printer_and_progress_callbacks_run(tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    out = io.StringIO()
    args = quiet_args(tmp_path, max_steps=2, logging_steps=1)
    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=regression_data(8),
        callbacks=[transformers.PrinterCallback(), transformers.trainer_callback.ProgressCallback()],
    )
    with contextlib.redirect_stdout(out):
        trainer.train()
    assert "'loss'" in out.getvalue()


def test_duck_typed_callback_with_some_methods(tmp_path: Any) -> None:
    calls: list[int] = []

    class OnlyStepEnd:
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            calls.append(state.global_step)

    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=3), train_dataset=regression_data(12))
    trainer.add_callback(OnlyStepEnd())
    trainer.train()
    assert calls == [1, 2, 3]


def test_non_callback_is_rejected() -> None:
    with pytest.raises(TypeError, match="TrainerCallback methods"):
        CallbackAdapter([object()])


def test_on_substep_end_and_skipped_optimizer_step(tmp_path: Any) -> None:
    """An optimizer step vetoed at BEFORE_OPTIMIZER_STEP still gets on_optimizer_step, as in HF."""
    from trainbus.engine import Event

    rec = RecordingCallback()
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=1), train_dataset=regression_data(4))
    trainer.add_callback(rec)
    trainer.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: setattr(ev, "skip", True))
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert "on_optimizer_step" in rec.names
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


def test_step_handlers_exist_only_while_a_callback_overrides_them(tmp_path: Path) -> None:
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=2), train_dataset=regression_data(8))
    step_events = (
        Event.STEP_START,
        Event.BACKWARD_END,
        Event.BEFORE_OPTIMIZER_STEP,
        Event.OPTIMIZER_STEP,
        Event.STEP_END,
    )

    def adapter_handlers() -> list[str]:
        return [n for e in step_events for n in trainer.bus.handler_names(e) if n.startswith("CallbackAdapter")]

    assert adapter_handlers() == []  # no callback: nothing runs inside a step

    class OnStepEnd(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.steps.append(state.global_step)

    callback = OnStepEnd()
    trainer.add_callback(callback)
    assert adapter_handlers() == ["CallbackAdapter.step_end"]
    trainer.train()
    assert callback.steps == [1, 2]
    trainer.remove_callback(OnStepEnd)
    assert adapter_handlers() == []
