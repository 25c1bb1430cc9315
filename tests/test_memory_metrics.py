"""skip_memory_metrics=False: HF's per-stage memory deltas (TrainerMemoryTracker's names) in train, eval, predict."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from facade_helpers import Regressor, quiet_args, regression_data

from trainbus.engine import ConfigError, Engine, Event
from trainbus.plugins.facade.trainer import Trainer
from trainbus.plugins.observability.memory import MemoryMetrics

MiB = 2**20
SIZE = 128 * MiB


def memory_keys(metrics: dict[str, Any]) -> set[str]:
    return {k for k in metrics if "_mem_" in k}


def small_engine(memory: MemoryMetrics) -> Engine:
    model = torch.nn.Linear(2, 1)
    batch = (torch.randn(4, 2), torch.randn(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Engine(model, optimizer, train_data=[batch] * 2, eval_data=[batch], max_epochs=1, plugins=[memory],
                  loss_fn=torch.nn.MSELoss())  # fmt: skip


def expected(stage: str) -> set[str]:
    devices = ["cpu", "gpu"] if torch.cuda.is_available() else ["cpu"]
    return {f"{stage}_mem_{d}_{kind}_delta" for d in devices for kind in ("alloc", "peaked")}


@pytest.mark.parametrize("skip", [False, True])
def test_memory_metrics_appear_in_train_eval_and_predict_results_only_when_asked(tmp_path: Path, skip: bool) -> None:
    args = quiet_args(tmp_path, max_steps=2, logging_steps=1, skip_memory_metrics=skip)
    data = regression_data(8)
    trainer = Trainer(Regressor(), args, train_dataset=data, eval_dataset=data)
    train = trainer.train().metrics
    evaluated = trainer.evaluate()
    predicted = trainer.predict(data).metrics
    if skip:
        assert not memory_keys(train) | memory_keys(evaluated) | memory_keys(predicted)
        assert all(not memory_keys(record) for record in trainer.state.log_history)
        assert trainer.get_plugin(MemoryMetrics) is None
        return
    # HF reports the constructor's ("init") deltas with the first stage that runs
    init = expected("init") | {
        f"before_init_mem_{d}" for d in (["cpu", "gpu"] if torch.cuda.is_available() else ["cpu"])
    }
    assert memory_keys(train) == expected("train") | init
    assert memory_keys(trainer.state.log_history[-2]) == expected("train") | init  # the train-end record (HF logs them)
    assert memory_keys(evaluated) == expected("eval")
    assert not memory_keys(trainer.state.log_history[-1])  # HF adds eval's after logging the eval metrics
    assert memory_keys(predicted) == expected("test")
    assert all(isinstance(v, int) and v >= 0 for k, v in train.items() if "peaked" in k)


def test_a_stage_reports_what_it_allocated_and_what_it_freed_again() -> None:
    kept: list[torch.Tensor] = []

    def allocate_and_keep(ev: Any) -> None:
        kept.append(torch.ones(SIZE // 4))  # float32: SIZE bytes, every page touched

    def allocate_and_free(ev: Any) -> None:
        peak = torch.ones(SIZE // 4)
        time.sleep(0.2)  # the tracker's thread samples the resident set while it is held
        del peak

    memory = MemoryMetrics()
    engine = small_engine(memory)
    engine.on(Event.TRAIN_START, allocate_and_keep)  # after MemoryMetrics started the stage (it runs FIRST)
    engine.on(Event.EVAL_START, allocate_and_free)
    engine.fit()
    engine.evaluate()
    train, evaluated = memory.metrics["train"], memory.metrics["eval"]
    assert 0.9 * SIZE < train["train_mem_cpu_alloc_delta"] < 1.2 * SIZE
    assert 0.9 * SIZE < evaluated["eval_mem_cpu_peaked_delta"] < 1.2 * SIZE
    assert abs(evaluated["eval_mem_cpu_alloc_delta"]) < 0.1 * SIZE


def test_the_init_stage_is_reported_with_the_first_stage_that_reports_as_hf_does() -> None:
    memory = MemoryMetrics()
    memory.start("init")  # what the Trainer's constructor does around building the run
    weights = torch.ones(SIZE // 4)
    memory.stop("init")
    engine = small_engine(memory)
    evaluated = engine.evaluate()
    assert 0.9 * SIZE < evaluated["init_mem_cpu_alloc_delta"] < 1.2 * SIZE
    assert evaluated["before_init_mem_cpu"] > 0 and "eval_mem_cpu_alloc_delta" in evaluated
    engine.fit()
    assert "init_mem_cpu_alloc_delta" not in memory.metrics["train"]  # reported once
    del weights


def test_an_evaluation_during_training_belongs_to_the_train_stage(tmp_path: Path) -> None:
    args = quiet_args(tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1, skip_memory_metrics=False)
    data = regression_data(8)
    trainer = Trainer(Regressor(), args, train_dataset=data, eval_dataset=data)
    trainer.train()
    evals = [r for r in trainer.state.log_history if "eval_loss" in r]
    assert len(evals) == 2 and all(not memory_keys(r) for r in evals)
    assert "eval" not in trainer.get_plugin(MemoryMetrics).metrics  # type: ignore[union-attr]


def test_an_unknown_stage_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown memory stage 'training'; stages: init, train, eval, test"):
        MemoryMetrics().start("training")


def test_trainer_reports_its_init_stage(tmp_path: Path) -> None:
    args = quiet_args(tmp_path, max_steps=1, skip_memory_metrics=False)
    metrics = Trainer(Regressor(), args, train_dataset=regression_data(8)).train().metrics
    assert "init_mem_cpu_alloc_delta" in metrics and "before_init_mem_cpu" in metrics
