"""docs/events.md is generated from the payload docstrings, and a stale copy fails here."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

from trainbus.engine import Event
from trainbus.engine.testing.describe import DOC_PATH, render, split_attributes

ROOT = Path(__file__).resolve().parent.parent


def test_docs_events_md_is_current() -> None:
    from trainbus.plugins.cli.describe import render_page

    current = (ROOT / DOC_PATH).read_text(encoding="utf-8")
    assert current == render_page(), "docs/events.md is stale: run `python -m trainbus.plugins.cli.describe --write`"


def test_the_page_lists_the_default_trainers_handlers_in_order() -> None:
    from trainbus.plugins.cli.describe import default_trainer_order

    page = (ROOT / DOC_PATH).read_text(encoding="utf-8")
    order = default_trainer_order()
    assert "`GradientClipping.clip`" in page and order["BEFORE_OPTIMIZER_STEP"] == ["GradientClipping.clip"]
    for event, handlers in order.items():
        assert ", ".join(f"`{h}`" for h in handlers) in page, event
    assert "The default Trainer's handlers" not in render()  # the engine alone knows no plugin


def test_every_payload_says_when_it_fires_and_describes_every_field() -> None:
    for event in Event.ALL:
        payload = event.payload_type
        prose, meanings = split_attributes(inspect.getdoc(payload) or "")
        assert prose.startswith("Fires"), f"{payload.__name__}'s docstring should start with when it fires"
        fields = {f.name for f in dataclasses.fields(payload)} - {"engine"}
        assert set(meanings) == fields, f"{payload.__name__}: documented {sorted(meanings)}, fields {sorted(fields)}"


def test_tensor_fields_are_typed_as_tensors() -> None:
    from trainbus.engine.payloads import BackwardEndEvent, EvalBatchEndEvent, LossEvent

    assert LossEvent.__annotations__["loss"] == "torch.Tensor"
    assert BackwardEndEvent.__annotations__["loss"] == "torch.Tensor"
    assert EvalBatchEndEvent.__annotations__["loss"] == "torch.Tensor | None"
