"""Log sinks: JSONL, CSV and TensorBoard files written by real runs and read back."""

from __future__ import annotations

import csv
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from facade_helpers import Regressor, quiet_args, regression_data
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import ConfigError, Engine
from trainbus.plugins.facade.trainer import Trainer
from trainbus.plugins.observability.logging import SINKS
from trainbus.plugins.observability.sinks import CsvSink, JsonlSink, TensorBoardSink, rewrite_key, to_json_value


def strict_json(line: str) -> dict[str, Any]:
    def refuse(name: str) -> Any:
        raise AssertionError(f"non-strict JSON constant {name} in {line!r}")

    return json.loads(line, parse_constant=refuse)  # type: ignore[no-any-return]


def without_id(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != "run_id"}


def jsonable(record: dict[str, Any]) -> dict[str, Any]:
    return {k: to_json_value(v) for k, v in record.items()}


def run_trainer(tmp_path: Path, report_to: list[str], **kwargs: Any) -> Trainer:
    args = quiet_args(
        tmp_path,
        report_to=report_to,
        num_train_epochs=2,
        logging_steps=2,
        eval_strategy="epoch",
        learning_rate=0.05,
        **kwargs,
    )
    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=regression_data(24),
        eval_dataset=regression_data(8, seed=1),
        compute_metrics=lambda p: {"mae": float(abs(p.predictions - p.label_ids).mean())},
    )
    trainer.train()
    return trainer


def test_report_to_names_are_registered() -> None:
    assert {"jsonl", "csv", "tensorboard", "console"} <= set(SINKS)


def test_unknown_report_to_names_the_sinks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="jsonl"):
        Trainer(Regressor(), quiet_args(tmp_path, report_to=["jsonll"]), train_dataset=regression_data(4))


def test_jsonl_and_csv_hold_the_log_history(tmp_path: Path) -> None:
    trainer = run_trainer(tmp_path, ["jsonl", "csv"])
    history = trainer.state.log_history
    assert any("eval_loss" in r for r in history) and any("train_loss" in r for r in history)

    lines = (tmp_path / "logs.jsonl").read_text().splitlines()
    run = trainer.state.run_id
    assert run is not None and all(strict_json(line)["run_id"] == run for line in lines)  # the run's id in each
    assert [without_id(strict_json(line)) for line in lines] == [jsonable(r) for r in history]

    with (tmp_path / "logs.csv").open(newline="") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames or []), list(reader)
    keys = list(dict.fromkeys(k for r in history for k in r))
    assert header[0] == "step" and set(header) == {*keys, "run_id"}
    assert len(rows) == len(history) and all(row.pop("run_id") == run for row in rows)
    for row, record in zip(rows, history, strict=True):
        assert {k for k, v in row.items() if v != ""} == set(record)
        for key, value in record.items():
            assert float(row[key]) == pytest.approx(float(value), rel=1e-12)


def test_evaluate_after_training_appends(tmp_path: Path) -> None:
    trainer = run_trainer(tmp_path, ["jsonl"])
    before = len((tmp_path / "logs.jsonl").read_text().splitlines())
    metrics = trainer.evaluate()
    lines = (tmp_path / "logs.jsonl").read_text().splitlines()
    assert len(lines) == before + 1
    assert strict_json(lines[-1])["eval_loss"] == pytest.approx(metrics["eval_loss"])


def test_a_fresh_run_starts_the_files_anew_and_sets_the_earlier_ones_aside(tmp_path: Path) -> None:
    first = run_trainer(tmp_path, ["jsonl", "csv"])
    written = {name: (tmp_path / name).read_bytes() for name in ("logs.jsonl", "logs.csv")}
    with pytest.warns(UserWarning, match=r"logs\.jsonl held records of another run; .* moved that file to"):
        second = run_trainer(tmp_path, ["jsonl", "csv"])
    assert len(first.state.log_history) == len(second.state.log_history)
    assert len((tmp_path / "logs.jsonl").read_text().splitlines()) == len(second.state.log_history)
    with (tmp_path / "logs.csv").open(newline="") as f:
        assert len(list(csv.DictReader(f))) == len(second.state.log_history)
    for name, content in written.items():  # the first run's files, byte for byte, beside
        (aside,) = tmp_path.glob(name.replace("logs.", "logs.*Z."))
        assert aside.read_bytes() == content


def test_a_file_of_unknown_records_is_set_aside_not_appended_to(tmp_path: Path) -> None:
    (tmp_path / "logs.jsonl").write_text('{"loss": 1.0, "step": 3}\n')  # no run_id: an older release's, or anyone's
    engine = _engine([JsonlSink(tmp_path / "logs.jsonl")])
    engine.state.global_step = 3  # as after a resume: TRAIN_START sees a run in progress
    with pytest.warns(UserWarning, match="held records of another run"):
        engine.fit()
    engine.log({"loss": 0.5})
    lines = (tmp_path / "logs.jsonl").read_text().splitlines()
    assert [strict_json(line) for line in lines] == [{"loss": 0.5, "step": 3, "run_id": engine.state.run_id}]
    (aside,) = tmp_path.glob("logs.*Z.jsonl")
    assert aside.read_text() == '{"loss": 1.0, "step": 3}\n'


def _engine(plugins: list[Any]) -> Engine:
    model = torch.nn.Linear(2, 1)
    return Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=[(torch.randn(2, 2), torch.randn(2, 1))],
        max_epochs=1,
        loss_fn=torch.nn.MSELoss(),
        plugins=plugins,
    )


def test_jsonl_is_strict_json_with_nan_and_inf(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "logs.jsonl"
    engine = _engine([JsonlSink(path)])
    engine.log({"a": math.nan, "b": math.inf, "c": -math.inf, "d": 1.5, "n": 3, "t": torch.tensor(0.25), "s": "x"})
    (record,) = [strict_json(line) for line in path.read_text().splitlines()]
    assert record.pop("run_id") == engine.state.run_id  # the run's id, set by the first record
    assert record == {"a": "nan", "b": "inf", "c": "-inf", "d": 1.5, "n": 3, "t": 0.25, "s": "x", "step": 0}
    assert float(record["a"]) != float(record["a"]) and float(record["b"]) == math.inf


def test_only_the_main_process_writes(tmp_path: Path) -> None:
    sinks = [JsonlSink(tmp_path / "a.jsonl"), CsvSink(tmp_path / "a.csv"), TensorBoardSink(tmp_path / "tb")]
    engine = _engine(sinks)
    engine.state.is_world_process_zero = False
    engine.log({"loss": 1.0})
    assert list(tmp_path.iterdir()) == []


def test_empty_records_are_not_written(tmp_path: Path) -> None:
    engine = _engine([JsonlSink(tmp_path / "a.jsonl"), CsvSink(tmp_path / "a.csv")])
    engine.log({})
    assert list(tmp_path.iterdir()) == []


records = st.lists(
    st.dictionaries(
        st.sampled_from(["loss", "eval_loss", "learning_rate", "epoch", "grad_norm", "name,with,commas"]),
        st.floats(allow_nan=True, allow_infinity=True, width=32) | st.integers(-5, 5),
        max_size=4,
    ),
    min_size=1,
    max_size=8,
)


@given(records)
def test_csv_header_grows_and_rows_keep_their_values(recs: list[dict[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "logs.csv"
        sink = CsvSink(path)
        written = [{**r, "step": i} for i, r in enumerate(recs)]
        for record in written:
            sink.write(record)
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header, rows = list(reader.fieldnames or []), list(reader)
        assert header == ["step", *dict.fromkeys(k for r in written for k in r if k != "step")]
        assert len(rows) == len(written)
        for row, record in zip(rows, written, strict=True):
            for key in header:
                if key not in record:
                    assert row[key] == ""
                elif isinstance(record[key], float) and math.isnan(record[key]):
                    assert math.isnan(float(row[key]))
                else:
                    assert float(row[key]) == record[key]
        assert not path.with_name("logs.csv.tmp").exists()


def test_tensorboard_scalars_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_dir = tmp_path / "tb"
    trainer = run_trainer(tmp_path, ["tensorboard"], logging_dir=str(log_dir))
    assert trainer.get_plugin(TensorBoardSink).writer is None  # closed at TRAIN_END
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "eval/loss", "eval/mae", "train/learning_rate", "train/train_loss"} <= tags
    history = trainer.state.log_history
    expected = [(r["step"], r["loss"]) for r in history if "loss" in r]
    got = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_tensorboard_default_dir_is_hf_runs_folder(tmp_path: Path) -> None:
    run_trainer(tmp_path, ["tensorboard"])
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert list(run_dir.glob("events.out.tfevents.*"))


def test_tensorboard_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # makes the import fail
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        TensorBoardSink(tmp_path)


def test_rewrite_key_follows_hf() -> None:
    assert [rewrite_key(k) for k in ("loss", "eval_loss", "test_accuracy", "epoch")] == [
        "train/loss",
        "eval/loss",
        "test/accuracy",
        "train/epoch",
    ]


def test_doctests() -> None:
    import doctest

    from trainbus.plugins.observability import sinks

    result = doctest.testmod(sinks)
    assert result.attempted > 0 and result.failed == 0


def test_resume_from_checkpoint_rewinds_the_logs(tmp_path: Path) -> None:
    """The resumed run cuts the file back to the records of its checkpoint, then logs the rest again."""

    def trainer() -> Trainer:
        args = quiet_args(
            tmp_path, report_to=["jsonl"], max_steps=4, logging_steps=1, save_strategy="steps", save_steps=2
        )
        return Trainer(Regressor(), args, train_dataset=regression_data(16))

    trainer().train()
    first = (tmp_path / "logs.jsonl").read_text().splitlines()
    resumed = trainer()
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    lines = (tmp_path / "logs.jsonl").read_text().splitlines()
    assert lines[:2] == first[:2]  # the checkpoint's records (steps 1 and 2), kept as written
    assert [strict_json(line)["step"] for line in lines] == [strict_json(line)["step"] for line in first]
    assert [strict_json(line).get("loss") for line in lines] == [strict_json(line).get("loss") for line in first]


def test_report_to_all_takes_only_sinks_whose_library_is_installed(monkeypatch: Any, tmp_path: Any) -> None:
    import importlib.util

    from trainbus.plugins.facade.composition import _sinks
    from trainbus.plugins.observability.sinks import CsvSink, JsonlSink, TensorBoardSink

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real_find_spec(name, *a)
    )
    kinds = {type(p) for p in _sinks(quiet_args(tmp_path, report_to="all"))}
    assert {JsonlSink, CsvSink} <= kinds and TensorBoardSink not in kinds
