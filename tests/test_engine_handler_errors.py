"""A handler's exception reaches the caller as itself (#28 item 3), with the handler and the event attached.

``except MyError:`` around ``engine.fit()`` must catch a ``MyError`` raised in a handler: the exception is
the same object, its type unchanged, and it carries ``trainbus_handler`` / ``trainbus_event`` attributes and
a PEP 678 note naming both.
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from trainbus.engine import Engine, Event, EventBus, Plugin


class MyError(Exception):
    pass


def bare_engine(**kwargs: object) -> Engine:
    model = torch.nn.Linear(3, 1)
    data = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(4)]
    return Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_epochs=1,
        loss_fn=torch.nn.MSELoss(), **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.mark.parametrize("event", [Event.LOSS, Event.STEP_END, Event.TRAIN_START, Event.TRAIN_END, Event.EPOCH_END])
@pytest.mark.parametrize("neighbours", [0, 1])  # a lone handler has its own caller; several share the loop
def test_except_my_error_catches_a_handler_failure(event: Event, neighbours: int) -> None:
    raised = MyError("mine")
    engine = bare_engine()
    for _ in range(neighbours):
        engine.on(event, lambda ev: None, name="quiet")

    def explode(ev: object) -> None:
        raise raised

    engine.on(event, explode, name="exploder")
    try:
        engine.fit()
    except MyError as caught:
        assert caught is raised
        assert caught.trainbus_handler == "exploder"  # type: ignore[attr-defined]
        assert caught.trainbus_event == event.name  # type: ignore[attr-defined]
        if sys.version_info >= (3, 11):
            assert f"raised by handler 'exploder' at event {event.name}" in caught.__notes__
    else:
        pytest.fail("MyError did not reach the caller as itself")


def test_a_plugin_handler_failure_in_evaluate_keeps_its_type_and_names_the_plugin() -> None:
    class Metric(Plugin):
        def attach(self, engine: Engine) -> None:
            self.on(engine, Event.EVAL_END, self.compute)

        def compute(self, ev: object) -> None:
            raise KeyError("accuracy")

    engine = bare_engine(plugins=[Metric()], eval_data=[(torch.randn(2, 3), torch.randn(2, 1))])
    with pytest.raises(KeyError) as info:
        engine.evaluate()
    assert info.value.trainbus_handler == "Metric.compute"  # type: ignore[attr-defined]
    assert info.value.trainbus_event == "EVAL_END"  # type: ignore[attr-defined]


def test_a_nested_dispatch_keeps_the_innermost_handler_and_notes_the_outer_one() -> None:
    bus = EventBus()
    bus.on(Event.LOSS, lambda ev: (_ for _ in ()).throw(MyError("deep")), name="inner")
    bus.on(Event.LOG, lambda ev: bus.fire(Event.LOSS, None), name="outer")
    with pytest.raises(MyError) as info:
        bus.fire(Event.LOG, None)
    assert info.value.trainbus_handler == "inner" and info.value.trainbus_event == "LOSS"  # type: ignore[attr-defined]
    if sys.version_info >= (3, 11):
        assert info.value.__notes__ == [
            "raised by handler 'inner' at event LOSS",
            "raised by handler 'outer' at event LOG",
        ]


def test_handler_error_is_a_deprecated_name_that_nothing_raises() -> None:
    import trainbus.engine as engine_package

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handler_error = engine_package.HandlerError
    assert any(issubclass(w.category, DeprecationWarning) and "reaches the caller as itself" in str(w.message)
               for w in caught)  # fmt: skip
    assert "HandlerError" not in engine_package.__all__
    engine = bare_engine()
    engine.on(Event.LOSS, lambda ev: (_ for _ in ()).throw(MyError("x")))
    with pytest.raises(MyError) as info:
        engine.fit()
    assert not isinstance(info.value, handler_error)


def test_the_events_page_says_how_a_handler_failure_reaches_the_caller() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "events.md").read_text(encoding="utf-8")
    assert "reaches the caller of fit / evaluate / predict as itself" in page
    assert "trainbus_handler" in page and "HandlerError" not in page
