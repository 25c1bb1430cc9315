"""Several optimizers by name and a step function of the user's own (#35 item 2): a GAN on a bare Engine."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.optim35_gan import gan
from trainbus.engine import ConfigError, Engine, Event
from trainbus.engine.testing import check_resume_equivalence
from trainbus.engine.user_step import NamedOptimizers


def _same_optimizers(a: Engine, b: Engine) -> bool:
    sa, sb = a.optimizer.state_dict()["named"], b.optimizer.state_dict()["named"]
    return sa.keys() == sb.keys() and all(
        torch.equal(sa[n]["state"][i][k], sb[n]["state"][i][k]) and sa[n]["param_groups"] == sb[n]["param_groups"]
        for n in sa
        for i in sa[n]["state"]
        for k in sa[n]["state"][i]
    )


def test_a_list_of_optimizers_names_the_dict_form_without_their_reprs() -> None:
    model = torch.nn.Linear(2, 1)
    expected = r'optimizer is a list of 2 \(SGD, Adam\).*\{"d": opt_d, "g": opt_g\}'
    with pytest.raises(ConfigError, match=expected) as info:
        Engine(model, [torch.optim.SGD(model.parameters(), 0.1), torch.optim.Adam(model.parameters())])
    assert "lr" not in str(info.value)  # no optimizer repr (with its param groups) in the message


def test_bad_names_and_bad_optimizers_are_named() -> None:
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="optimizer 'g': optimizer must be"):
        Engine(model, {"d": torch.optim.SGD(model.parameters(), 0.1), "g": "adam"})
    with pytest.raises(ConfigError, match="non-empty str, got 3"):
        Engine(model, {3: torch.optim.SGD(model.parameters(), 0.1)})
    with pytest.raises(ConfigError, match=r"at least one named optimizer"):
        Engine(model, {})
    with pytest.raises(ConfigError, match=r"step is called as step\(engine, batch\)"):
        Engine(model, torch.optim.SGD(model.parameters(), 0.1), step=lambda batch: None)


def test_the_step_function_steps_both_and_the_events_name_them() -> None:
    engine = gan(epochs=1)
    seen: list[tuple[str, Any]] = []
    for event in (Event.STEP_START, Event.BATCH_START, Event.STEP_END):
        engine.on(event, lambda ev, name=event.name: seen.append((name, None)))
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: seen.append(("BEFORE_OPTIMIZER_STEP", ev.optimizer)))
    engine.on(Event.OPTIMIZER_STEP, lambda ev: seen.append(("OPTIMIZER_STEP", ev.optimizer)))
    engine.on(Event.LOSS, lambda ev: seen.append(("LOSS", None)))
    before = {n: [p.clone() for p in m.parameters()] for n, m in engine.model.items()}  # type: ignore[operator]
    state = engine.fit()
    assert state.global_step == 5 and state.optimizer_steps_taken == 5  # a window counts once, both stepped
    step = [("STEP_START", None), ("BATCH_START", None), ("BEFORE_OPTIMIZER_STEP", "d"), ("OPTIMIZER_STEP", "d"),
            ("BEFORE_OPTIMIZER_STEP", "g"), ("OPTIMIZER_STEP", "g"), ("STEP_END", None)]  # fmt: skip
    assert seen == step * 5
    for name, module in engine.model.items():  # type: ignore[operator]
        assert all(not torch.equal(a, b) for a, b in zip(before[name], module.parameters()))
    assert set(engine.step_outputs) == {"loss_d", "loss_g"}
    assert all(v.grad_fn is None for v in engine.step_outputs.values())  # detached: no graph kept past the step
    assert all(p.grad is None for p in engine.model.parameters())  # zeroed after every step


def test_a_vetoed_optimizer_does_not_step_and_the_window_says_so() -> None:
    engine = gan(epochs=1)
    d_before = [p.clone() for p in engine.optimizers["d"].param_groups[0]["params"]]
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: setattr(ev, "skip", ev.optimizer == "d"))
    stepped: list[bool] = []
    engine.on(Event.STEP_END, lambda ev: stepped.append(ev.stepped))
    engine.fit()
    assert all(torch.equal(a, b) for a, b in zip(d_before, engine.optimizers["d"].param_groups[0]["params"]))
    assert stepped == [True] * 5  # g stepped


def test_step_optimizer_is_refused_outside_a_step_function_and_for_unknown_names() -> None:
    model = torch.nn.Linear(2, 1)
    plain = Engine(model, torch.optim.SGD(model.parameters(), 0.1))
    with pytest.raises(ConfigError, match="step_optimizer\\(\\) is for a step function"):
        plain.step_optimizer()
    engine = gan(epochs=1)
    with pytest.raises(ConfigError, match=r"step_optimizer\('x'\): this engine's optimizers are \['d', 'g'\]"):
        engine.step_optimizer("x")
    with pytest.raises(ConfigError, match=r"accumulation_steps=2: a step function takes one batch per step"):
        engine.accumulation_steps = 2


def test_a_dict_without_a_step_function_steps_every_optimizer_on_the_loss() -> None:
    """An embeddings optimizer beside the rest: the loop's own step steps both, as two optimizers by hand do."""
    torch.manual_seed(0)
    data = [(torch.randint(0, 5, (4,)), torch.randn(4, 3)) for _ in range(3)]

    def run(named: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 3))
        emb, head = torch.optim.SGD(model[0].parameters(), 0.5), torch.optim.Adam(model[1].parameters(), 1e-2)
        if named:
            Engine(model, {"embeddings": emb, "head": head}, train_data=data, max_epochs=2,
                   loss_fn=torch.nn.MSELoss()).fit()  # fmt: skip
        else:
            for _ in range(2):
                for x, y in data:
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    emb.step(), head.step(), emb.zero_grad(), head.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False)))


def test_a_gan_resumes_mid_epoch_bit_exact_from_a_checkpoint(tmp_path: Path) -> None:
    from trainbus.plugins import resume

    whole = gan(str(tmp_path / "a"))
    whole.fit()  # 15 steps, 5 per epoch; checkpoints every 3
    names = {p.name for p in (tmp_path / "a" / "checkpoint-6").iterdir()}
    assert {"optimizer.json", "optimizer.safetensors"} <= names and not any(n.endswith((".pt", ".bin")) for n in names)
    for step in (3, 7 - 1, 12):  # inside epochs 1, 2 and 3
        again = gan(str(tmp_path / f"b{step}"))
        resume(again, tmp_path / "a" / f"checkpoint-{step}")
        again.fit()
        assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), again.model.parameters()))
        assert _same_optimizers(whole, again)
        assert again.state.global_step == 15


def test_a_checkpoint_of_other_names_is_refused_and_nothing_applied(tmp_path: Path) -> None:
    from trainbus.plugins import resume

    gan(str(tmp_path / "a"), epochs=1).fit()
    other = gan(str(tmp_path / "b"), epochs=1)
    opt_d, opt_g = other.optimizers["d"], other.optimizers["g"]
    other.optimizer = NamedOptimizers({"disc": opt_d, "gen": opt_g})
    with pytest.raises(ConfigError, match=r"named \['d', 'g'\], this engine's \['disc', 'gen'\]"):
        resume(other, tmp_path / "a" / "checkpoint-3")
    assert other.state.global_step == 0 and not opt_d.state


def test_the_resume_kit_passes_on_a_gan() -> None:
    # the kit saves in memory, without the data plugin a checkpoint brings: a fixed order
    check_resume_equivalence(lambda: gan(epochs=2, shuffle=False), max_examples=4)


def test_the_single_optimizer_hot_path_is_unchanged() -> None:
    """fit() picks the epoch runner once; the loop's own window body is not the step function's."""
    model = torch.nn.Linear(2, 1)
    engine = Engine(model, torch.optim.SGD(model.parameters(), 0.1), train_data=[(torch.ones(1, 2), torch.ones(1, 1))],
                    max_epochs=1, loss_fn=torch.nn.MSELoss())  # fmt: skip
    assert engine.step_function is None and engine.optimizers == {}
    with tempfile.TemporaryDirectory():
        assert engine.fit().optimizer_steps_taken == 1


def test_a_step_function_with_one_optimizer_steps_it_unnamed_and_schedules_follow() -> None:
    """Two views of a batch, one optimizer (a SimCLR-like step): step_optimizer(loss=...) with no name."""
    from trainbus.plugins import LRScheduler

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    data = [(torch.randn(4, 2),) for _ in range(3)]

    def two_views(engine: Any, batch: Any) -> torch.Tensor:
        (x,) = batch
        loss = (model(x + 0.1) - model(x - 0.1)).pow(2).mean() + model(x).pow(2).mean()
        assert engine.step_optimizer(loss=loss)
        return loss

    engine = Engine(model, torch.optim.SGD(model.parameters(), 0.1), train_data=data, max_epochs=2, step=two_views,
                    plugins=[LRScheduler("linear")])  # fmt: skip
    state = engine.fit()
    assert state.global_step == state.optimizer_steps_taken == 6
    assert engine.optimizer.param_groups[0]["lr"] == 0.0
    assert engine.step_outputs["output"].grad_fn is None
    with pytest.raises(ConfigError, match=r"step_optimizer\('d'\): this engine has one optimizer, without a name"):
        engine.step_optimizer("d")


def test_train_logger_under_a_step_function_logs_no_made_up_loss() -> None:
    """A step function's engine fires no LOSS (its losses are the function's): TrainLogger logs the learning
    rate and the epoch, never a 'loss' / 'train_loss' of 0.0."""
    from optim35_gan import gan

    from trainbus.plugins import FlowControl, TrainLogger

    engine = gan(epochs=1, plugins=(FlowControl(logging_steps=2, save_strategy="no"), TrainLogger()))
    engine.fit()
    history = engine.state.log_history
    assert history and all("loss" not in record and "train_loss" not in record for record in history), history
    assert any("train_runtime" in record for record in history)
