"""A log sink with no TrainLogger to fill its records warns when fit() starts (#28 item 5)."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from trainbus.engine import CompositionWarning, Engine
from trainbus.plugins import CsvSink, FlowControl, JsonlSink, TrainLogger


def _composition_warnings(*plugins: object) -> list[str]:
    model = torch.nn.Linear(2, 1)
    data = [(torch.zeros(1, 2), torch.zeros(1, 1))] * 2
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_steps=2,
                    loss_fn=torch.nn.MSELoss(), plugins=list(plugins))  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.fit()
    return [str(w.message) for w in caught if issubclass(w.category, CompositionWarning)]


def test_a_sink_without_a_train_logger_warns_naming_its_file(tmp_path: Path) -> None:
    found = _composition_warnings(JsonlSink(tmp_path / "logs.jsonl"), CsvSink(tmp_path / "logs.csv"))
    assert any(m.startswith("JsonlSink") and "logs.jsonl" in m and "no TrainLogger" in m for m in found), found
    assert any(m.startswith("CsvSink") and "logs.csv" in m for m in found), found


def test_a_sink_with_a_train_logger_is_quiet(tmp_path: Path) -> None:
    found = _composition_warnings(JsonlSink(tmp_path / "logs.jsonl"), TrainLogger(), FlowControl(logging_steps=1))
    assert not [m for m in found if "Sink" in m], found
