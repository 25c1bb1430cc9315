"""``max_grad_norm=0``: no clipping, and the gradient norm still logged, as transformers logs it.

transformers 5.24 clips only when ``max_grad_norm > 0`` but measures the norm at every optimizer step either way
(``_get_grad_norm``: ``clip_grad_norm_`` to infinity) and logs it as ``grad_norm``. The same run under
transformers.Trainer and trainbus's Trainer logs the same losses and norms and ends with the same weights; the
norm is checked by hand on the engine plugin. ``max_grad_norm=None`` fails inside transformers' training step
(``None > 0``); trainbus refuses it when the arguments are made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from facade_helpers import Regressor, regression_data, tiny_bert, token_data

from trainbus.engine import ConfigError, Engine, Event, Priority
from trainbus.plugins import Trainer, TrainingArguments
from trainbus.plugins.optimization.clipping import GradientClipping

SETTINGS = {"max_steps": 3, "learning_rate": 0.05, "logging_steps": 1, "per_device_train_batch_size": 4,
            "use_cpu": True, "report_to": "none", "disable_tqdm": True, "save_strategy": "no", "seed": 7}  # fmt: skip


def run(implementation: str, output_dir: Path, **overrides: Any) -> Any:
    trainer_cls, args_cls = (
        (transformers.Trainer, transformers.TrainingArguments) if implementation == "transformers"
        else (Trainer, TrainingArguments)
    )  # fmt: skip
    args = args_cls(str(output_dir / implementation), **{**SETTINGS, **overrides})
    trainer = trainer_cls(tiny_bert(), args, train_dataset=token_data(16))
    trainer.train()
    return trainer


def steps(trainer: Any) -> list[dict[str, float]]:
    return [{k: r[k] for k in ("loss", "grad_norm", "learning_rate")} for r in trainer.state.log_history if "loss" in r]


#: until plugins/facade/composition.py composes GradientClipping(max_grad_norm, norm_when_off=True) at 0 (lead's file)


def test_max_grad_norm_zero_logs_the_norm_as_transformers(tmp_path: Path) -> None:
    hf, ours = run("transformers", tmp_path, max_grad_norm=0.0), run("trainbus", tmp_path, max_grad_norm=0.0)
    theirs, mine = steps(hf), steps(ours)
    assert len(theirs) == 3 and all(r["grad_norm"] > 0 for r in theirs)
    assert len(mine) == len(theirs)
    for a, b in zip(theirs, mine, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["learning_rate"] == pytest.approx(a["learning_rate"], rel=1e-6)
    for (name, a), b in zip(hf.model.state_dict().items(), ours.model.state_dict().values(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=name)


def test_max_grad_norm_zero_clips_nothing(tmp_path: Path) -> None:
    """The norms exceed 0.01 (the clipped run moves less); at 0 the run is the unclipped one, bit for bit."""
    off = run("trainbus", tmp_path / "off", max_grad_norm=0.0)
    huge = run("trainbus", tmp_path / "huge", max_grad_norm=1e9)
    assert steps(off) == steps(huge)
    for a, b in zip(off.model.state_dict().values(), huge.model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    clipped = run("trainbus", tmp_path / "clipped", max_grad_norm=0.01)
    assert steps(clipped)[0]["grad_norm"] == steps(off)[0]["grad_norm"]  # the norm before clipping
    assert steps(clipped)[1]["loss"] != steps(off)[1]["loss"]


def test_max_grad_norm_none(tmp_path: Path) -> None:
    """transformers takes None and fails at its first step (``None > 0``); trainbus refuses it when the arguments are
    made, naming the value (0 turns clipping off)."""
    with pytest.raises(TypeError, match="NoneType"):
        run("transformers", tmp_path, max_grad_norm=None)
    with pytest.raises(ConfigError, match="max_grad_norm must be a number, got None"):
        TrainingArguments(str(tmp_path / "none"), max_grad_norm=None)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_norm_when_off_measures_without_changing_the_gradients(norm_type: float) -> None:
    torch.manual_seed(0)
    model = Regressor()
    data = [(torch.stack([d["x"] for d in regression_data(4)]), torch.stack([d["labels"] for d in regression_data(4)]))]
    seen: dict[str, Any] = {}

    def before(ev: Any) -> None:
        seen["grads"] = [p.grad.clone() for p in ev.engine.model.parameters()]

    def after(ev: Any) -> None:  # after the plugin, before the optimizer steps
        seen["after"] = [p.grad.clone() for p in ev.engine.model.parameters()]
        seen["norm"] = ev.engine.step_outputs.get("grad_norm")

    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.0), train_data=data, max_epochs=1,
                    loss_fn=lambda out, y: torch.nn.functional.mse_loss(out.squeeze(-1), y * 100),
                    plugins=[GradientClipping(max_norm=0, norm_type=norm_type, norm_when_off=True)])  # fmt: skip
    engine.on(Event.BEFORE_OPTIMIZER_STEP, before, priority=Priority.FIRST)
    engine.on(Event.BEFORE_OPTIMIZER_STEP, after, priority=Priority.LAST)
    engine.fit()
    flat = torch.cat([g.reshape(-1) for g in seen["grads"]])
    expected = flat.abs().max() if norm_type == float("inf") else flat.abs().pow(norm_type).sum().pow(1 / norm_type)
    assert seen["norm"] == pytest.approx(float(expected), rel=1e-6) and float(expected) > 1.0
    assert all(torch.equal(a, b) for a, b in zip(seen["grads"], seen["after"], strict=True))


def test_norm_off_by_default_on_the_engine_plugin() -> None:
    assert GradientClipping(max_norm=0).norm_when_off is False
    with pytest.raises(Exception, match="norm_when_off must be True or False"):
        GradientClipping(max_norm=0, norm_when_off="yes")  # type: ignore[arg-type]
