"""FlowControl: strategies -> Control flags exactly where HF's DefaultFlowCallback sets them."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import ConfigError, Engine, Event
from trainbus.plugins.control.best_model import BestMetric
from trainbus.plugins.control.flow import FlowControl


def reference(cfg: dict[str, Any], steps_per_epoch: int, max_steps: int) -> list[tuple[str, int]]:
    """HF DefaultFlowCallback rules, run over a simulated loop: (side effect, global_step) in order."""

    def interval(value: float) -> int:
        return max(1, math.ceil(max_steps * value)) if value < 1 else int(value)

    log_n, eval_n, save_n = interval(cfg["logging_steps"]), interval(cfg["eval_steps"]), interval(cfg["save_steps"])
    out: list[tuple[str, int]] = [("eval", 0)] if cfg["eval_on_start"] else []
    step = 0
    while step < max_steps:
        for _ in range(steps_per_epoch):
            step += 1
            if (step == 1 and cfg["logging_first_step"]) or (cfg["logging_strategy"] == "steps" and step % log_n == 0):
                out.append(("log", step))
            steps_eval = cfg["eval_strategy"] == "steps" and cfg["eval_delay"] <= step
            if steps_eval and (step % eval_n == 0 or step >= max_steps):
                out.append(("eval", step))
            if cfg["save_strategy"] == "steps" and (step % save_n == 0 or step >= max_steps):
                out.append(("save", step))
            if step >= max_steps:
                break
        epoch = step / steps_per_epoch
        if cfg["logging_strategy"] == "epoch":
            out.append(("log", step))
        if cfg["eval_strategy"] == "epoch" and cfg["eval_delay"] <= epoch:
            out.append(("eval", step))
        if cfg["save_strategy"] == "epoch":
            out.append(("save", step))
    return out


def run(cfg: dict[str, Any], batches: int, max_steps: int | None, epochs: int) -> list[tuple[str, int]]:
    model = torch.nn.Linear(1, 1)
    data = [(torch.ones(1, 1), torch.ones(1, 1))] * batches
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        train_data=data,
        eval_data=data[:1],
        max_epochs=epochs,
        max_steps=max_steps,
        loss_fn=torch.nn.MSELoss(),
        plugins=[FlowControl(**cfg)],
    )
    seen: list[tuple[str, int]] = []
    engine.on(Event.LOG, lambda ev: seen.append(("log", ev.engine.state.global_step)))
    engine.on(Event.EVAL_END, lambda ev: seen.append(("eval", ev.engine.state.global_step)))
    engine.on(Event.SAVE, lambda ev: seen.append(("save", ev.engine.state.global_step)))
    engine.fit()
    return seen


steps_value = st.one_of(st.integers(1, 5), st.sampled_from([0.25, 0.5]))
configs = st.fixed_dictionaries(
    {
        "logging_strategy": st.sampled_from(["no", "steps", "epoch"]),
        "logging_steps": steps_value,
        "logging_first_step": st.booleans(),
        "eval_strategy": st.sampled_from(["no", "steps", "epoch"]),
        "eval_steps": steps_value,
        "eval_delay": st.sampled_from([0, 1, 3]),
        "eval_on_start": st.booleans(),
        "save_strategy": st.sampled_from(["no", "steps", "epoch"]),
        "save_steps": steps_value,
    }
)


@given(cfg=configs, batches=st.integers(1, 5), epochs=st.integers(1, 3), max_steps=st.none() | st.integers(1, 9))
def test_flags_match_default_flow_callback(
    cfg: dict[str, Any], batches: int, epochs: int, max_steps: int | None
) -> None:
    total = max_steps if max_steps is not None else batches * epochs
    assert run(cfg, batches, max_steps, epochs) == reference(cfg, batches, total)


def test_transformers_default_flow_callback_agrees() -> None:
    """Cross-check the reference against transformers' own DefaultFlowCallback on one config."""
    transformers = pytest.importorskip("transformers")
    from transformers.trainer_callback import DefaultFlowCallback, TrainerControl, TrainerState

    args = transformers.TrainingArguments(
        "x", logging_steps=2, eval_strategy="steps", eval_steps=3, save_steps=4, logging_first_step=True
    )
    state = TrainerState(max_steps=7, logging_steps=2, eval_steps=3, save_steps=4)
    flow, hf_seen = DefaultFlowCallback(), []
    for step in range(1, 8):
        state.global_step = step
        control = flow.on_step_end(args, state, TrainerControl())
        flags = {"log": control.should_log, "eval": control.should_evaluate, "save": control.should_save}
        hf_seen += [(name, step) for name, on in flags.items() if on]
    cfg = dict(
        logging_strategy="steps",
        logging_steps=2,
        logging_first_step=True,
        eval_strategy="steps",
        eval_steps=3,
        eval_delay=0,
        eval_on_start=False,
        save_strategy="steps",
        save_steps=4,
    )
    assert run(cfg, batches=7, max_steps=None, epochs=1) == hf_seen


def test_save_best_saves_after_a_new_best() -> None:
    model = torch.nn.Linear(1, 1)
    values = iter([3.0, 2.0, 2.5, 1.0])
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        train_data=[(torch.ones(1, 1), torch.ones(1, 1))] * 4,
        eval_data=[(torch.ones(1, 1), torch.ones(1, 1))],
        max_epochs=1,
        loss_fn=torch.nn.MSELoss(),
        plugins=[
            FlowControl(eval_strategy="steps", eval_steps=1, save_strategy="best", logging_strategy="no"),
            BestMetric("score", greater_is_better=False),
        ],
    )
    engine.on(Event.EVAL_END, lambda ev: ev.metrics.update(eval_score=next(values)), priority=500)
    saved: list[int] = []
    engine.on(Event.SAVE, lambda ev: saved.append(ev.engine.state.global_step))
    engine.fit()
    assert saved == [1, 2, 4]


def test_bad_flow_values() -> None:
    with pytest.raises(ConfigError, match="logging_steps"):
        FlowControl(logging_steps=0)
    with pytest.raises(ConfigError, match="eval_strategy must be one of"):
        FlowControl(eval_strategy="sometimes")
