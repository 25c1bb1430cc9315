"""check_resume_equivalence compares plugin attributes and says when the data order differs (#28 item 7).

A plugin whose ``state_dict()`` leaves a counter out used to pass when the counter changed nothing else
compared (model, optimizer, State, state_dict): the kit now compares every plain-data attribute of every
plugin (tensors by value) and names the field. And when the resumed run sees other batches than the
uninterrupted one, the message says the data order differs, at the first step whose batches differ.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch

from trainbus.engine import Engine, Event, Plugin
from trainbus.engine.testing import LoopConfig, ResumeMismatch, check_resume_equivalence, toy_engine

CONFIG = LoopConfig(dataset_size=8, batch_size=2, accumulation_steps=1, max_epochs=2, max_steps=None,
                    stop_at_step=None)  # fmt: skip


class CountsSteps(Plugin):
    """Counts steps and reports nothing else: the counter left out of state_dict changes no weight."""

    def __init__(self) -> None:
        self.seen = 0
        self.last_loss = torch.zeros(())

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.STEP_END, self.count)
        self.on(engine, Event.LOSS, self.keep)

    def count(self, ev: Any) -> None:
        self.seen += 1

    def keep(self, ev: Any) -> None:
        self.last_loss = ev.loss.detach().clone()

    def state_dict(self) -> dict[str, Any]:
        return {"last_loss": self.last_loss}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_loss = state["last_loss"]


def test_a_counter_left_out_of_state_dict_is_named() -> None:
    with pytest.raises(ResumeMismatch) as caught:
        check_resume_equivalence(lambda: toy_engine(CONFIG, plugins=[CountsSteps()]), at=3)
    message = str(caught.value)
    assert caught.value.step == 3 and caught.value.path == "/attributes/CountsSteps/seen"
    assert "CountsSteps.seen" in message and "resumed 0, uninterrupted 3" in message
    assert "not in its state_dict()" in message


def test_a_tensor_attribute_left_out_is_compared_by_value() -> None:
    class ForgetsLoss(CountsSteps):
        def state_dict(self) -> dict[str, Any]:
            return {"seen": self.seen}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.seen = state["seen"]

    with pytest.raises(ResumeMismatch, match=r"ForgetsLoss\.last_loss.*resumed tensor\(0"):
        check_resume_equivalence(lambda: toy_engine(CONFIG, plugins=[ForgetsLoss()]), at=2)


def test_attributes_declared_not_resumed_are_not_compared() -> None:
    class Timed(CountsSteps):
        not_resumed: ClassVar[tuple[str, ...]] = ("seen",)  # e.g. a start time: differs on purpose

    check_resume_equivalence(lambda: toy_engine(CONFIG, plugins=[Timed()]), at=3)
    check_resume_equivalence(lambda: toy_engine(CONFIG, plugins=[CountsSteps()]), at=3,
                             ignore_attributes=["CountsSteps.seen"])  # fmt: skip


_iterations = itertools.count()


class ReshuffledEachIteration:
    """Batches in an order drawn afresh by every iteration: a resumed epoch sees another order."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(self.batches), generator=torch.Generator().manual_seed(next(_iterations)))
        return iter([self.batches[i] for i in order.tolist()])


def test_a_different_data_order_is_named_as_such() -> None:
    def make() -> Engine:
        engine = toy_engine(CONFIG)
        assert engine.train_data is not None
        engine.train_data = ReshuffledEachIteration(list(engine.train_data))
        return engine

    with pytest.raises(ResumeMismatch) as caught:
        check_resume_equivalence(make, at=2)
    message = str(caught.value)
    assert "the data order differs" in message and caught.value.path.startswith("/batches")
    assert caught.value.step == 2  # the first window after the resume, before any weight differs
