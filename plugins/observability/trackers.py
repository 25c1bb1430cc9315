"""Experiment trackers as ``report_to`` sinks: Weights & Biases, MLflow and Trackio, each through its own client.

Importing this module adds ``"wandb"``, ``"mlflow"`` and ``"trackio"`` to ``logging.SINKS``. A tracker's
library is imported only when its sink is constructed; a missing one raises ``ConfigError`` with the
pip command. Each sink follows the transformers callback of that name (``WandbCallback``,
``MLflowCallback``, ``TrackioCallback``): the same environment variables, run name, metric names and
run config. On the world main process only, a sink:

- opens a run at TRAIN_START (or at the first record of an ``evaluate()`` outside training), with the
  run config: the ``TrainingArguments`` over the model's ``config`` (and ``peft_config``);
- writes every LOG record at ``state.global_step``;
- puts the final training metrics (``train_runtime``, ..., ``train_loss``, ``total_flos``) in the run
  summary where the tracker has one (W&B), else logs them like the other records;
- closes the run at TRAIN_END, after that final record. An ``evaluate()`` outside training reopens the
  same run and closes it at its EVAL_END.

The run's id is the sink's checkpointed state, so a training resumed from a checkpoint continues the
same tracker run. Where the files go is each library's own setting: ``WANDB_DIR`` / ``WANDB_MODE``,
``MLFLOW_TRACKING_URI`` / ``MLFLOW_EXPERIMENT_NAME``, ``TRACKIO_DIR`` (or ``trackio_space_id``).
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Mapping
from numbers import Real
from typing import TYPE_CHECKING, Any

from trainbus.engine import ConfigError

from .logging import SINKS
from .sinks import rewrite_key
from .tracker_base import (
    SUMMARY_KEYS,
    TrackerSink,
    _env_flag,
    _flatten,
    _import,
    _json_object_env,
    check_names,
    logger,
    run_config,
)

if TYPE_CHECKING:
    from trainbus.engine import State

__all__ = ["MLflowSink", "TrackerSink", "TrackioSink", "WandbSink", "run_config"]


class WandbSink(TrackerSink):
    """Logs to Weights & Biases through ``wandb`` (``report_to="wandb"``), as HF's ``WandbCallback``.

    Keys as on HF's dashboards: ``train/loss``, ``eval/loss``, with ``train/global_step`` as the x-axis;
    the final training metrics go to ``run.summary``. A run the user started (``wandb.run``) is logged
    into and left open. ``WANDB_PROJECT`` wins over ``project``; ``WANDB_WATCH`` (``gradients``,
    ``parameters``, ``all``) watches the model; ``WANDB_MODE=offline`` and ``WANDB_DIR`` are wandb's own.

    Args:
        project: the W&B project (HF's ``args.project``).
        name: the run name (``args.run_name``); in a hyperparameter search the trial's name.
        group: the group of a search's trial runs (``args.run_name`` or ``output_dir``).
        config: the run's hyperparameters.

    Raises:
        ConfigError: wandb is missing, or ``WANDB_LOG_MODEL`` / ``WANDB_WATCH`` has a value not allowed.

    Example:
        >>> from trainbus.plugins.observability.trackers import WandbSink
        >>> sink = WandbSink(project="demo", name="baseline")
    """

    def __init__(
        self,
        project: str = "huggingface",
        name: str | None = None,
        group: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(config)
        check_names(project=project, name=name, group=group)
        log_model = os.environ.get("WANDB_LOG_MODEL", "false").lower()
        if log_model not in ("false", ""):
            raise ConfigError(
                f"WANDB_LOG_MODEL={log_model!r}: uploading models is not supported by the wandb sink "
                "(allowed: unset or 'false'); log the saved model with wandb.log_artifact after training"
            )
        self.watch = os.environ.get("WANDB_WATCH", "false").lower() or "false"
        if self.watch not in ("false", "gradients", "parameters", "all"):
            raise ConfigError(
                f"WANDB_WATCH must be one of 'false', 'gradients', 'parameters', 'all', got {self.watch!r}"
            )
        self.wandb = _import("wandb", "wandb")
        self.project = os.environ.get("WANDB_PROJECT") or project
        self.name, self.group = name, group
        self.run: Any = None
        self._owned = False

    def open(self, model: Any, state: State) -> str:
        wandb = self.wandb
        if wandb.run is not None and self.run_id is None:  # the user's own run: log into it, leave it open
            self.run, self._owned = wandb.run, False
        else:
            names = {"name": state.trial_name, "group": self.group} if state.trial_name else {"name": self.name}
            resume = {"id": self.run_id, "resume": "allow"} if self.run_id else {}
            self.run, self._owned = wandb.init(project=self.project, **names, **resume), True
        self.run.config.update(run_config(self.config, model), allow_val_change=True)
        self.run.define_metric("train/global_step")
        self.run.define_metric("*", step_metric="train/global_step", step_sync=True)
        if self.watch != "false":
            self.run.watch(model, log=self.watch, log_freq=max(100, state.logging_steps))
        return str(self.run.id)

    def write(self, logs: dict[str, Any], step: int) -> None:
        history = {rewrite_key(k): v for k, v in logs.items() if k not in SUMMARY_KEYS}
        for key in SUMMARY_KEYS:
            if key in logs:
                self.run.summary[key] = logs[key]
        if history:
            self.run.log({**history, "train/global_step": step})

    def close(self) -> None:
        if self._owned:
            self.run.finish()
        self.run = None


class MLflowSink(TrackerSink):
    """Logs to MLflow through ``mlflow`` (``report_to="mlflow"``), as HF's ``MLflowCallback``.

    Metrics keep their log names (``loss``, ``eval_loss``; characters MLflow refuses become ``_``) at
    ``step=global_step``; the config is logged as params (values over MLflow's length limit are
    dropped, as HF does). MLflow reads ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_NAME`` and
    ``MLFLOW_RUN_ID`` itself; this sink adds HF's ``MLFLOW_NESTED_RUN``, ``MLFLOW_TAGS`` (a JSON
    object), ``MLFLOW_FLATTEN_PARAMS`` and ``MLFLOW_MAX_LOG_PARAMS``. An active run the user started is
    logged into and left open (unless ``MLFLOW_NESTED_RUN``: then the run is its child).

    Args:
        name: the run name (``args.run_name``).
        config: the run's hyperparameters.

    Raises:
        ConfigError: mlflow is missing, ``MLFLOW_TAGS`` is not a JSON object, ``MLFLOW_MAX_LOG_PARAMS``
            is not an integer, or ``HF_MLFLOW_LOG_ARTIFACTS`` is set.

    Example:
        >>> from trainbus.plugins.observability.trackers import MLflowSink
        >>> sink = MLflowSink(name="baseline")
    """

    def __init__(self, name: str | None = None, config: Mapping[str, Any] | None = None) -> None:
        super().__init__(config)
        check_names(name=name)
        if _env_flag("HF_MLFLOW_LOG_ARTIFACTS"):
            raise ConfigError(
                "HF_MLFLOW_LOG_ARTIFACTS: logging checkpoints as artifacts is not supported by the mlflow sink "
                "(allowed: unset or false); log them with mlflow.log_artifacts after training"
            )
        self.tags = _json_object_env("MLFLOW_TAGS")
        max_params = os.environ.get("MLFLOW_MAX_LOG_PARAMS")
        if max_params is not None and not max_params.isdigit():
            raise ConfigError(f"MLFLOW_MAX_LOG_PARAMS must be a non-negative integer, got {max_params!r}")
        self.max_params = None if max_params is None else int(max_params)
        self.nested = _env_flag("MLFLOW_NESTED_RUN")
        self.flatten = _env_flag("MLFLOW_FLATTEN_PARAMS")
        self.mlflow = _import("mlflow", "mlflow (or mlflow-skinny)")
        self.name = name
        self._owned = False

    def open(self, model: Any, state: State) -> str:
        mlflow = self.mlflow
        active = mlflow.active_run()
        if active is not None and not self.nested and self.run_id is None:  # the user's run: log into it
            self._owned = False
            return str(active.info.run_id)
        fresh = self.run_id is None and not os.environ.get("MLFLOW_RUN_ID")
        run = mlflow.start_run(run_id=self.run_id, run_name=self.name, nested=active is not None)
        self._owned = True
        if fresh:  # a resumed run has its params already (MLflow refuses to change them)
            self._log_params(run.info.run_id, run_config(self.config, model))
            if self.tags:
                mlflow.set_tags(self.tags)
        return str(run.info.run_id)

    def _log_params(self, run_id: str, config: dict[str, Any]) -> None:
        validation = self.mlflow.utils.validation
        params = _flatten(config) if self.flatten else config
        kept = {k: v for k, v in params.items() if len(str(v)) <= validation.MAX_PARAM_VAL_LENGTH}
        if len(kept) < len(params):
            dropped = sorted(set(params) - set(kept))
            logger.warning("mlflow: params %s are longer than MLflow allows and were not logged", dropped)
        items = list(kept.items())[: self.max_params]
        batch = validation.MAX_PARAMS_TAGS_PER_BATCH
        for i in range(0, len(items), batch):
            self.mlflow.log_params(dict(items[i : i + batch]), run_id=run_id)

    def write(self, logs: dict[str, Any], step: int) -> None:
        metrics = {}
        for key, value in logs.items():
            if isinstance(value, Real):
                metrics[re.sub(r"[^0-9A-Za-z_\-\.\ :/]", "_", key)] = float(value)
            else:
                logger.warning("mlflow logs numbers only; %r=%r was not logged", key, value)
        if metrics:
            self.mlflow.log_metrics(metrics, step=step, run_id=self.run_id)

    def close(self) -> None:
        if not self._owned:
            return
        active = self.mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            self.mlflow.end_run()
        else:  # the user started another run on top of ours: end ours without touching theirs
            self.mlflow.MlflowClient().set_terminated(self.run_id)


class TrackioSink(TrackerSink):
    """Logs to Trackio through ``trackio`` (``report_to="trackio"``), as HF's ``TrackioCallback``.

    Locally the run goes to Trackio's database under ``TRACKIO_DIR`` (default
    ``~/.cache/huggingface/trackio``); with ``space_id`` to a Hugging Face Space, which is frozen into
    a static Space after training as HF does (``static_space_id=False`` skips that). Keys as on HF's
    dashboards (``train/loss``, ``eval/loss``, plus ``train/global_step``); Trackio has no run summary,
    so the final training metrics are logged like the other records.

    Args:
        project: the Trackio project (``args.project``).
        name: the run name (``args.run_name``); Trackio names an unnamed run.
        config: the run's hyperparameters.
        space_id, bucket_id, private, static_space_id: HF's ``trackio_space_id``,
            ``trackio_bucket_id``, ``hub_private_repo`` and ``trackio_static_space_id``.

    Raises:
        ConfigError: trackio is missing.

    Example:
        >>> from trainbus.plugins.observability.trackers import TrackioSink
        >>> sink = TrackioSink(project="demo", name="baseline")
    """

    def __init__(
        self,
        project: str = "huggingface",
        name: str | None = None,
        config: Mapping[str, Any] | None = None,
        space_id: str | None = None,
        bucket_id: str | None = None,
        private: bool | None = None,
        static_space_id: str | bool | None = None,
    ) -> None:
        super().__init__(config)
        check_names(project=project, name=name, space_id=space_id, bucket_id=bucket_id)
        self.trackio = _import("trackio", "trackio")
        self.project, self.name = project, name
        self.space_id, self.bucket_id, self.private = space_id, bucket_id, private
        self.static_space_id = static_space_id
        self.run: Any = None
        self._space: str | None = None

    def open(self, model: Any, state: State) -> str:
        self.run = self.trackio.init(
            project=self.project,
            name=self.run_id or self.name,  # Trackio resumes a run by its name
            space_id=self.space_id,
            bucket_id=self.bucket_id,
            private=self.private,
            resume="allow",
            config=run_config(self.config, model),
        )
        # the Space Trackio logs to: ours, or TRACKIO_SPACE_ID's (what HF's callback freezes)
        self._space = self.trackio.context_vars.current_space_id.get()
        return str(self.run.name)

    def write(self, logs: dict[str, Any], step: int) -> None:
        self.run.log({**{rewrite_key(k): v for k, v in logs.items()}, "train/global_step": step})

    def close(self) -> None:
        trackio, run = self.trackio, self.run
        self.run = None
        if trackio.context_vars.current_run.get() is run:
            trackio.finish()
        else:
            run.finish()
        if self._space and self.static_space_id is not False:
            try:  # the run is logged; a failed freeze only loses the static copy (HF warns too)
                trackio.freeze(
                    space_id=self._space,
                    project=self.project,
                    new_space_id=self.static_space_id or static_space_name(self.project),
                    private=self.private,
                )
            except Exception as exc:
                logger.warning("trackio could not freeze the Space %s after training: %s", self._space, exc)


def static_space_name(project: str) -> str:
    """HF's name for the static Space of a project: a Hub-safe project name plus a random suffix."""
    name = re.sub(r"[^a-z0-9._-]", "-", project.strip().lower().replace("/", "-"))
    name = re.sub(r"-+", "-", name).strip("-_.") or "trackio-project"
    return f"{name[:81].rstrip('-')}-static-{secrets.token_hex(3)}"


def _wandb(args: Any) -> WandbSink:
    return WandbSink(args.project, args.run_name, args.run_name or args.output_dir, args.to_dict())


def _mlflow(args: Any) -> MLflowSink:
    return MLflowSink(args.run_name, args.to_dict())


def _trackio(args: Any) -> TrackioSink:
    return TrackioSink(
        args.project,
        args.run_name,
        args.to_dict(),
        args.trackio_space_id,
        args.trackio_bucket_id,
        args.hub_private_repo,
        args.trackio_static_space_id,
    )


TRACKERS: Mapping[str, Any] = {"wandb": _wandb, "mlflow": _mlflow, "trackio": _trackio}
SINKS.update(TRACKERS)
