"""The Trainer facade behaves as HF's where users notice: metric checks, control flags, rotation, overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.facade_helpers import Regressor, quiet_args, regression_data
from trainbus.engine import ConfigError
from trainbus.plugins import Trainer, TrainerCallback
from trainbus.plugins.checkpoints.checkpoint import list_checkpoints


class CountingMetrics:
    """A stateful compute_metrics that also draws from the global torch RNG (as sampling metrics do)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, p: Any) -> dict[str, float]:
        self.calls += 1
        torch.rand(1)
        return {"neg_mse": -float(((p.predictions - p.label_ids) ** 2).mean()), "call": float(self.calls)}


def _eval_args(tmp_path: Path, **kwargs: Any) -> Any:
    defaults: dict[str, Any] = {"max_steps": 4, "eval_strategy": "steps", "eval_steps": 2, "learning_rate": 0.1}
    defaults.update(kwargs)
    return quiet_args(tmp_path, **defaults)


def test_metric_for_best_model_calls_no_user_code_before_the_first_evaluation(tmp_path: Path) -> None:
    def run(**kwargs: Any) -> tuple[CountingMetrics, list[torch.Tensor], dict[str, Any]]:
        metrics = CountingMetrics()
        torch.manual_seed(0)
        trainer = Trainer(
            Regressor(),
            _eval_args(tmp_path / str(len(kwargs)), **kwargs),
            train_dataset=regression_data(16),
            eval_dataset=regression_data(8, seed=1),
            compute_metrics=metrics,
        )
        trainer.train()
        return metrics, [p.detach().clone() for p in trainer.model.parameters()], trainer.evaluate()

    plain_metrics, plain_params, _ = run()
    best_metrics, best_params, last = run(metric_for_best_model="neg_mse")
    assert best_metrics.calls == plain_metrics.calls == 3  # one per evaluation (2 in train), none before
    assert last["eval_call"] == 3.0  # the first evaluation saw the first value of the stateful metric
    for a, b in zip(plain_params, best_params, strict=True):
        assert torch.equal(a, b)  # merely naming a metric does not change the run (global RNG untouched)


def test_a_metric_compute_metrics_lacks_fails_at_the_first_evaluation_naming_the_keys(tmp_path: Path) -> None:
    args = _eval_args(tmp_path, metric_for_best_model="accuracy", save_strategy="steps", save_steps=2)
    metrics = CountingMetrics()
    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=regression_data(16),
        eval_dataset=regression_data(8, seed=1),
        compute_metrics=metrics,
    )
    with pytest.raises(ConfigError, match=r"eval_accuracy.*not among.*eval_neg_mse"):
        trainer.train()
    assert metrics.calls == 1 and trainer.state.global_step == 2
    assert trainer.state.best_metric is None
    assert list_checkpoints(tmp_path) == []  # the failing evaluation came before its step's save


def test_a_metric_trainbus_cannot_produce_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"eval_los'.*did you mean 'eval_loss'"):
        Trainer(
            Regressor(),
            _eval_args(tmp_path, metric_for_best_model="eval_los"),
            train_dataset=regression_data(16),
            eval_dataset=regression_data(8, seed=1),
        )


class RaiseFlagAt(TrainerCallback):
    """Sets one control flag at the end of the given steps, as a user's callback does."""

    def __init__(self, flag: str, steps: set[int]) -> None:
        self.flag, self.steps = flag, steps

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step in self.steps:
            setattr(control, self.flag, True)


def test_control_flags_a_callback_sets_are_honoured_when_the_strategies_say_no(tmp_path: Path) -> None:
    args = quiet_args(tmp_path, max_steps=4, save_strategy="no", eval_strategy="no", logging_strategy="no")
    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=regression_data(16),
        eval_dataset=regression_data(8, seed=1),
        callbacks=[
            RaiseFlagAt("should_save", {2}),
            RaiseFlagAt("should_log", {3}),
            RaiseFlagAt("should_evaluate", {1}),
            RaiseFlagAt("should_training_stop", {3}),
        ],
    )
    trainer.train()
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2]
    history = trainer.state.log_history
    assert [(h["step"], "loss" in h) for h in history if "loss" in h] == [(3, True)]
    assert [h["step"] for h in history if "eval_loss" in h] == [1]
    assert trainer.state.global_step == 3  # should_training_stop honoured


def test_save_total_limit_1_with_the_best_model_keeps_only_the_best_checkpoint_at_the_end(tmp_path: Path) -> None:
    class GetsWorse(CountingMetrics):
        def __call__(self, p: Any) -> dict[str, float]:
            super().__call__(p)
            return {"score": -float(self.calls)}  # the first evaluation is the best

    args = _eval_args(
        tmp_path,
        max_steps=6,
        save_strategy="steps",
        save_steps=2,
        save_total_limit=1,
        load_best_model_at_end=True,
        metric_for_best_model="score",
    )
    seen: list[list[int]] = []

    class Listing(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.append([step for step, _ in list_checkpoints(tmp_path)])

    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=regression_data(16),
        eval_dataset=regression_data(8, seed=1),
        compute_metrics=GetsWorse(),
        callbacks=[Listing],
    )
    trainer.train()
    assert seen[-1] == [2, 6]  # during training the newest stays beside the best, for resuming
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2]
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-2")


class Overriding(Trainer):
    """Overrides every method the seeds show users overriding, with HF's signatures, and records the calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.calls: list[tuple[str, Any]] = []
        super().__init__(*args, **kwargs)

    def create_optimizer(self) -> torch.optim.Optimizer:
        self.calls.append(("create_optimizer", None))
        return super().create_optimizer()

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        self.calls.append(("create_scheduler", num_training_steps))
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer or self.optimizer, lambda step: 1.0 / (1 + step)
        )  # HF code assigns it
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.calls.append(("create_optimizer_and_scheduler", num_training_steps))
        super().create_optimizer_and_scheduler(num_training_steps)

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        if model.training:
            self.calls.append(("compute_loss", int(num_items_in_batch)))
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
        self.calls.append(("prediction_step", prediction_loss_only))
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> Any:
        self.calls.append(("evaluate", metric_key_prefix))
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        self.calls.append(("log", sorted(logs)))
        super().log(logs, start_time)

    def get_train_dataloader(self) -> Any:
        self.calls.append(("get_train_dataloader", None))
        return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        self.calls.append(("get_eval_dataloader", None))
        return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        self.calls.append(("get_test_dataloader", None))
        return super().get_test_dataloader(test_dataset)


def test_every_method_hf_users_override_is_honoured_with_hf_signatures(tmp_path: Path) -> None:
    args = _eval_args(
        tmp_path, max_steps=4, per_device_train_batch_size=2, gradient_accumulation_steps=2, logging_steps=2
    )
    class TakesLossKwargs(Regressor):  # transformers counts num_items_in_batch only for such a forward (else None)
        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
            return super().forward(x, labels)

    trainer = Overriding(
        TakesLossKwargs(), args, train_dataset=regression_data(32), eval_dataset=regression_data(8, seed=1)
    )
    trainer.train()
    names = [name for name, _ in trainer.calls]
    # HF's order: the train loader and the optimizer in train(), the eval loader at the first evaluation
    assert names[:2] == ["get_train_dataloader", "create_optimizer_and_scheduler"]
    assert names.index("get_eval_dataloader") > names.index("compute_loss")
    assert ("create_optimizer_and_scheduler", 4) in trainer.calls and ("create_scheduler", 4) in trainer.calls
    assert "create_optimizer" in names
    # the subclass's scheduler is the one stepped: lr = 0.1 / (1 + steps taken)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 5)
    # num_items_in_batch: the items of the whole accumulation window (2 micro-batches of 2 labels)
    assert [value for name, value in trainer.calls if name == "compute_loss"] == [4] * 8
    step_logs = [value for name, value in trainer.calls if name == "log" and "loss" in value]
    assert step_logs == [["grad_norm", "learning_rate", "loss"]] * 2  # the per-step records too, without epoch
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [2, 4]
    assert ("evaluate", "eval") in trainer.calls and ("prediction_step", True) in trainer.calls  # no compute_metrics
    trainer.predict(regression_data(4, seed=2))
    assert trainer.calls[-1][0] == "prediction_step" and ("get_test_dataloader", None) in trainer.calls


def test_compute_loss_func_normalised_by_num_items_in_batch_matches_one_big_batch(tmp_path: Path) -> None:
    def summed_over_items(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any) -> torch.Tensor:
        return ((outputs["logits"] - labels) ** 2).sum() / num_items_in_batch

    def run(batch: int, accumulation: int) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = Regressor().double()
        data = [{"x": d["x"].double(), "labels": d["labels"].double()} for d in regression_data(24)]
        args = quiet_args(
            tmp_path / f"{batch}",
            max_steps=3,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation,
            learning_rate=0.1,
            optim="sgd",
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
        )
        trainer = Trainer(model, args, train_dataset=data, compute_loss_func=summed_over_items)
        trainer.train()
        return [p.detach().clone() for p in model.parameters()]

    for one, accumulated in zip(run(8, 1), run(2, 4), strict=True):
        torch.testing.assert_close(one, accumulated, rtol=1e-12, atol=1e-12)


def test_resume_true_skips_a_damaged_newest_checkpoint_with_a_warning(tmp_path: Path) -> None:
    def trainer(max_steps: int) -> Trainer:
        torch.manual_seed(0)
        args = quiet_args(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=2, learning_rate=0.1)
        return Trainer(Regressor(), args, train_dataset=regression_data(32))

    straight = trainer(6)
    straight.train()
    weights = tmp_path / "checkpoint-6" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-7])  # a crash or full disk truncated the newest
    resumed = trainer(6)
    with pytest.warns(UserWarning, match=r"damaged checkpoint .*checkpoint-6.*model.safetensors"):
        resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    for a, b in zip(straight.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)  # steps 5 and 6 were redone from checkpoint-4, bit for bit
    for step in (2, 4):  # every checkpoint damaged: a clear error, not a silent fresh start
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-6" / "model.safetensors").write_bytes(b"")
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match=r"every checkpoint .* is damaged"):
        trainer(6).train(resume_from_checkpoint=True)


def test_hf_utility_methods_report_what_the_run_has(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tests.facade_helpers import tiny_bert, token_data

    args = quiet_args(
        tmp_path, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=0.01
    )
    trainer = Trainer(tiny_bert(), args, train_dataset=token_data(16), eval_dataset=token_data(6, seed=1))
    model = trainer.model
    with pytest.raises(ConfigError, match="no optimizer yet"):
        trainer.get_learning_rates()
    assert trainer.get_num_trainable_parameters() == sum(p.numel() for p in model.parameters())
    model.bert.embeddings.word_embeddings.weight.requires_grad_(False)
    frozen = model.bert.embeddings.word_embeddings.weight.numel()
    assert trainer.get_num_trainable_parameters() == sum(p.numel() for p in model.parameters()) - frozen
    model.bert.embeddings.word_embeddings.weight.requires_grad_(True)
    assert trainer.get_total_train_batch_size(args) == 4
    output = trainer.train()
    assert trainer.get_learning_rates() == [g["lr"] for g in trainer.optimizer.param_groups]
    classifier = trainer.get_optimizer_group("classifier.weight")
    assert any(p is model.classifier.weight for p in classifier["params"])
    groups = trainer.get_optimizer_group()  # HF: each group's list of parameters
    assert len(groups) == len(trainer.optimizer.param_groups) == 2
    assert all(listed is group["params"] for listed, group in zip(groups, trainer.optimizer.param_groups))
    # a real total_flos: the model's own estimate summed over the 6 micro-batches of 2 x 8 tokens
    per_batch = 6 * 2 * 8 * model.num_parameters(exclude_embeddings=True)  # HF's estimate
    # train()'s metrics leave it out as HF's do (its printer callback pops it); the log record keeps it
    assert "total_flos" not in output.metrics
    assert trainer.state.total_flos == trainer.state.log_history[-1]["total_flos"] == 6 * per_batch > 0

    trainer.log_metrics("train", {**output.metrics, "total_flos": trainer.state.total_flos})
    printed = capsys.readouterr().out
    assert "***** train metrics *****" in printed and "train_loss" in printed and "GF" in printed
    trainer.save_metrics("train", output.metrics)
    trainer.save_metrics("eval", {"eval_loss": 0.5})
    assert json.loads((tmp_path / "train_results.json").read_text())["train_loss"] == output.training_loss
    assert set(json.loads((tmp_path / "all_results.json").read_text())) == {*output.metrics, "eval_loss"}
    trainer.save_state()
    saved = json.loads((tmp_path / "trainer_state.json").read_text())
    assert saved["global_step"] == 3 and saved["total_flos"] == trainer.state.total_flos

    loader = trainer.get_eval_dataloader()
    loop = trainer.evaluation_loop(loader, "Evaluation", metric_key_prefix="val")
    assert loop.num_samples == 6 and loop.predictions.shape == (6, 2) and "val_loss" in loop.metrics
    assert trainer.prediction_loop(loader, "Prediction", prediction_loss_only=True).predictions is None
    with trainer.compute_loss_context_manager(), trainer.autocast_smart_context_manager():
        pass
    batches, items = trainer.get_batch_samples(iter(trainer.get_train_dataloader()), 3, torch.device("cpu"))
    assert len(batches) == 3 and items == 6  # one label per sequence, 2 sequences per batch


class _FakeProcesses:
    """What accelerate's PartialState tells TrainingArguments, for a rank of a multi-node run."""

    def __init__(self, process_index: int, local_process_index: int) -> None:
        self.num_processes, self.process_index, self.local_process_index = 4, process_index, local_process_index


def test_log_level_follows_log_on_each_node_as_hf(tmp_path: Path) -> None:
    import logging

    def level(process: int, local: int, **kwargs: Any) -> int:
        args = quiet_args(tmp_path, log_level="info", log_level_replica="error", **kwargs)
        args.__dict__["_processes"] = _FakeProcesses(process, local)
        return args.get_process_log_level()

    assert level(0, 0) == logging.INFO
    assert level(2, 0) == logging.INFO  # the main process of the second node logs, by default
    assert level(2, 0, log_on_each_node=False) == logging.ERROR  # only the world's main process does
    assert level(3, 1) == logging.ERROR
    root = logging.getLogger("trainbus")
    before = root.level
    try:
        Trainer(Regressor(), quiet_args(tmp_path, log_level="error", max_steps=1), train_dataset=regression_data(4))
        assert root.level == logging.ERROR
    finally:
        root.setLevel(before)
    with pytest.raises(ConfigError, match="log_level must be one of"):
        quiet_args(tmp_path, log_level="loud")


def test_hf_planning_and_parameter_helpers(tmp_path: Path) -> None:
    args = quiet_args(tmp_path, num_train_epochs=2, per_device_train_batch_size=4, gradient_accumulation_steps=3)
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(30))
    loader = trainer.get_train_dataloader()  # 8 batches: 3 optimizer steps per epoch
    assert trainer.set_initial_training_values(args, loader) == (2, 3, 30, 60, 12, 8, 6)
    args.max_steps = 4
    assert trainer.set_initial_training_values(args, loader) == (2, 3, 30, 48, 12, 8, 4)
    assert trainer.get_decay_parameter_names(trainer.model) == ["lin.weight"]  # biases never decay
    assert trainer.get_tp_size() == 1 and trainer.tokenizer is None
    assert trainer.metrics_format({"train_runtime": 3725.5, "total_flos": 3 * 2**30}) == {
        "train_runtime": "1:02:05.50",
        "total_flos": "3GF",
    }
    with pytest.raises(ConfigError, match="never uploads"):
        trainer.push_to_hub()


def test_save_only_model_checkpoints_hold_the_model_and_refuse_to_resume(tmp_path: Path) -> None:
    args = _eval_args(
        tmp_path,
        save_strategy="steps",
        save_steps=2,
        save_only_model=True,
        load_best_model_at_end=True,
    )
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(16), eval_dataset=regression_data(8, seed=1))
    trainer.train()
    newest = tmp_path / "checkpoint-4"
    assert sorted(p.name for p in newest.iterdir()) == [
        "manifest.json", "model.safetensors", "trainbus_state.json", "trainer_state.json", "training_args.json",
    ]  # fmt: skip
    assert trainer.state.best_model_checkpoint is not None  # the best model still loads at the end
    fresh = Trainer(Regressor(), args, train_dataset=regression_data(16), eval_dataset=regression_data(8, seed=1))
    with pytest.raises(ConfigError, match=r"save_only_model=True.*cannot resume"):
        fresh.train(resume_from_checkpoint=True)


def test_optimizer_cls_and_kwargs_and_an_overridden_get_optimizer_cls_and_kwargs_build_the_optimizer(
    tmp_path: Path,
) -> None:
    args = quiet_args(tmp_path, max_steps=2, weight_decay=0.1)
    given = Trainer(
        Regressor(),
        args,
        train_dataset=regression_data(8),
        optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.05, "momentum": 0.5}),
    )
    given.train()
    assert type(given.optimizer) is torch.optim.SGD and given.optimizer.param_groups[0]["momentum"] == 0.5
    assert [g["weight_decay"] for g in given.optimizer.param_groups] == [0.1, 0.0]  # HF's decay groups

    class RMSpropTrainer(Trainer):
        @staticmethod
        def get_optimizer_cls_and_kwargs(args: Any, model: Any = None) -> tuple[Any, dict[str, Any]]:
            return torch.optim.RMSprop, {"lr": args.learning_rate, "alpha": 0.9}

    overriding = RMSpropTrainer(Regressor(), args, train_dataset=regression_data(8))
    overriding.train()
    assert type(overriding.optimizer) is torch.optim.RMSprop and overriding.optimizer.param_groups[0]["alpha"] == 0.9
    with pytest.raises(ConfigError, match="not both"):
        model = Regressor()
        Trainer(
            model,
            args,
            train_dataset=regression_data(8),
            optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None),
            optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.1}),
        )
