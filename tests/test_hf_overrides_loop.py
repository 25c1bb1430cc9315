"""A subclass's ``_maybe_log_save_evaluate`` / ``_get_learning_rate`` decides as under transformers (#34 item 2).

The same subclasses run under ``transformers.Trainer`` and ``trainbus.Trainer``; their ``state.log_history``
(runtimes aside) and the checkpoints they leave must be transformers'. The subclasses are the common kinds: one
that logs a metric of its own with the loss (transformers' logging body, written out), one that evaluates every
third step whatever the arguments say, one that copies transformers' whole body (``_evaluate``,
``_determine_best_metric``, ``_save_checkpoint``, ``callback_handler.on_save``), one that overrides
``_get_learning_rate``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.test_hf_total_surface import Regressor, _data  # noqa: E402
from trainbus.engine import ConfigError  # noqa: E402
from trainbus.plugins import Trainer, TrainingArguments  # noqa: E402
from trainbus.plugins.facade.log_save_evaluate import LogSaveEvaluate, StepEndLogger  # noqa: E402
from trainbus.plugins.observability.logging import TrainLogger  # noqa: E402
from trainbus.plugins.optimization.clipping import GradientClipping  # noqa: E402


class OwnMetric:
    """Logs the loss as transformers does, with the learning rate x 1000 beside it; the rest is super()'s."""

    def _maybe_log_save_evaluate(
        self: Any, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None
    ) -> None:
        if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
            steps = self.state.global_step - self._globalstep_last_logged
            total = tr_loss.item()
            tr_loss -= tr_loss
            logs = {"loss": total / steps, "grad_norm": float(grad_norm), "learning_rate": learning_rate}
            logs["lr_x_1000"] = learning_rate * 1000
            self._total_loss_scalar += total
            self._globalstep_last_logged = self.state.global_step
            self.store_flos()
            self.log(logs, start_time)
        super()._maybe_log_save_evaluate(  # should_log is spent (log() cleared it): evaluates and saves
            tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=learning_rate
        )


class EveryThirdStep:
    """Evaluates every third step (and saves after it), whatever eval_strategy says."""

    def _maybe_log_save_evaluate(self: Any, *args: Any, **kwargs: Any) -> None:
        if self.state.global_step % 3 == 0:
            self.control.should_evaluate = True
            self.control.should_save = True
        super()._maybe_log_save_evaluate(*args, **kwargs)


class CopiedBody:
    """transformers' body written out (no super()): what ported subclasses that edit it look like."""

    def _maybe_log_save_evaluate(
        self: Any, tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval, start_time, learning_rate=None
    ) -> None:
        if self.control.should_log and self.state.global_step > self._globalstep_last_logged:
            total = tr_loss.item()
            tr_loss -= tr_loss
            logs = {"loss": total / (self.state.global_step - self._globalstep_last_logged)}
            logs["grad_norm"] = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm
            logs["learning_rate"] = learning_rate if learning_rate is not None else self._get_learning_rate()
            logs["epoch_index"] = epoch
            self._total_loss_scalar += total
            self._globalstep_last_logged = self.state.global_step
            self.store_flos()
            self.log(logs, start_time)
        if self.control.should_evaluate:
            metrics = self._evaluate(trial, ignore_keys_for_eval)
            best = self._determine_best_metric(metrics=metrics, trial=trial)
            if self.args.save_strategy == "best":
                self.control.should_save = best
        if self.control.should_save:
            self._save_checkpoint(model, trial)
            self.control = self.callback_handler.on_save(self.args, self.state, self.control)


class FixedRate:
    def _get_learning_rate(self: Any) -> float:
        return 0.125 * self.state.global_step


class HalfClip:
    """Clips to 0.5 whatever max_grad_norm says, and logs twice the norm (a float) (transformers 5's methods)."""

    def _clip_grad_norm(self: Any, model: torch.nn.Module) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)

    def _get_grad_norm(self: Any, model: torch.nn.Module, grad_norm: Any = None) -> float:
        return 2 * float(super()._get_grad_norm(model, grad_norm=grad_norm))


class CountedFlos:
    """Counts 1000 FLOs a sample and adds a million at every store: total_flos tells how often store_flos ran."""

    def floating_point_ops(self: Any, inputs: dict[str, Any]) -> int:
        return 1000 * int(inputs["x"].shape[0])

    def store_flos(self: Any) -> None:
        super().store_flos()
        self.state.total_flos += 1_000_000


class PassThrough:
    """Only super(): transformers' body as trainbus does it."""

    def _maybe_log_save_evaluate(self: Any, *args: Any, **kwargs: Any) -> None:
        super()._maybe_log_save_evaluate(*args, **kwargs)


class PoisonedRegressor(Regressor):
    """A NaN loss for the poisoned samples' batches, with the gradients of the others (the NaN is a constant)."""

    def forward(self, x: torch.Tensor, labels: Any = None, poison: Any = None) -> dict[str, torch.Tensor]:
        out = super().forward(x, labels)
        if labels is not None and poison is not None:
            out["loss"] = out["loss"] + torch.where(poison.any(), torch.tensor(math.nan), torch.tensor(0.0))
        return out


def _poisoned(n: int) -> list[dict[str, Any]]:
    return [{**item, "poison": torch.tensor(i == 5)} for i, item in enumerate(_data(n))]


def _run(base: type, mixin: type, args_cls: type, out: Path, **overrides: Any) -> tuple[list[dict[str, Any]], Any]:
    cls = type(mixin.__name__, (mixin, base), {})
    poisoned = overrides.pop("poisoned", False)
    kwargs: dict[str, Any] = {
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        "max_steps": 8,
        "eval_strategy": "steps",
        "eval_steps": 2,
        "save_steps": 4,
        "logging_steps": 2,
        "gradient_accumulation_steps": 2,
        "per_device_train_batch_size": 2,
        **overrides,
    }
    torch.manual_seed(0)
    model, data = (PoisonedRegressor(), _poisoned(16)) if poisoned else (Regressor(), _data(16))
    trainer = cls(model, args_cls(str(out), **kwargs), train_dataset=data, eval_dataset=_data(8))
    trainer.train()
    return trainer.state.log_history, trainer


def _comparable(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in record.items() if "runtime" not in k and "per_second" not in k} for record in history]


def _assert_same_history(hf: list[dict[str, Any]], ours: list[dict[str, Any]]) -> None:
    hf, ours = _comparable(hf), _comparable(ours)
    assert [sorted(r) for r in ours] == [sorted(r) for r in hf], f"records: transformers {hf}\ntrainbus {ours}"
    for theirs, mine in zip(hf, ours, strict=True):
        for key, value in theirs.items():
            if isinstance(value, float):  # transformers 4.57's super() rounds the loss to 4 digits
                assert math.isclose(mine[key], value, rel_tol=1e-6, abs_tol=1e-4), (key, theirs, mine)
            else:
                assert mine[key] == value, (key, theirs, mine)


EPOCHS = {"eval_strategy": "epoch", "save_strategy": "epoch", "logging_strategy": "epoch"}
SUBCLASSES = {
    "own metric": (OwnMetric, {}),
    "every third step": (EveryThirdStep, {"eval_strategy": "no", "save_strategy": "no"}),
    "copied body, save best": (CopiedBody, {"save_strategy": "best", "metric_for_best_model": "loss"}),
    "copied body, epochs": (CopiedBody, {"max_steps": -1, "num_train_epochs": 2, **EPOCHS}),
    "own metric, save best": (OwnMetric, {"save_strategy": "best", "metric_for_best_model": "loss"}),
    "super() only, a NaN loss filtered": (PassThrough, {"poisoned": True}),
    "super() only, unfiltered": (PassThrough, {"logging_nan_inf_filter": False, "logging_first_step": True}),
    "learning rate": (FixedRate, {}),
    "flos": (CountedFlos, {}),
    "flos, copied body": (type("CopiedFlos", (CopiedBody, CountedFlos), {}), {}),
    "clipping": (HalfClip, {}),
}


@pytest.mark.parametrize("case", sorted(SUBCLASSES))
def test_the_subclass_logs_evaluates_and_saves_as_under_transformers(case: str, tmp_path: Path) -> None:
    mixin, overrides = SUBCLASSES[case]
    if mixin is HalfClip and not hasattr(transformers.Trainer, "_clip_grad_norm"):
        pytest.skip(f"transformers {transformers.__version__} clips inside its loop (no _clip_grad_norm to override)")
    hf, _ = _run(transformers.Trainer, mixin, transformers.TrainingArguments, tmp_path / "hf", **overrides)
    ours, _ = _run(Trainer, mixin, TrainingArguments, tmp_path / "tb", **overrides)
    _assert_same_history(hf, ours)
    assert sorted(os.listdir(tmp_path / "tb")) == sorted(os.listdir(tmp_path / "hf"))
    assert any("eval_loss" in record for record in ours)


def test_a_resumed_run_logs_what_the_uninterrupted_one_logs(tmp_path: Path) -> None:
    """The checkpoint at step 3 falls inside a logging window: tr_loss and the totals go on from it."""
    whole, _ = _run(Trainer, OwnMetric, TrainingArguments, tmp_path / "whole", save_steps=3)

    class StopAtThree(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            control.should_training_stop = control.should_training_stop or state.global_step == 3

    cls = type("OwnMetric", (OwnMetric, Trainer), {})
    args = TrainingArguments(
        str(tmp_path / "cut"), report_to="none", use_cpu=True, disable_tqdm=True, max_steps=8, eval_strategy="steps",
        eval_steps=2, save_steps=3, logging_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=2,
    )  # fmt: skip
    torch.manual_seed(0)
    cls(Regressor(), args, train_dataset=_data(16), eval_dataset=_data(8), callbacks=[StopAtThree()]).train()
    torch.manual_seed(0)
    resumed = cls(Regressor(), args, train_dataset=_data(16), eval_dataset=_data(8))
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    after = [r for r in _comparable(resumed.state.log_history) if r["step"] > 3]
    expected = [r for r in _comparable(whole) if r["step"] > 3]
    assert [sorted(r) for r in after] == [sorted(r) for r in expected]
    for mine, theirs in zip(after, expected, strict=True):
        for key, value in theirs.items():
            assert mine[key] == pytest.approx(value, rel=1e-6), (key, theirs, mine)


def test_an_override_without_transformers_arguments_is_refused_at_construction(tmp_path: Path) -> None:
    class Old(Trainer):
        def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, trial, epoch):  # type: ignore[override]
            return None

    args = TrainingArguments(str(tmp_path), report_to="none", use_cpu=True, max_steps=1)
    with pytest.raises(ConfigError, match=r"Old\._maybe_log_save_evaluate.*cannot take transformers' arguments"):
        Old(Regressor(), args, train_dataset=_data(4))


def test_a_clipping_override_the_run_would_not_call_is_refused(tmp_path: Path) -> None:
    cls = type("HalfClip", (HalfClip, Trainer), {})
    args = TrainingArguments(str(tmp_path), report_to="none", use_cpu=True, max_steps=1, optim="lomo")
    with pytest.raises(ConfigError, match=r"HalfClip\._clip_grad_norm, HalfClip\._get_grad_norm: this run never clips"):
        cls(Regressor(), args, train_dataset=_data(4))


@pytest.mark.parametrize(
    ("event", "cleared"),
    [("on_log", ["should_log"]), ("on_evaluate", ["should_evaluate"]), ("on_save", ["should_save"]),
     ("on_step_begin", ["should_log", "should_evaluate", "should_save"])],
)  # fmt: skip
def test_the_callback_handler_clears_the_flag_of_its_event_as_transformers(
    event: str, cleared: list[str], tmp_path: Path
) -> None:
    """A copied body's ``self.callback_handler.on_save(...)`` leaves should_save unset, as transformers' does."""
    args = TrainingArguments(str(tmp_path), report_to="none", use_cpu=True, max_steps=1)
    trainer = Trainer(Regressor(), args, train_dataset=_data(4))
    flags = ("should_log", "should_evaluate", "should_save", "should_training_stop")
    for flag in flags:
        setattr(trainer.control, flag, True)
    extra = [{}] if event in ("on_log", "on_evaluate") else []
    control = getattr(trainer.callback_handler, event)(args, trainer.state, trainer.control, *extra)
    assert {flag: getattr(control, flag) for flag in flags} == {flag: flag not in cleared for flag in flags}


def test_without_an_override_nothing_is_added(tmp_path: Path) -> None:
    """The default Trainer keeps trainbus's logger and no per-step handler of this module."""
    args = TrainingArguments(str(tmp_path), report_to="none", use_cpu=True, max_steps=1)
    trainer = Trainer(Regressor(), args, train_dataset=_data(4))
    assert type(trainer.train_logger) is TrainLogger
    assert type(trainer.get_plugin(GradientClipping)) is GradientClipping
    assert trainer.get_plugin(LogSaveEvaluate) is None
    subclass = type("WithOverride", (OwnMetric, Trainer), {})(Regressor(), args, train_dataset=_data(4))
    assert type(subclass.train_logger) is StepEndLogger and subclass.train_logger.name == "TrainLogger"
    assert subclass.get_plugin(LogSaveEvaluate) is not None


def test_on_two_processes_the_loss_logged_is_one_process_s(tmp_path: Path) -> None:
    """super() averages tr_loss over the processes: 2 processes x batch 4 log what 1 process x batch 8 logs
    (float32 tr_loss, as transformers', so to float32's precision)."""
    from dist_helpers import launch_job, results, untimed

    jobs = Path(__file__).with_name("hf_overrides_loop_jobs.py")
    launch_job(jobs, "override", tmp_path / "one", 1)
    launch_job(jobs, "override", tmp_path / "two", 2)
    one, ranks = results(tmp_path / "one", "override"), [results(tmp_path / "two", "override", r) for r in (0, 1)]
    expected = untimed(one["log_history"])
    assert any("lr_x_1000" in record for record in expected) and one["checkpoints"]
    for rank in ranks:
        assert rank["checkpoints"] == one["checkpoints"]
        got = untimed(rank["log_history"])
        assert [sorted(r) for r in got] == [sorted(r) for r in expected]
        for mine, theirs in zip(got, expected, strict=True):
            for key, value in theirs.items():
                assert mine[key] == pytest.approx(value, rel=1e-6), (key, theirs, mine)
        assert rank["training_loss"] == pytest.approx(one["training_loss"], rel=1e-6)
