"""Order declarations that name nothing that ever attaches are an error by fit() (#28 item 4).

``before="GradientCliping"`` (a typo) used to be kept as a constraint that never applied, so the
handler ran after the clipping with no word. By the time fit() starts, every ``before=`` / ``after=``
name must name a handler or a plugin of this engine (or a plugin class that exists), and the error
suggests the close names.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainbus.engine import ConfigError, Engine, Event, Plugin, Priority
from trainbus.engine.ordering import register_order_names


class GradientClipping(Plugin):  # a stand-in with the real plugin's name, so the engine test stays bare
    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.BEFORE_OPTIMIZER_STEP, self.clip)

    def clip(self, ev: Any) -> None:
        pass


def bare_engine(*plugins: Plugin) -> Engine:
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(2)]
    return Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_epochs=1,
                  loss_fn=torch.nn.MSELoss(), plugins=plugins)  # fmt: skip


def test_a_misspelled_plugin_name_is_an_error_at_fit_suggesting_the_close_one() -> None:
    engine = bare_engine(GradientClipping())
    ran: list[int] = []
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: ran.append(1), name="mine", before="GradientCliping")
    with pytest.raises(ConfigError, match=r"before='GradientCliping'.*did you mean 'GradientClipping'") as info:
        engine.fit()
    assert "'mine'" in str(info.value) and "BEFORE_OPTIMIZER_STEP" in str(info.value)
    assert ran == [] and engine.state.global_step == 0  # refused before anything ran


def test_a_misspelled_handler_name_in_a_plugin_priority_is_an_error_too() -> None:
    class Late(Plugin):
        priority = Priority.DEFAULT.after("GradientClipping.clipp")

        def attach(self, engine: Engine) -> None:
            self.on(engine, Event.BEFORE_OPTIMIZER_STEP, self.look)

        def look(self, ev: Any) -> None:
            pass

    engine = bare_engine(GradientClipping(), Late())
    with pytest.raises(ConfigError, match=r"after='GradientClipping.clipp'.*did you mean 'GradientClipping.clip'"):
        engine.fit()


def test_names_that_resolve_or_name_a_plugin_class_not_attached_are_fine() -> None:
    engine = bare_engine(GradientClipping())
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: None, name="a", before=["GradientClipping", "b"])
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: None, name="b", after="*")
    engine.on(Event.LOSS, lambda ev: None, after="GradientClipping.clip")  # a handler of another event
    engine.on(Event.STEP_END, lambda ev: None, after="Unattached")  # a plugin class that exists, optional here
    engine.on(Event.STEP_END, lambda ev: None, before="Registered.method")  # a name a plugin package registered
    assert engine.fit().global_step == 2


class Unattached(Plugin):
    pass


register_order_names("Registered")


def test_a_name_that_attaches_later_but_before_fit_is_fine() -> None:
    engine = bare_engine()
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: None, name="mine", before="Clipper")
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: None, name="Clipper")
    assert engine.fit().global_step == 2


def test_a_peer_exported_by_the_package_of_an_attached_plugin_is_fine(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    package = types.ModuleType("somepkg")
    package.__all__ = ["LazyPeer"]  # type: ignore[attr-defined]  # exported lazily: its class is not defined yet
    monkeypatch.setitem(__import__("sys").modules, "somepkg", package)

    class Swapper(Plugin):
        def attach(self, engine: Engine) -> None:
            self.on(engine, Event.EVAL_START, self.swap, before="LazyPeer")

        def swap(self, ev: Any) -> None:
            pass

    Swapper.__module__ = "somepkg.swapper"
    assert bare_engine(Swapper()).fit().global_step == 2
    Swapper.__module__ = __name__
    with pytest.raises(ConfigError, match="before='LazyPeer'"):
        bare_engine(Swapper()).fit()
