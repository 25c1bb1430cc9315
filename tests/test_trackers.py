"""Experiment trackers: runs written by the real libraries (W&B, MLflow, Trackio), read back with their own readers.

Two groups: trainbus's ``report_to`` sinks (``wandb``, ``mlflow``, ``trackio``) and transformers' own
integration callbacks (TensorBoardCallback, WandbCallback, MLflowCallback, TrackioCallback) passed
unchanged in ``callbacks=[...]``. No test touches the network: W&B runs offline, MLflow writes a
file store, Trackio its local database; every location is under the test's temporary folder.
"""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from facade_helpers import Regressor, quiet_args, regression_data

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.plugins.facade.trainer import Trainer
from trainbus.plugins.observability import trackers
from trainbus.plugins.observability.sinks import rewrite_key
from trainbus.plugins.observability.trackers import SUMMARY_KEYS

#: environment variables that would send a run elsewhere than the test's folder, or change it
FOREIGN_ENV = (
    "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_LOG_MODEL", "WANDB_WATCH", "WANDB_ENTITY",
    "WANDB_BASE_URL", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_TAGS",
    "MLFLOW_NESTED_RUN", "MLFLOW_FLATTEN_PARAMS", "MLFLOW_MAX_LOG_PARAMS", "HF_MLFLOW_LOG_ARTIFACTS",
    "TENSORBOARD_LOGGING_DIR", "TRACKIO_SPACE_ID", "TRACKIO_SERVER_URL", "TRACKIO_BUCKET_ID",
)  # fmt: skip


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """Every tracker writes under tmp_path and stays off the network (wandb never asks for a login)."""
    for name in FOREIGN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 needs the opt-in for a file store
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield
    mlflow = sys.modules.get("mlflow")
    while mlflow is not None and mlflow.active_run() is not None:  # a failed test must not leak its run
        mlflow.end_run()


@pytest.fixture(scope="module")
def trackio_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Trackio's folder, redirected: TRACKIO_DIR is read once, at import, into module constants.

    Setting the variable covers a first import; patching the constants covers a trackio another test
    in this worker imported before. The tests then check the database file lies in this folder.
    """
    folder = tmp_path_factory.mktemp("trackio")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRACKIO_DIR", str(folder))
        pytest.importorskip("trackio", reason="trackio is not installed (pip install trackio)")
        for name, module in list(sys.modules.items()):
            if name.split(".")[0] == "trackio" and isinstance(getattr(module, "TRACKIO_DIR", None), Path):
                patch.setattr(module, "TRACKIO_DIR", folder)
        yield folder


@pytest.fixture
def wandb() -> Iterator[Any]:
    """wandb, torn down after the test: its settings (WANDB_DIR among them) are read once per setup."""
    module = pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    yield module
    module.teardown()


def train(tmp_path: Path, **kwargs: Any) -> Trainer:
    """Two epochs of a tiny regression: four training logs, two evaluations, the final train metrics."""
    callbacks = kwargs.pop("callbacks", None)
    args = quiet_args(
        tmp_path / "out", num_train_epochs=2, logging_steps=2, eval_strategy="epoch", learning_rate=0.05, **kwargs
    )
    trainer = Trainer(
        Regressor(),
        args,
        train_dataset=regression_data(16),
        eval_dataset=regression_data(8, seed=1),
        callbacks=callbacks,
    )
    trainer.train()
    return trainer


def dashboard_records(log_history: list[dict[str, Any]], summary_apart: bool) -> list[dict[str, Any]]:
    """What HF's W&B / Trackio integrations log per record: ``train/`` / ``eval/`` keys plus train/global_step."""
    records = []
    for record in log_history:
        keys = {
            rewrite_key(k): v for k, v in record.items() if k != "step" and not (summary_apart and k in SUMMARY_KEYS)
        }
        if keys:
            records.append({**keys, "train/global_step": record["step"]})
    return records


def approx_records(records: list[dict[str, Any]], rel: float = 1e-9) -> list[Any]:
    """Records compared key by key, numbers to ``rel`` (pytest.approx takes no list of dicts)."""
    return [pytest.approx(record, rel=rel) for record in records]


def metric_history(log_history: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return sorted((r["step"], float(r[key])) for r in log_history if key in r)


def assert_series(got: list[tuple[int, float]], expected: list[tuple[int, float]], key: str, rel: float = 1e-9) -> None:
    """Same steps, and values equal to ``rel`` (float32 where the tracker stores float32)."""
    assert [step for step, _ in got] == [step for step, _ in expected], key
    assert [value for _, value in got] == pytest.approx([value for _, value in expected], rel=rel), key


# -- readers: each library's own ---------------------------------------------------------------------
def wandb_records(folder: Path) -> list[dict[str, Any]]:
    """The records of every offline run under ``folder/wandb``, read by wandb's own ``wandb leet inspect``."""
    records: list[dict[str, Any]] = []
    for run_dir in sorted((folder / "wandb").glob("offline-run-*")):
        out = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        records += [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    return records


def wandb_history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    items = [r["history"]["item"] for r in records if r["type"] == "history"]
    return [{k: v for k, v in item.items() if not k.startswith("_")} for item in items]  # _step, _runtime: wandb's


def wandb_merged(records: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The run's summary or config: every update in order (the run record carries the first config)."""
    merged: dict[str, Any] = {}
    for r in records:
        if kind == "config" and r["type"] == "run":
            merged.update(r["run"].get("config", {}).get("update", {}))
        if r["type"] == kind:
            merged.update(r[kind].get("update", {}))
    return merged


def mlflow_client(tmp_path: Path) -> Any:
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (pip install mlflow-skinny)")
    return mlflow.MlflowClient((tmp_path / "mlruns").as_uri())


def mlflow_runs(tmp_path: Path) -> list[Any]:
    client = mlflow_client(tmp_path)
    return list(client.search_runs([e.experiment_id for e in client.search_experiments()]))


def trackio_logs(project: str, run: str) -> list[dict[str, Any]]:
    from trackio.sqlite_storage import SQLiteStorage

    logs = SQLiteStorage.get_logs(project, run)
    return [{k: v for k, v in entry.items() if k not in ("timestamp", "step")} for entry in logs]


def trackio_config(project: str) -> dict[str, Any]:
    import trackio

    runs = list(trackio.Api().runs(project))
    assert len(runs) == 1, [r.name for r in runs]
    return dict(runs[0].config or {})


# -- report_to sinks ---------------------------------------------------------------------------------
def test_tracker_names_are_registered_with_their_libraries() -> None:
    from trainbus.plugins.facade.composition import SINK_REQUIRES
    from trainbus.plugins.observability.logging import SINKS

    assert {"wandb", "mlflow", "trackio"} <= set(SINKS)
    assert {SINK_REQUIRES[n] for n in ("wandb", "mlflow", "trackio")} == {"wandb", "mlflow", "trackio"}


def test_wandb_sink_writes_the_log_history_summary_and_config(tmp_path: Path, wandb: Any) -> None:
    trainer = train(tmp_path, report_to=["wandb"], run_name="wb-run")
    history = trainer.state.log_history
    records = wandb_records(tmp_path)

    assert wandb_history(records) == approx_records(dashboard_records(history, summary_apart=True))
    final = history[-1]
    assert "train_loss" in final
    summary = wandb_merged(records, "summary")
    assert {k: summary[k] for k in SUMMARY_KEYS} == pytest.approx({k: final[k] for k in SUMMARY_KEYS})
    config = wandb_merged(records, "config")
    assert config["learning_rate"] == 0.05 and config["run_name"] == "wb-run"
    assert config["model/num_parameters"] == 3  # Linear(2, 1)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run["display_name"], run["project"]) == ("wb-run", "huggingface")
    assert [r["exit"].get("exit_code", 0) for r in records if r["type"] == "exit"] == [0]  # finished at TRAIN_END


def test_mlflow_sink_writes_metrics_params_and_reopens_for_a_later_evaluate(tmp_path: Path) -> None:
    client = mlflow_client(tmp_path)
    trainer = train(tmp_path, report_to=["mlflow"], run_name="ml-run")
    history = trainer.state.log_history
    (run,) = mlflow_runs(tmp_path)
    assert (run.info.run_name, run.info.status) == ("ml-run", "FINISHED")
    keys = {k for record in history for k in record if k != "step"}
    assert keys == set(run.data.metrics)  # every logged number, final train metrics included, as HF logs them
    for key in keys:
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert_series(got, metric_history(history, key), key)
    assert run.data.params["learning_rate"] == "0.05"
    assert run.data.params["model/num_parameters"] == "3"

    trainer.evaluate()  # outside training: the same run gets the record and is closed again
    (again,) = mlflow_runs(tmp_path)
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    evals = sorted(m.value for m in client.get_metric_history(run.info.run_id, "eval_loss"))
    assert evals == pytest.approx(sorted(float(r["eval_loss"]) for r in trainer.state.log_history if "eval_loss" in r))
    assert len(evals) == 3


def test_mlflow_sink_resumed_training_continues_the_same_run(tmp_path: Path) -> None:
    client = mlflow_client(tmp_path)
    first = train(tmp_path, report_to=["mlflow"], save_strategy="steps", save_steps=2)
    (run,) = mlflow_runs(tmp_path)
    checkpoint = tmp_path / "out" / "checkpoint-4"
    saved = json.loads((checkpoint / "plugins.json").read_text())["data"]["MLflowSink"]
    assert saved == {"run_id": run.info.run_id}  # the sink's checkpointed state

    args = quiet_args(
        tmp_path / "out", num_train_epochs=2, logging_steps=2, eval_strategy="epoch", learning_rate=0.05,
        report_to=["mlflow"], save_strategy="steps", save_steps=2,
    )  # fmt: skip
    second = Trainer(Regressor(), args, train_dataset=regression_data(16), eval_dataset=regression_data(8, seed=1))
    second.train(resume_from_checkpoint=str(checkpoint))
    (same,) = mlflow_runs(tmp_path)
    assert same.info.run_id == run.info.run_id and same.info.status == "FINISHED"
    logged = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
    resumed = [r["step"] for r in second.state.log_history if "loss" in r and r["step"] > 4]
    assert logged == sorted([r["step"] for r in first.state.log_history if "loss" in r] + resumed) == [2, 4, 6, 6, 8, 8]


def test_mlflow_sink_honours_hf_environment_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "trainbus-exp")
    monkeypatch.setenv("MLFLOW_TAGS", '{"team": "vision"}')
    monkeypatch.setenv("MLFLOW_MAX_LOG_PARAMS", "5")
    train(tmp_path, report_to=["mlflow"])
    client = mlflow_client(tmp_path)
    experiment = client.get_experiment_by_name("trainbus-exp")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.tags["team"] == "vision"
    assert len(run.data.params) == 5


def test_trackers_write_from_the_main_process_only(tmp_path: Path) -> None:
    class NotMain(Plugin):
        def attach(self, engine: Any) -> None:
            self.on(engine, Event.TRAIN_START, self.demote, priority=Priority.FIRST)

        def demote(self, ev: Any) -> None:
            ev.engine.state.is_world_process_zero = False

    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install mlflow-skinny)")
    trainer = train(tmp_path, report_to=["mlflow"], callbacks=[NotMain()])
    assert trainer.state.log_history  # records were made, but not sent
    assert not (tmp_path / "mlruns").exists()


def test_trackio_sink_writes_the_log_history_and_config(tmp_path: Path, trackio_dir: Path) -> None:
    trainer = train(tmp_path, report_to=["trackio"], run_name="tk-run", project="trainbus-sink")
    # Trackio has no run summary: the final train metrics are a record like the others
    expected = dashboard_records(trainer.state.log_history, summary_apart=False)
    assert trackio_logs("trainbus-sink", "tk-run") == approx_records(expected)
    config = trackio_config("trainbus-sink")
    assert config["learning_rate"] == 0.05 and config["model/num_parameters"] == 3
    assert (trackio_dir / "trainbus-sink.db").exists()


@pytest.mark.parametrize(("name", "install"), [("wandb", "wandb"), ("mlflow", "mlflow"), ("trackio", "trackio")])
def test_missing_library_raises_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, install: str
) -> None:
    monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    with pytest.raises(ConfigError, match=rf"report_to='{name}' needs the {name} package: pip install {install}"):
        Trainer(Regressor(), quiet_args(tmp_path, report_to=[name]), train_dataset=regression_data(4))


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("WANDB_LOG_MODEL", "end", r"WANDB_LOG_MODEL='end'.*allowed: unset or 'false'"),
        ("WANDB_WATCH", "weights", r"WANDB_WATCH must be one of .*got 'weights'"),
        ("MLFLOW_TAGS", "team=vision", r"MLFLOW_TAGS must be a JSON object.*got 'team=vision'"),
        ("MLFLOW_MAX_LOG_PARAMS", "many", r"MLFLOW_MAX_LOG_PARAMS must be a non-negative integer, got 'many'"),
        ("HF_MLFLOW_LOG_ARTIFACTS", "1", r"HF_MLFLOW_LOG_ARTIFACTS.*not supported"),
    ],
)
def test_bad_environment_raises_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    monkeypatch.setenv(variable, value)
    sink = "wandb" if variable.startswith("WANDB") else "mlflow"
    with pytest.raises(ConfigError, match=message):
        Trainer(Regressor(), quiet_args(tmp_path, report_to=[sink]), train_dataset=regression_data(4))


def test_tracker_arguments_are_checked() -> None:
    from trainbus.plugins.facade.arguments import TrainingArguments

    with pytest.raises(ConfigError, match=r"trackio_static_space_id must be a Space id, None .* or False"):
        TrainingArguments("x", trackio_static_space_id=True)
    with pytest.raises(ConfigError, match="project must be a non-empty string"):
        TrainingArguments("x", project="")
    sanitized = TrainingArguments("x", report_to=["wandb"]).to_sanitized_dict()
    assert sanitized["report_to"] == "['wandb']" and sanitized["train_batch_size"] == 8


def test_tracker_libraries_are_imported_only_when_named(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from trainbus.plugins import Trainer, TrainingArguments\n"
        "import torch\n"
        f"args = TrainingArguments({str(tmp_path)!r}, report_to=['jsonl'], use_cpu=True, disable_tqdm=True)\n"
        "Trainer(torch.nn.Linear(2, 1), args, train_dataset=[{'x': torch.zeros(2)}])\n"
        "print([m for m in ('wandb', 'mlflow', 'trackio') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_doctests() -> None:
    for name in ("wandb", "mlflow", "trackio"):
        pytest.importorskip(name, reason=f"{name} is not installed")
    assert doctest.testmod(trackers).failed == 0


# -- transformers' own integration callbacks, unchanged ------------------------------------------------
@pytest.fixture(scope="module")
def integrations() -> Any:
    return pytest.importorskip("transformers.integrations", reason="transformers is not installed")


def test_hf_tensorboard_callback(tmp_path: Path, integrations: Any) -> None:
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = train(tmp_path, callbacks=[integrations.TensorBoardCallback])
    (log_dir,) = (tmp_path / "out" / "runs").iterdir()  # HF's default: output_dir/runs/<time>_<host>
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    for key in ("loss", "eval_loss", "train_loss", "learning_rate"):
        got = [(e.step, e.value) for e in acc.Scalars(rewrite_key(key))]
        assert_series(got, metric_history(trainer.state.log_history, key), key, rel=1e-6)
    args_text = acc.Tensors("args/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(args_text)["learning_rate"] == 0.05  # args.to_json_string()


def test_hf_wandb_callback(tmp_path: Path, integrations: Any, wandb: Any) -> None:
    try:
        trainer = train(tmp_path, callbacks=[integrations.WandbCallback], run_name="hf-wb")
    finally:
        wandb.finish()  # HF's callback leaves the run open for the user to finish
    history = trainer.state.log_history
    records = wandb_records(tmp_path)
    assert wandb_history(records) == approx_records(dashboard_records(history, summary_apart=True))
    summary = wandb_merged(records, "summary")
    assert summary["train_loss"] == pytest.approx(history[-1]["train_loss"])
    config = wandb_merged(records, "config")
    assert config["learning_rate"] == 0.05 and config["output_dir"] == str(tmp_path / "out")
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert run["display_name"] == "hf-wb"


def test_hf_mlflow_callback(tmp_path: Path, integrations: Any) -> None:
    client = mlflow_client(tmp_path)
    trainer = train(tmp_path, callbacks=[integrations.MLflowCallback], run_name="hf-ml")
    (run,) = mlflow_runs(tmp_path)
    assert (run.info.run_name, run.info.status) == ("hf-ml", "FINISHED")
    for key in ("loss", "eval_loss", "train_loss", "grad_norm"):
        got = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert_series(got, metric_history(trainer.state.log_history, key), key)
    assert run.data.params["learning_rate"] == "0.05"


def test_hf_trackio_callback(tmp_path: Path, trackio_dir: Path, integrations: Any) -> None:
    trainer = train(tmp_path, callbacks=[integrations.TrackioCallback], run_name="hf-tk", project="hf-trackio")
    # HF's TrackioCallback leaves the final train metrics out of the curves
    expected = dashboard_records(trainer.state.log_history, summary_apart=True)
    assert trackio_logs("hf-trackio", "hf-tk") == approx_records(expected)
    assert trackio_config("hf-trackio")["learning_rate"] == 0.05
    assert (trackio_dir / "hf-trackio.db").exists()


def test_hf_callbacks_see_the_process_and_search_state(tmp_path: Path) -> None:
    """What the integration callbacks read from args and state exists with HF's meaning."""
    seen: dict[str, Any] = {}

    class Reader:
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            seen.update(
                world_zero=state.is_world_process_zero,
                search=state.is_hyper_param_search,
                trial=state.trial_name,
                project=args.project,
                space=args.trackio_space_id,
                private=args.hub_private_repo,
                static=args.trackio_static_space_id,
                model=model,
                config=args.to_dict(),
            )

    trainer = train(tmp_path, callbacks=[Reader()], run_name="r")
    assert seen["world_zero"] is True and seen["search"] is False and seen["trial"] is None
    assert (seen["project"], seen["space"], seen["private"], seen["static"]) == ("huggingface", None, None, None)
    assert seen["model"] is trainer.model and seen["config"]["run_name"] == "r"
    assert os.fspath(tmp_path / "out") == seen["config"]["output_dir"]
