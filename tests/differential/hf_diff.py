"""The differential kit: one scenario, two implementations, the same code.

Each test in this directory mirrors a scenario of transformers' own trainer tests (tests/trainer/ in
its repository) and runs it twice: once with ``transformers.Trainer`` / ``TrainingArguments`` and once
with ``trainbus.plugins.Trainer`` / ``TrainingArguments``. The job is built by the same function for
both; only ``impl`` (the one import a port changes) differs. The test then compares what the scenario
pins: final weights, log_history, metrics, steps, checkpoint names, callback events, ...

The models and data are written here in the style of transformers' test helpers (a linear regression
``y = a * x + b`` on a seeded dataset) but are this project's own code.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hf_release  # tests/hf_release.py: what the installed transformers release does
import numpy as np
import torch
from torch import nn
from transformers import PreTrainedModel

try:
    from transformers import PreTrainedConfig
except ImportError:  # transformers 4.x spells it PretrainedConfig
    from transformers import PretrainedConfig as PreTrainedConfig  # type: ignore[no-redef]

IMPLEMENTATIONS = ("transformers", "trainbus")
TIMING_SUFFIXES = ("_runtime", "_per_second")
#: transformers adds ``{prefix}_model_preparation_time`` (the time accelerate took to prepare the model)
#: to every evaluate / predict of a Trainer whose first evaluation came before any train(); trainbus has
#: nothing to prepare and writes no such key. A known difference, left out of the comparisons.
HF_ONLY_SUFFIXES = ("_model_preparation_time",)
RTOL = 1e-5
ATOL = 1e-6


@dataclass(frozen=True)
class Impl:
    """What a ported script imports, from one implementation."""

    name: str
    Trainer: Any
    TrainingArguments: Any
    TrainerCallback: Any
    EarlyStoppingCallback: Any

    def args(self, output_dir: str | Path, **kwargs: Any) -> Any:
        """TrainingArguments with the quiet, CPU-only defaults every scenario uses on both sides."""
        base = {"use_cpu": True, "report_to": "none", "disable_tqdm": True}
        base.update(kwargs)
        return self.TrainingArguments(output_dir=str(output_dir), **base)


def implementation(name: str) -> Impl:
    if name == "transformers":
        import transformers as module
    elif name == "trainbus":
        import trainbus.plugins as module
    else:
        raise ValueError(name)
    return Impl(
        name=name,
        Trainer=module.Trainer,
        TrainingArguments=module.TrainingArguments,
        TrainerCallback=module.TrainerCallback,
        EarlyStoppingCallback=module.EarlyStoppingCallback,
    )


def run_both(scenario: Callable[[Impl, Path], Any], tmp_path: Path) -> tuple[Any, Any]:
    """Run ``scenario(impl, workdir)`` under transformers, then trainbus; return both results."""
    results = []
    for name in IMPLEMENTATIONS:
        workdir = tmp_path / name
        workdir.mkdir(parents=True, exist_ok=True)
        results.append(scenario(implementation(name), workdir))
    return results[0], results[1]


# -- data and models in the style of transformers' trainer tests -------------------------------------
class RegressionData:
    """``length`` samples of ``y = a * x + b + noise``; one label column per name in ``label_names``."""

    def __init__(
        self, length: int = 64, seed: int = 42, a: float = 2.0, b: float = 3.0, label_names: Iterable[str] = ("labels",)
    ) -> None:
        rng = np.random.default_rng(seed)
        self.label_names = list(label_names)
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.ys = [
            (a * self.x + b + rng.normal(scale=0.1, size=(length,))).astype(np.float32) for _ in self.label_names
        ]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = {name: y[i] for name, y in zip(self.label_names, self.ys)}
        item["input_x"] = self.x[i]
        return item


class IterableRegressionData(torch.utils.data.IterableDataset):
    """The same samples, only iterable (no ``__len__``)."""

    def __init__(self, **kwargs: Any) -> None:
        self.data = RegressionData(**kwargs)

    def __iter__(self) -> Any:
        for i in range(len(self.data)):
            yield self.data[i]


class VariableLengthData:
    """Batches of ``batch_size`` samples share one random length; lengths differ between batches."""

    def __init__(self, length: int = 64, seed: int = 42, batch_size: int = 8) -> None:
        rng = np.random.default_rng(seed)
        sizes = rng.integers(1, 20, (length // batch_size,)).repeat(batch_size)
        self.xs = [rng.normal(size=(s,)).astype(np.float32) for s in sizes]
        self.ys = [rng.normal(size=(s,)).astype(np.float32) for s in sizes]

    def __len__(self) -> int:
        return len(self.xs)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_x": self.xs[i], "labels": self.ys[i]}


class RegressionModel(nn.Module):
    """``y = a * x + b``; returns ``(loss, y)`` (or ``(loss, y, y)``) as a tuple, like old HF models."""

    def __init__(self, a: float = 0.0, b: float = 0.0, double_output: bool = False) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a)))
        self.b = nn.Parameter(torch.tensor(float(b)))
        self.double_output = double_output

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        y = input_x * self.a + self.b
        outputs = (y, y) if self.double_output else (y,)
        if labels is None:
            return outputs
        return (nn.functional.mse_loss(y, labels), *outputs)


class RegressionDictModel(nn.Module):
    """The same regression, returning a dict (``output`` and, with labels, ``loss``)."""

    def __init__(self, a: float = 0.0, b: float = 0.0) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.tensor(float(a)))
        self.b = nn.Parameter(torch.tensor(float(b)))

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        y = input_x * self.a + self.b
        out = {"output": y}
        if labels is not None:
            out["loss"] = nn.functional.mse_loss(y, labels)
        return out


class RegressionConfig(PreTrainedConfig):
    """The config of ``RegressionPreTrainedModel``: the starting ``a`` and ``b``."""

    model_type = "trainbus-diff-regression"

    def __init__(self, a: float = 0.0, b: float = 0.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.a = a
        self.b = b
        self.hidden_size = 1


class RegressionPreTrainedModel(PreTrainedModel):
    """The regression as a transformers ``PreTrainedModel`` (transformers' tests' default, ``pretrained=True``):
    a checkpoint holds its config.json and ``from_pretrained`` reads it back."""

    config_class = RegressionConfig
    base_model_prefix = "regression"

    def __init__(self, config: RegressionConfig) -> None:
        super().__init__(config)
        self.a = nn.Parameter(torch.tensor(float(config.a)))
        self.b = nn.Parameter(torch.tensor(float(config.b)))
        self.post_init()

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        y = input_x * self.a + self.b
        return (y,) if labels is None else (nn.functional.mse_loss(y, labels), y)


class RandomRegressionModel(RegressionModel):
    """A regression whose forward draws from torch, numpy and random: resuming must restore all three."""

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        import random

        y = input_x * self.a + self.b + 0.05 * torch.randn(()) + 0.05 * float(np.random.rand() + random.random())
        if labels is None:
            return (y,)
        return (nn.functional.mse_loss(y, labels), y)


def regression_trainer(
    impl: Impl,
    output_dir: Path,
    *,
    a: float = 0.0,
    b: float = 0.0,
    double_output: bool = False,
    train_len: int = 64,
    eval_len: int = 64,
    label_names: list[str] | None = None,
    model: nn.Module | None = None,
    pretrained: bool = False,
    trainer_kwargs: Mapping[str, Any] | None = None,
    **arg_kwargs: Any,
) -> Any:
    """The regression job of transformers' ``get_regression_trainer``, built for ``impl`` (``pretrained``: its
    default ``RegressionPreTrainedModel``; otherwise the plain module)."""
    names = label_names or ["labels"]
    if label_names is not None:
        arg_kwargs["label_names"] = label_names
    train = RegressionData(length=train_len, label_names=names)
    evals = RegressionData(length=eval_len, label_names=names)
    if model is None and pretrained:
        model = RegressionPreTrainedModel(RegressionConfig(a=a, b=b))
    model = model if model is not None else RegressionModel(a=a, b=b, double_output=double_output)
    args = impl.args(output_dir, **arg_kwargs)
    return impl.Trainer(model=model, args=args, train_dataset=train, eval_dataset=evals, **(trainer_kwargs or {}))


def with_newest_flow(impl: Impl, trainer: Any) -> Any:
    """``trainer``, also evaluating after the last step under a transformers release that does not (4.57 - 5.0)
    when ``eval_strategy="steps"``: the flow of the newest release, which trainbus follows, so that whole runs
    compare. ``test_last_step_evaluation_by_release`` pins what each gives."""
    return hf_release.newest_flow(trainer) if impl.name == "transformers" else trainer


class AlmostAccuracy:
    """Share of predictions within ``thresh`` of the label."""

    def __init__(self, thresh: float = 0.25) -> None:
        self.thresh = thresh

    def __call__(self, eval_pred: Any) -> dict[str, float]:
        predictions, labels = eval_pred
        return {"accuracy": float((np.abs(np.asarray(predictions) - np.asarray(labels)) <= self.thresh).mean())}


class BatchedAlmostAccuracy:
    """The same metric for ``batch_eval_metrics=True``: called per batch, the result on the last one."""

    def __init__(self, thresh: float = 0.25) -> None:
        self.thresh = thresh
        self.hits: list[float] = []

    def __call__(self, eval_pred: Any, compute_result: bool) -> dict[str, float] | None:
        predictions, labels = eval_pred
        predictions = predictions[0] if isinstance(predictions, tuple) else predictions
        labels = labels[0] if isinstance(labels, tuple) else labels
        hits = (torch.as_tensor(predictions) - torch.as_tensor(labels)).abs() <= self.thresh
        self.hits.extend(hits.float().flatten().tolist())
        if compute_result:
            result = {"accuracy": float(np.mean(self.hits))}
            self.hits = []
            return result
        return None


def expected_eval(
    a: float, b: float, data: RegressionData, thresh: float = 0.25, shift: float = 0.0
) -> dict[str, float]:
    """Independent eval_loss / eval_accuracy of ``y = a*x + b`` on ``data`` (float32 as the model)."""
    pred = (np.float32(a) * data.x + np.float32(b)).astype(np.float32)
    y = data.ys[0]
    return {
        "eval_loss": float(((pred - y) ** 2).mean()),
        "eval_accuracy": float((np.abs(pred + np.float32(shift) - y) <= thresh).mean()),
    }


# -- comparisons ------------------------------------------------------------------------------------------
def weights(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def assert_same_weights(hf_model: nn.Module, tb_model: nn.Module, rtol: float = RTOL, atol: float = ATOL) -> None:
    hf, tb = weights(hf_model), weights(tb_model)
    assert hf.keys() == tb.keys(), (sorted(hf), sorted(tb))
    for k in hf:
        np.testing.assert_allclose(tb[k], hf[k], rtol=rtol, atol=atol, err_msg=f"weight {k}")


def _timing(key: str) -> bool:
    return key.endswith(TIMING_SUFFIXES)


def _close(x: Any, y: Any, rtol: float, atol: float) -> bool:
    if isinstance(x, bool) or isinstance(y, bool) or isinstance(x, str) or isinstance(y, str):
        return x == y
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        if math.isnan(x) and math.isnan(y):
            return True
        return math.isclose(x, y, rel_tol=rtol, abs_tol=atol)
    return x == y


def _release_differences(hf: Mapping[str, Any], tb: Mapping[str, Any]) -> set[str]:
    """Keys where the installed transformers release gives another value than the newest, which trainbus gives.

    Before any training, 4.57 - 5.0 have ``state.epoch`` None and leave ``epoch`` out of what they log (an
    ``evaluate()`` before ``train()``); newer releases and trainbus say 0.0.
    """
    if hf_release.epoch_before_training() is None and "epoch" not in hf and tb.get("epoch") == 0:
        return {"epoch"}
    return set()


def record_differences(hf: Mapping[str, Any], tb: Mapping[str, Any], rtol: float, atol: float) -> list[str]:
    out = []
    release_keys = _release_differences(hf, tb)
    hf_keys = {k for k in hf if not _timing(k) and not k.endswith(HF_ONLY_SUFFIXES)}
    tb_keys = {k for k in tb if not _timing(k) and k not in release_keys}
    if hf_keys != tb_keys:
        out.append(f"keys: transformers {sorted(hf_keys)} vs trainbus {sorted(tb_keys)}")
    for k in sorted(hf_keys & tb_keys):
        # 4.x logs the step loss rounded to 4 decimals: within the rounding
        tolerance = max(atol, hf_release.loss_tolerance(hf[k])) if k == "loss" else atol
        if not _close(hf[k], tb[k], rtol, tolerance):
            out.append(f"{k}: transformers {hf[k]!r} vs trainbus {tb[k]!r}")
    return out


def assert_same_logs(
    hf: list[Mapping[str, Any]], tb: list[Mapping[str, Any]], rtol: float = RTOL, atol: float = ATOL
) -> None:
    """Every log_history record, key by key (timing keys by name only)."""
    problems = []
    if len(hf) != len(tb):
        problems.append(f"{len(hf)} records under transformers, {len(tb)} under trainbus")
    for i, (x, y) in enumerate(zip(hf, tb)):
        problems += [f"record {i}: {p}" for p in record_differences(x, y, rtol, atol)]
    assert not problems, "\n".join([*problems, "transformers:", *map(str, hf), "trainbus:", *map(str, tb)])


def assert_same_metrics(hf: Mapping[str, Any], tb: Mapping[str, Any], rtol: float = RTOL, atol: float = ATOL) -> None:
    problems = record_differences(hf, tb, rtol, atol)
    assert not problems, "\n".join([*problems, f"transformers: {dict(hf)}", f"trainbus: {dict(tb)}"])


def assert_same_arrays(hf: Any, tb: Any, atol: float = 1e-6) -> None:
    """Predictions / label_ids: arrays, or tuples / lists of them, equal in structure and value."""
    if isinstance(hf, (tuple, list)):
        assert isinstance(tb, (tuple, list)) and len(hf) == len(tb), (type(hf), type(tb))
        for x, y in zip(hf, tb):
            assert_same_arrays(x, y, atol)
        return
    if hf is None:
        assert tb is None, tb
        return
    hf_a, tb_a = np.asarray(hf), np.asarray(tb)
    assert hf_a.shape == tb_a.shape, (hf_a.shape, tb_a.shape)
    np.testing.assert_allclose(tb_a, hf_a, atol=atol, rtol=0)


def checkpoint_names(output_dir: Path) -> list[str]:
    if not output_dir.is_dir():
        return []
    names = [p.name for p in output_dir.iterdir() if p.is_dir() and p.name.startswith("checkpoint-")]
    return sorted(names, key=lambda n: int(n.split("-")[1]))


def read_state(path: Path) -> dict[str, Any]:
    return json.loads((path / "trainer_state.json").read_text())


def state_summary(state: Mapping[str, Any], output_dir: Path | None = None) -> dict[str, Any]:
    """The fields of trainer_state.json that both implementations share, paths relative to output_dir."""
    keys = (
        "global_step",
        "max_steps",
        "num_train_epochs",
        "epoch",
        "logging_steps",
        "eval_steps",
        "save_steps",
        "train_batch_size",
        "best_metric",
        "best_global_step",
        "best_model_checkpoint",
        "is_world_process_zero",
        "is_local_process_zero",
        "is_hyper_param_search",
    )
    out = {k: state.get(k) for k in keys}
    best = out["best_model_checkpoint"]
    if best is not None and output_dir is not None:
        out["best_model_checkpoint"] = os.path.relpath(best, output_dir)
    return out


def state_dict_of(trainer: Any) -> dict[str, Any]:
    """``trainer.state`` as a dict of its fields, under both implementations."""
    state = trainer.state
    return {
        k: getattr(state, k, None)
        for k in (
            "global_step",
            "max_steps",
            "num_train_epochs",
            "epoch",
            "best_metric",
            "best_global_step",
            "best_model_checkpoint",
            "train_batch_size",
            "logging_steps",
            "eval_steps",
            "save_steps",
        )
    }


def scrub_timing(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not _timing(k)} for r in records]


class MultiLoader:
    """Several loaders one after the other, without a ``dataset`` attribute (a custom loader)."""

    def __init__(self, loaders: list[Any]) -> None:
        self.loaders = loaders

    def __len__(self) -> int:
        return sum(len(loader) for loader in self.loaders)

    def __iter__(self) -> Any:
        for loader in self.loaders:
            yield from loader
