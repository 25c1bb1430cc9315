"""Plugins per named optimizer (#35 item 2): schedules, clipping and EMA by name; clear refusals otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.optim35_gan import gan
from trainbus.engine import ConfigError, Engine, Event, Priority
from trainbus.plugins import (
    EMA,
    SWA,
    GradientAccumulation,
    GradientClipping,
    LRScheduler,
    MixedPrecision,
    SkipNonFinite,
    resume,
)


def _norm(optimizer: Any) -> float:
    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def test_two_schedules_by_name_need_no_hidden_name_and_follow_their_optimizers() -> None:
    engine = gan(plugins=(LRScheduler("linear", optimizer="d"), LRScheduler("cosine", optimizer="g")))
    assert [p.name for p in engine.plugins] == ["LRScheduler[d]", "LRScheduler[g]"]
    lrs: list[tuple[float, float]] = []
    opt_d, opt_g = engine.optimizers["d"], engine.optimizers["g"]
    engine.on(Event.STEP_END, lambda ev: lrs.append((opt_d.param_groups[0]["lr"], opt_g.param_groups[0]["lr"])))
    engine.fit()
    ref_d = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    linear = torch.optim.lr_scheduler.LambdaLR(ref_d, lambda s: max(0.0, (15 - s) / 15))
    expected = []
    for _ in range(15):
        ref_d.step()
        linear.step()
        expected.append(ref_d.param_groups[0]["lr"])
    assert [d for d, _ in lrs] == pytest.approx(expected, abs=1e-12)
    assert [g for _, g in lrs] != [d for d, _ in lrs] and lrs[-1][1] == pytest.approx(0.0, abs=1e-12)


def test_schedules_resume_mid_epoch_bit_exact(tmp_path: Path) -> None:
    def build(out: str) -> Engine:
        return gan(out, plugins=(LRScheduler("linear", optimizer="d"), LRScheduler("cosine", optimizer="g")))

    whole = build(str(tmp_path / "a"))
    whole.fit()
    again = build(str(tmp_path / "b"))
    resume(again, tmp_path / "a" / "checkpoint-9")
    again.fit()
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), again.model.parameters()))
    for name in ("d", "g"):
        assert whole.optimizers[name].param_groups[0]["lr"] == again.optimizers[name].param_groups[0]["lr"]
        assert (
            whole.get_plugin(f"LRScheduler[{name}]").state_dict()
            == again.get_plugin(f"LRScheduler[{name}]").state_dict()
        )


def test_an_unnamed_schedule_or_an_unknown_name_is_refused_naming_the_names() -> None:
    with pytest.raises(
        ConfigError, match=r"several optimizers \['d', 'g'\]: give LRScheduler\(\.\.\., optimizer='d'\)"
    ):
        gan(plugins=(LRScheduler("linear"),))
    with pytest.raises(ConfigError, match=r"LRScheduler\(optimizer='x'\): this engine's optimizers are \['d', 'g'\]"):
        gan(plugins=(LRScheduler("linear", optimizer="x"),))
    with pytest.raises(ConfigError, match="optimizer must name one of the engine's optimizers"):
        LRScheduler("linear", optimizer=3)  # type: ignore[arg-type]


def _record_norms(engine: Engine) -> list[tuple[str, float]]:
    norms: list[tuple[str, float]] = []

    def record(ev: Any) -> None:
        norms.append((ev.optimizer, _norm(ev.engine.optimizers[ev.optimizer])))

    engine.on(Event.BEFORE_OPTIMIZER_STEP, record, priority=Priority.LAST)
    return norms


def test_clipping_by_name_clips_that_optimizer_only() -> None:
    engine = gan(epochs=1, plugins=(GradientClipping(max_norm=1e-3, optimizer="g"),))
    assert engine.plugins[0].name == "GradientClipping[g]"
    norms = _record_norms(engine)
    engine.fit()
    assert all(n <= 1e-3 * (1 + 1e-5) for name, n in norms if name == "g")
    assert all(n > 1e-2 for name, n in norms if name == "d")
    assert set(engine.step_outputs) == {"loss_d", "loss_g", "grad_norm_g"}


def test_unnamed_clipping_under_a_step_function_clips_each_optimizer_apart() -> None:
    engine = gan(epochs=1, plugins=(GradientClipping(max_norm=1e-3),))
    norms = _record_norms(engine)
    engine.fit()
    assert len(norms) == 10 and all(n <= 1e-3 * (1 + 1e-5) for _, n in norms)
    assert {"grad_norm_d", "grad_norm_g"} <= set(engine.step_outputs)


def test_ema_by_name_averages_that_optimizers_parameters_once_per_step() -> None:
    engine = gan(epochs=1, plugins=(EMA(0.5, optimizer="g"),))
    engine.fit()
    ema = engine.get_plugin("EMA[g]")
    assert ema.num_updates == 5 and set(ema.averages) == {
        n for n, _ in engine.model.named_parameters() if n.startswith("g.")
    }
    with pytest.raises(ConfigError, match=r"give EMA\(optimizer=name\)"):
        gan(plugins=(EMA(0.5),))


def test_plugins_that_cannot_serve_several_optimizers_name_the_supported_way() -> None:
    with pytest.raises(ConfigError, match=r"SWA .* several \['d', 'g'\]: .*EMA\(optimizer=name\)"):
        gan(plugins=(SWA(start_epoch=1),))
    with pytest.raises(ConfigError, match=r"SkipNonFinite .* several optimizers \['d', 'g'\]: veto .* ev\.skip"):
        gan(plugins=(SkipNonFinite(sync=True),))
    with pytest.raises(ConfigError, match=r"GradientAccumulation\(2\): .*batch\.chunk\(2\)"):
        gan(plugins=(GradientAccumulation(2),))


def test_the_loops_own_step_with_named_optimizers_takes_schedules_and_clipping_by_name() -> None:
    """An embeddings optimizer beside the rest, without a step function: one loss, both stepped, each scheduled."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 3))
    data = [(torch.randint(0, 5, (4,)), torch.randn(4, 3)) for _ in range(4)]
    optimizers = {"emb": torch.optim.SGD(model[0].parameters(), 0.5), "head": torch.optim.AdamW(model[1].parameters())}
    engine = Engine(model, optimizers, train_data=data, max_epochs=1, loss_fn=torch.nn.MSELoss(),
                    plugins=[LRScheduler("linear", optimizer="emb"), LRScheduler("constant", optimizer="head"),
                             GradientClipping(1e-3, optimizer="emb")])  # fmt: skip
    engine.fit()
    assert optimizers["emb"].param_groups[0]["lr"] == 0.0 and optimizers["head"].param_groups[0]["lr"] == 1e-3
    assert "grad_norm_emb" in engine.step_outputs


def test_fp16_under_a_step_function_equals_torchs_amp_recipe_with_one_scaler_bit_for_bit() -> None:
    """Forwards under autocast, each optimizer's backward / unscale / step / update outside it, one GradScaler."""
    engine = gan(epochs=2, plugins=(MixedPrecision("fp16", device_type="cpu"),))
    outside: list[bool] = []
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: outside.append(not torch.is_autocast_enabled("cpu")))
    engine.fit()
    assert outside and all(outside)

    reference = gan(epochs=2)  # the same nets, optimizers and loader, stepped by hand
    g, d = reference.model["g"], reference.model["d"]
    opt_d, opt_g = reference.optimizers["d"], reference.optimizers["g"]
    scaler = torch.amp.GradScaler("cpu")
    bce = torch.nn.BCEWithLogitsLoss()

    def step(optimizer: Any, loss: torch.Tensor) -> None:
        with torch.autocast("cpu", enabled=False):
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()

    for _ in range(2):
        for (x,) in reference.train_data:
            with torch.autocast("cpu", dtype=torch.float16):
                fake = g(torch.randn(len(x), 4))
                step(opt_d, bce(d(x), torch.ones(len(x), 1)) + bce(d(fake.detach()), torch.zeros(len(x), 1)))
                step(opt_g, bce(d(fake), torch.ones(len(x), 1)))
            opt_d.zero_grad(set_to_none=True), opt_g.zero_grad(set_to_none=True)
    assert all(torch.equal(a, b) for a, b in zip(engine.model.parameters(), reference.model.parameters()))
    assert engine.get_plugin(MixedPrecision).scaler.state_dict() == scaler.state_dict()


def test_mixed_precision_under_a_step_function_resumes_mid_epoch_bit_exact(tmp_path: Path) -> None:
    def build(out: str) -> Engine:
        return gan(out, plugins=(MixedPrecision("fp16", device_type="cpu"), LRScheduler("linear", optimizer="g")))

    whole = build(str(tmp_path / "a"))
    whole.fit()
    again = build(str(tmp_path / "b"))
    resume(again, tmp_path / "a" / "checkpoint-6")
    again.fit()
    assert all(torch.equal(a, b) for a, b in zip(whole.model.parameters(), again.model.parameters()))
    assert whole.get_plugin(MixedPrecision).state_dict() == again.get_plugin(MixedPrecision).state_dict()


def test_detaching_mixed_precision_gives_the_step_function_back() -> None:
    engine = gan(epochs=1)
    own = engine.step_function
    engine.add_plugin(MixedPrecision("bf16", device_type="cpu"))
    assert engine.step_function is not own
    engine.remove_plugin(MixedPrecision)
    assert engine.step_function is own
