"""Hooks documented as events are (#35 item 4): which plugins wrap a hook and in which order, where a user's
wrapper sits, and a handler or hook whose signature cannot take the loop's call fails when it is registered."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trainbus.engine import ConfigError, Engine, Event, Plugin
from trainbus.engine.signatures import HOOK_CALLS
from trainbus.hooks import Hooks
from trainbus.plugins import EvalCollector, HalfPrecisionEval, LabelSmoothing, MixedPrecision

ROOT = Path(__file__).resolve().parent.parent


def engine_with(*plugins: Plugin) -> Engine:
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    data = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
    return Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_epochs=1,
                  loss_fn=torch.nn.MSELoss(), plugins=list(plugins))  # fmt: skip


def autocast_probe(seen: list[bool]) -> Any:
    def wrapper(inner: Any) -> Any:
        def forward(model: torch.nn.Module, batch: Any) -> Any:
            seen.append(torch.is_autocast_enabled("cpu"))
            return inner(model, batch)

        return forward

    return wrapper


def test_a_users_wrapper_sits_outside_the_plugins_or_innermost_when_asked() -> None:
    engine = engine_with(MixedPrecision("bf16"))
    outside: list[bool] = []
    inside: list[bool] = []
    engine.wrap_hook("forward", autocast_probe(outside), owner="outside")
    engine.wrap_hook("forward", autocast_probe(inside), owner="inside", innermost=True)
    engine.fit()
    assert outside == [False] * 3 and inside == [True] * 3  # the probe read autocast off: now it can choose
    assert engine.describe_hooks()["forward"] == ["trainbus.hooks.step.forward", "inside", "MixedPrecision", "outside"]


def test_describe_hooks_follows_attach_order_and_detach() -> None:
    engine = engine_with(MixedPrecision("bf16"), LabelSmoothing(0.1), EvalCollector(), HalfPrecisionEval())
    layers = engine.describe_hooks()
    assert layers["compute_loss"][1:] == ["MixedPrecision", "LabelSmoothing"]
    assert layers["prediction_step"][1:] == ["EvalCollector", "HalfPrecisionEval"]
    engine.pop_plugin("MixedPrecision")
    assert engine.describe_hooks()["compute_loss"][1:] == ["LabelSmoothing"]


def test_events_md_lists_each_hooks_wrappers_and_the_rule_for_a_users_wrapper() -> None:
    page = (ROOT / "docs/events.md").read_text(encoding="utf-8")
    hooks = page[page.index("## Hooks") :]
    for name in HOOK_CALLS:
        assert f"### {name}" in hooks
    forward = hooks[hooks.index("### forward") : hooks.index("### compute_loss")]
    assert "Called as `forward(model, batch)`" in forward
    assert "`MixedPrecision` (`self._autocast`" in forward
    assert "`inner_probe` <- `MixedPrecision` <- `LabelSmoothing` <- `probe`" in forward
    assert "outside MixedPrecision's" in hooks and "innermost=True" in hooks


def test_hook_calls_name_every_hook() -> None:
    assert tuple(HOOK_CALLS) == Hooks.names()


@pytest.mark.parametrize(
    "register, message",
    [
        (lambda e: e.wrap_hook("forward", lambda inner: lambda batch: inner(batch)),
         r"hook 'forward' is called as forward\(model, batch\); the wrapper from .*<lambda>\(batch\), which cannot"),
        (lambda e: e.wrap_hook("forward", lambda: None), r"wrap_hook\('forward', wrapper\): the wrapper is called"),
        (lambda e: e.set_hook("compute_loss", lambda outputs: outputs),
         r"hook 'compute_loss' is called as compute_loss\(outputs, batch\); set_hook"),
        (lambda e: e.set_hook("backward", 3), r"hook 'backward' must be a function callable as backward\(loss\)"),
        (lambda e: e.on(Event.LOSS, lambda ev, extra: None),
         r"handler .* for event LOSS is called as handler\(payload\), the payload a LossEvent"),
        (lambda e: e.on(Event.STEP_END, lambda: None), r"for event STEP_END is called as handler\(payload\)"),
    ],
)  # fmt: skip
def test_a_wrong_signature_fails_at_registration_naming_the_hook_or_event(register: Any, message: str) -> None:
    engine = engine_with()
    before = engine.hooks
    with pytest.raises(ConfigError, match=message):
        register(engine)
    assert engine.describe() == {} and engine.describe_hooks() == engine_with().describe_hooks()
    assert engine.hooks.forward is before.forward  # nothing half-registered
    engine.fit()


def test_hooks_given_to_the_engine_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"hook 'forward' is called as forward\(model, batch\)"):
        Engine(torch.nn.Linear(1, 1), hooks=Hooks(forward=lambda batch: batch))


def test_a_plugin_wrapping_with_a_wrong_signature_is_named_and_detached() -> None:
    class BadWrap(Plugin):
        def attach(self, engine: Engine) -> None:
            self.on(engine, Event.STEP_END, self.step_end)
            self.wrap_hook(engine, "backward", lambda inner: lambda loss, scale: inner(loss))

        def step_end(self, ev: Any) -> None:
            pass

    engine = engine_with()
    with pytest.raises(ConfigError, match=r"hook 'backward' is called as backward\(loss\); the wrapper from BadWrap"):
        engine.add_plugin(BadWrap())
    assert engine.plugins == [] and engine.describe() == {}


def test_callables_without_a_signature_and_flexible_ones_are_accepted() -> None:
    engine = engine_with()
    engine.on(Event.STEP_END, print)  # a builtin: no signature to read, not refused
    engine.on(Event.STEP_END, lambda *args: None)
    engine.on(Event.STEP_END, lambda ev, extra=1: None)
    engine.set_hook("optimizer_step", lambda optimizer, *rest: optimizer.step())
    assert len(engine.describe()["STEP_END"]) == 3


@pytest.mark.parametrize("field", list(HOOK_CALLS))
def test_a_hook_that_is_not_a_function_is_named_once(field: str) -> None:
    from trainbus.engine.signatures import check_hooks

    with pytest.raises(ConfigError, match=rf"hook '{field}' must be a function callable as {field}\(.*; "
                                          r"Hooks\(\.\.\.\) gave 'x'$"):  # fmt: skip
        check_hooks(Hooks(**{field: "x"}))
    if field != "compute_loss":  # the Engine's own loss_fn replaces compute_loss (engine/loop.py checks that pair)
        with pytest.raises(ConfigError, match=rf"hook '{field}' must be a function .*; set_hook / Hooks.* gave 'x'"):
            Engine(torch.nn.Linear(1, 1), hooks=Hooks(**{field: "x"}), loss_fn=torch.nn.MSELoss())


def test_a_signature_error_is_a_type_error_too() -> None:
    engine = engine_with()
    with pytest.raises(TypeError, match=r"forward\(model, batch\)"):  # as Python's own error, for except TypeError
        engine.wrap_hook("forward", lambda inner: lambda batch: inner(batch))
