"""Hyperparameter search on optuna: HF's ``Trainer.hyperparameter_search`` for the facade.

``hyperparameter_search(trainer, ...)`` runs an optuna study where each trial is a fresh Trainer
of the same class: its model comes from ``model_init``, its arguments are a copy of
``trainer.args`` with the trial's hyperparameters applied and ``output_dir`` set to the trial's
run directory (``{output_dir}/run-{trial.number}``, or ``hp_name(trial)``), and it trains, then
gives optuna its objective. As in HF:

- the objective is ``compute_objective(metrics)`` of the last evaluation during training, or of
  one ``evaluate()`` after training when there was none; ``default_compute_objective`` is the
  eval loss when there are no other metrics, else the sum of the metrics;
- after each evaluation during training the trial reports the objective to optuna and stops when
  optuna prunes it (the ``TrialPruning`` plugin, single objective only: optuna cannot prune
  multi-objective studies);
- ``direction`` may be a list (multi-objective: ``compute_objective`` returns one value per
  direction) and the result is then the list of the study's best (Pareto) trials;
- ``kwargs`` go to ``optuna.create_study`` (``sampler``, ``pruner``, ``study_name``, ``storage``,
  ``load_if_exists``) or to ``study.optimize`` (``timeout``, ``n_jobs``, ``catch``, ``callbacks``,
  ``gc_after_trial``, ``show_progress_bar``).

Differences from HF, on purpose: a hyperparameter that is not a ``TrainingArguments`` field is an
error (HF warns and skips it); trials run one at a time in this process (``n_jobs=1``: trials
share the global RNG seeding and the torch threads) and on one process only; ``BestRun.run_summary``
is the optuna ``Study`` (HF leaves it None for optuna). The Trainer's own ``optimizers`` are not
reused (they belong to its model), as in HF, where a ``model_init`` discards them too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import inspect
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

from trainbus.engine import ConfigError, Plugin
from trainbus.engine.errors import ConfigRuntimeError, suggest

from ..control.pruning import TrialPruning, number
from ..evaluation.collector import EvalCollector
from .arguments import UNSUPPORTED, TrainingArguments

__all__ = ["BACKENDS", "BestRun", "TrialPruning", "default_compute_objective", "default_hp_space_optuna",
           "hyperparameter_search"]  # fmt: skip

#: the search backends trainbus supports (HF also has "ray", "sigopt" and "wandb")
BACKENDS = ("optuna",)

#: keyword arguments that go to ``study.optimize``; every other one goes to ``optuna.create_study``
OPTIMIZE_KWARGS = ("timeout", "n_jobs", "catch", "callbacks", "gc_after_trial", "show_progress_bar")
CREATE_STUDY_KWARGS = ("sampler", "pruner", "study_name", "storage", "load_if_exists")

_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainingArguments))


class BestRun(NamedTuple):
    """The best run of a hyperparameter search (HF's ``trainer_utils.BestRun``).

    Attributes:
        run_id: the trial number as a string; the run's files are in ``{output_dir}/run-{run_id}``.
        objective: its objective (a list of values for a multi-objective search).
        hyperparameters: the trial's parameters (``trial.params``).
        run_summary: the optuna ``Study`` (HF: None for optuna, a ray ``ExperimentAnalysis`` for ray).
    """

    run_id: str
    objective: float | list[float]
    hyperparameters: dict[str, Any]
    run_summary: Any | None = None


def default_compute_objective(metrics: dict[str, float]) -> float:
    """HF's default objective: ``eval_loss`` when there is no other metric, else the sum of the metrics.

    ``epoch`` and the speed metrics (``*_runtime``, ``*_per_second``) are left out.

    Example:
        >>> default_compute_objective({"eval_loss": 0.5, "eval_runtime": 1.0, "epoch": 2.0})
        0.5
        >>> default_compute_objective({"eval_loss": 0.5, "eval_accuracy": 0.75, "eval_f1": 0.25})
        1.0
    """
    metrics = copy.deepcopy(metrics)
    loss = metrics.pop("eval_loss", None)
    metrics.pop("epoch", None)
    for name in [m for m in metrics if m.endswith("_runtime") or m.endswith("_per_second")]:
        metrics.pop(name)
    return loss if len(metrics) == 0 else sum(metrics.values())  # type: ignore[return-value]


def default_hp_space_optuna(trial: Any) -> dict[str, Any]:
    """HF's default optuna search space: learning rate, epochs, seed and train batch size."""
    return {
        "learning_rate": trial.suggest_float("learning_rate", 1e-6, 1e-4, log=True),
        "num_train_epochs": trial.suggest_int("num_train_epochs", 1, 5),
        "seed": trial.suggest_int("seed", 1, 40),
        "per_device_train_batch_size": trial.suggest_categorical("per_device_train_batch_size", [4, 8, 16, 32, 64]),
    }


def hyperparameter_search(
    trainer: Any,
    hp_space: Callable[[Any], dict[str, Any]] | None = None,
    compute_objective: Callable[[dict[str, float]], float | list[float]] | None = None,
    n_trials: int = 20,
    direction: str | list[str] = "minimize",
    backend: str | None = None,
    hp_name: Callable[[Any], str] | None = None,
    **kwargs: Any,
) -> BestRun | list[BestRun]:
    """Search hyperparameters with optuna; returns the best run (HF ``Trainer.hyperparameter_search``).

    The Trainer must have been built with ``model_init`` (a function of no argument, or of the
    optuna trial): every trial trains a new model. Each trial is a new Trainer of
    ``type(trainer)`` with the same datasets, collator, processing class, loss and metric
    functions and callbacks (HF callbacks are shared, as in HF; trainbus plugins given as
    callbacks are copied fresh for each trial), with ``args`` copied and updated by
    ``hp_space(trial)``, writing into ``{output_dir}/run-{trial.number}`` (``hp_name(trial)``
    names it instead when given).

    Args:
        trainer: the Trainer to search for (built with ``model_init``, and an ``eval_dataset``).
        hp_space: trial -> {TrainingArguments field: value}; default ``default_hp_space_optuna``.
        compute_objective: eval metrics -> objective; default ``default_compute_objective``. With a
            list ``direction`` it returns a list of as many values.
        n_trials: the number of trials.
        direction: "minimize" or "maximize", or a list of them for a multi-objective search.
        backend: "optuna" or None (optuna); any other backend is a ConfigError.
        hp_name: trial -> run directory name (default ``run-{trial.number}``).
        **kwargs: for ``optuna.create_study`` (``sampler``, ``pruner``, ``study_name``, ``storage``,
            ``load_if_exists``) and ``study.optimize`` (``timeout``, ``catch``, ``callbacks``,
            ``gc_after_trial``, ``show_progress_bar``, ``n_jobs`` which must be 1).

    Returns:
        ``BestRun(run_id, objective, hyperparameters, run_summary=study)``; for a multi-objective
        search, the list of the best trials' BestRuns.

    Example:
        >>> best = hyperparameter_search(trainer, n_trials=10)  # doctest: +SKIP
        >>> best.run_id, best.objective, best.hyperparameters  # doctest: +SKIP
    """
    directions = _check_search(trainer, backend, n_trials, direction, kwargs)
    optuna = _import_optuna()
    optimize_kwargs = _optimize_kwargs(kwargs)
    objective = _objective(trainer, hp_space, compute_objective, hp_name, directions, optuna)
    study = optuna.create_study(
        direction=None if directions is not None else direction, directions=directions, **kwargs
    )
    study.optimize(objective, n_trials=n_trials, **optimize_kwargs)
    return _best_runs(study, directions, optuna)


def _check_search(trainer: Any, backend: Any, n_trials: Any, direction: Any, kwargs: Mapping[str, Any]) -> Any:
    """Refuse what the search cannot run, before any trial; returns the list of directions (None: one objective)."""
    backend_name = "optuna" if backend is None else str(getattr(backend, "value", backend)).lower()
    if backend_name not in BACKENDS:
        raise ConfigError(
            f"hyperparameter_search: backend {backend!r} is not supported by trainbus; "
            f"the supported backend is 'optuna' (pip install optuna)"
        )
    model_init = getattr(trainer, "model_init", None)
    if model_init is None:
        raise ConfigRuntimeError(
            "To use hyperparameter search, you need to pass your model through a model_init function: "
            "build the Trainer with Trainer(model_init=make_model, ...) instead of a model, so that each "
            "trial trains a new model"
        )
    if not callable(model_init):
        raise ConfigError(f"model_init must be a function, got {type(model_init).__name__}")
    if not isinstance(model_init, type) and len(inspect.signature(model_init).parameters) > 1:
        raise ConfigRuntimeError("model_init should have 0 or 1 argument (the optuna trial)")
    if trainer.eval_dataset is None:
        raise ConfigError(
            "hyperparameter_search needs an eval_dataset: the objective is computed from the evaluation metrics"
        )
    if trainer.args.world_size > 1:
        raise ConfigError("hyperparameter_search runs in one process; launch it without torchrun / accelerate")
    if n_trials is not None and (isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1):
        raise ConfigError(f"n_trials must be an integer >= 1 (or None with a timeout), got {n_trials!r}")
    directions = list(direction) if isinstance(direction, list | tuple) else None
    if directions is not None and not directions:
        raise ConfigError("direction must be 'minimize', 'maximize' or a non-empty list of them, got []")
    checked: list[Any] = [direction] if directions is None else directions
    for d in checked:
        if str(getattr(d, "name", d)).lower() not in ("minimize", "maximize"):
            raise ConfigError(f"direction must be 'minimize' or 'maximize' (or a list of them), got {d!r}")
    n_jobs = kwargs.get("n_jobs", 1)
    if n_jobs != 1:
        raise ConfigError(
            f"n_jobs={n_jobs!r}: trainbus runs hyperparameter search trials one at a time (n_jobs=1); "
            "run several searches on one shared optuna storage to parallelise"
        )
    return directions


def _optimize_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take ``study.optimize``'s keyword arguments out of ``kwargs``; the rest must be ``create_study``'s."""
    optimize_kwargs = {k: kwargs.pop(k) for k in OPTIMIZE_KWARGS if k in kwargs}
    unknown = [k for k in kwargs if k not in CREATE_STUDY_KWARGS]
    if unknown:
        allowed = CREATE_STUDY_KWARGS + OPTIMIZE_KWARGS
        raise ConfigError(
            f"hyperparameter_search got unknown keyword arguments {unknown}"
            f"{suggest(unknown[0], allowed)}; optuna takes {', '.join(allowed)}"
        )
    return optimize_kwargs


def _objective(
    trainer: Any, hp_space: Any, compute_objective: Any, hp_name: Any, directions: list[Any] | None, optuna: Any
) -> Callable[[Any], float | list[float]]:
    """optuna's objective: one trial trains a fresh Trainer and returns its objective (or is pruned)."""
    model_init = trainer.model_init
    space = default_hp_space_optuna if hp_space is None else hp_space
    objective_of = default_compute_objective if compute_objective is None else compute_objective
    n_objectives = 1 if directions is None else len(directions)
    own_plugins = [p for p in trainer.plugins if p is not getattr(trainer, "callback_handler", None)]

    def objective(trial: Any) -> float | list[float]:
        params = space(trial)
        if not isinstance(params, Mapping):
            raise ConfigError(f"hp_space must return a dict of TrainingArguments values, got {type(params).__name__}")
        run_name = hp_name(trial) if hp_name is not None else f"run-{trial.number}"
        run_dir = os.path.join(str(trainer.args.output_dir), str(run_name))
        args = trial_arguments(trainer.args, params, run_dir)
        existed = os.path.isdir(run_dir)
        try:
            run = _trial_trainer(trainer, args, model_init, trial, own_plugins)
            pruning = TrialPruning(trial, objective_of, report=directions is None)
            pruning.attach(run)  # attached, not added: checkpoints hold a plain Trainer's plugins, so one resumes them
            run.train()
            if pruning.pruned:
                raise optuna.TrialPruned(f"trial {trial.number} pruned at step {pruning.pruned_at}")
            value = pruning.objective
            if value is None:  # no evaluation during training: evaluate once (HF)
                value = objective_of(run.evaluate())
            return _check_objective(value, n_objectives)
        finally:  # train() made run_dir for its lock; transformers makes it only to save a checkpoint there
            if not existed:  # so a trial that saved nothing (pruned early, save_strategy="no") leaves none
                with contextlib.suppress(OSError):  # not empty: kept
                    os.rmdir(run_dir)

    return objective


def _best_runs(study: Any, directions: list[Any] | None, optuna: Any) -> BestRun | list[BestRun]:
    """The best run (one objective) or the Pareto-best runs; a ValueError when no trial completed."""
    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if not done:
        states = [t.state.name for t in study.trials]
        counts = ", ".join(f"{states.count(s)} {s.lower()}" for s in sorted(set(states))) or "no trial ran"
        raise ValueError(f"hyperparameter_search: no trial completed ({counts}), so there is no best run")
    if directions is None:
        best = study.best_trial
        return BestRun(str(best.number), best.value, best.params, study)
    return [BestRun(str(t.number), list(t.values), t.params, study) for t in study.best_trials]


def trial_arguments(args: TrainingArguments, params: Mapping[str, Any], output_dir: str) -> TrainingArguments:
    """A copy of ``args`` with ``params`` applied and ``output_dir`` set; bad names or values raise.

    A value is cast to the type of the field's current value when that loses nothing (an int
    for a float field becomes a float), as HF casts; the copy is validated like a new one.

    Example:
        >>> args = TrainingArguments("out", learning_rate=1e-3)
        >>> trial_arguments(args, {"learning_rate": 0.1, "num_train_epochs": 2}, "out/run-0").num_train_epochs
        2.0
    """
    unknown = [name for name in params if name not in _FIELDS]
    if unknown:
        hints = [
            f"{name!r} (a transformers argument trainbus does not support)"
            if name in UNSUPPORTED
            else f"{name!r}{suggest(name, _FIELDS)}"
            for name in unknown
        ]
        raise ConfigError(
            f"hp_space returned hyperparameters that are not TrainingArguments fields: {', '.join(hints)}"
        )
    if "output_dir" in params:
        raise ConfigError("hp_space must not set output_dir: each trial writes into {output_dir}/run-{trial.number}")
    values = {name: _cast(getattr(args, name), value) for name, value in params.items()}
    try:
        return dataclasses.replace(args, output_dir=output_dir, **values)
    except ConfigError as exc:
        raise ConfigError(f"the trial's hyperparameters {dict(params)} give invalid TrainingArguments: {exc}") from exc


def _cast(old: Any, value: Any) -> Any:
    if old is None or isinstance(old, bool | enum.Enum) or isinstance(value, bool):
        return value
    try:
        cast = type(old)(value)
    except (TypeError, ValueError):
        return value
    return cast if cast == value else value


def _import_optuna() -> Any:
    try:
        import optuna
    except ImportError as exc:
        raise ConfigError("hyperparameter_search needs optuna, which is not installed: pip install optuna") from exc
    return optuna


def _check_objective(value: Any, n_objectives: int) -> float | list[float]:
    if n_objectives == 1:
        if isinstance(value, Sequence) and not isinstance(value, str):
            raise ConfigError(
                f"compute_objective returned {len(value)} values, but direction is a single direction; "
                "pass a list of directions for a multi-objective search"
            )
        if value is None:
            raise ConfigError(
                "compute_objective returned None (no eval_loss in the metrics?); return a number computed from "
                "the evaluation metrics"
            )
        return number(value, "compute_objective")
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != n_objectives:
        raise ConfigError(
            f"with {n_objectives} directions compute_objective must return a list of {n_objectives} numbers, "
            f"got {value!r:.80}"
        )
    return [number(v, "compute_objective") for v in value]


def takes_trial(model_init: Callable[..., Any]) -> bool:
    """Whether ``model_init`` is called with the trial: a function of one argument (HF); a class never is."""
    return not isinstance(model_init, type) and len(inspect.signature(model_init).parameters) == 1


def _fresh(plugin: Plugin, source: Any, run: Any) -> Plugin:
    """A detached deep copy of ``plugin`` for ``run``: the source Trainer and model map to the run's, data is shared."""
    clone = copy.copy(plugin)
    clone.__dict__.pop("_plugin_handles", None)  # the registrations on the source Trainer
    clone.__dict__.pop("_plugin_wraps", None)
    memo: dict[int, Any] = {id(source): run, id(source.model): run.model}
    for shared in (source.train_dataset, source.eval_dataset, source.train_data, source.eval_data):
        if shared is not None:
            memo[id(shared)] = shared
    try:
        return copy.deepcopy(clone, memo)
    except Exception as exc:  # a lock, a file handle: share the instance, as HF shares its callbacks
        warnings.warn(
            f"hyperparameter_search: the plugin {plugin.name!r} cannot be copied ({type(exc).__name__}: {exc}); "
            "every trial shares it",
            stacklevel=4,
        )
        return plugin


def _trial_trainer(
    trainer: Any, args: TrainingArguments, model_init: Callable[..., Any], trial: Any, own_plugins: list[Plugin]
) -> Any:
    """A Trainer of ``type(trainer)`` for one trial: same data and functions, a new model, ``args``.

    The plugins of ``trainer`` that a Trainer built from the arguments lacks are the user's own
    (trainbus plugins given as callbacks): the trial gets a fresh copy of each, so no state (an
    early-stopping counter, a best value) leaks from the Trainer or between trials.
    """
    collector = trainer.get_plugin(EvalCollector)
    adapter = getattr(trainer, "callback_handler", None)
    callbacks = list(getattr(adapter, "callbacks", []))
    kwargs = {
        "model": None,
        "args": args,
        "data_collator": trainer.data_collator,
        "train_dataset": trainer.train_dataset,
        "eval_dataset": trainer.eval_dataset,
        "processing_class": trainer.processing_class,
        "model_init": partial(model_init, trial) if takes_trial(model_init) else model_init,
        "compute_loss_func": trainer.compute_loss_func,
        "compute_metrics": trainer.compute_metrics,
        "callbacks": callbacks,
        "preprocess_logits_for_metrics": getattr(collector, "preprocess_logits_for_metrics", None),
    }
    cls = type(trainer)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError(
            f"hyperparameter_search builds each trial's Trainer as {cls.__name__}(model_init=..., args=..., "
            f"train_dataset=..., ...) with Trainer's keyword arguments, which {cls.__name__} does not take: {exc}"
        ) from exc
    run = cls(**kwargs)
    run.model_init = model_init
    run._trial = trial  # model_init gets the trial (HF's self._trial)
    run._model_just_made = True  # HF calls model_init once per trial: this run's constructor did
    for plugin in own_plugins:
        if run.get_plugin(plugin.name, None) is None:  # not one the arguments build: the user's own
            run.add_plugin(_fresh(plugin, trainer, run))
    return run
