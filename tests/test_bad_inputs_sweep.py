"""A sweep of bad inputs to the Engine and its plugins' constructors (issue 37, item 7).

Each one was taken and failed later with another library's words (``'str' object is not callable`` from
inside the step, ``'int' object is not iterable``, pathlib's ``expected str, bytes or os.PathLike``, an
``OSError`` from ``signal.signal`` at ``fit()``), or was never noticed (``label_names='labels'`` read as
six one-letter names, ``Preemption(signals=[99])`` waiting for a signal that does not exist). Now each
fails at construction with a ConfigError naming the argument, the value and what is allowed.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from trainbus.engine import ConfigError, Engine
from trainbus.hooks import Hooks
from trainbus.plugins.adapters.peft import AdapterSwitch
from trainbus.plugins.checkpoints.checkpoint import Checkpointing
from trainbus.plugins.checkpoints.checkpoint_checks import check_checkpointing_options
from trainbus.plugins.control.best_model import BestMetric
from trainbus.plugins.control.early_stopping import EarlyStopping
from trainbus.plugins.control.flow import FlowControl
from trainbus.plugins.control.preemption import Preemption
from trainbus.plugins.control.pruning import TrialPruning
from trainbus.plugins.data.loading import ResumableData
from trainbus.plugins.evaluation.collector import EvalCollector
from trainbus.plugins.observability.debug import UnderflowOverflowDebug
from trainbus.plugins.observability.flos import FloCounter
from trainbus.plugins.observability.logging import ConsoleSink, TrainLogger
from trainbus.plugins.observability.plots import PlotCurves
from trainbus.plugins.observability.progress import ProgressBars
from trainbus.plugins.observability.sinks import CsvSink, JsonlSink, TensorBoardSink
from trainbus.plugins.observability.tracker_base import TrackerSink
from trainbus.plugins.observability.trackers import MLflowSink, WandbSink
from trainbus.plugins.optimization.accumulation import GradientAccumulation
from trainbus.plugins.optimization.clipping import GradientClipping
from trainbus.plugins.optimization.model_setup import TorchCompile
from trainbus.plugins.optimization.precision import MixedPrecision
from trainbus.plugins.optimization.regularization import LabelSmoothing
from trainbus.plugins.optimization.schedulers import LRScheduler


def engine(**kwargs: Any) -> Engine:
    model = torch.nn.Linear(2, 1)
    arguments: dict[str, Any] = {"train_data": [(torch.ones(4, 2), torch.ones(4, 1))], "max_epochs": 1}
    return Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), **{**arguments, **kwargs})


#: (id, construction, texts the message must contain)
CASES: list[tuple[str, Callable[[], Any], tuple[str, ...]]] = [
    # the Engine
    ("train_data a number", lambda: engine(train_data=5), ("train_data", "5", "iterable of batches")),
    ("train_data a str", lambda: engine(train_data="abc"), ("train_data", "'abc'", "DataLoader")),
    ("train_data a dict", lambda: engine(train_data={"x": 1}), ("train_data", "{'x': 1}", "iterable of batches")),
    ("eval_data a number", lambda: engine(eval_data=5), ("eval_data", "5", "dict of such by name")),
    ("eval_data a dict of numbers", lambda: engine(eval_data={"a": 5}), ("eval_data['a']", "5")),
    ("eval_data a dict with int keys", lambda: engine(eval_data={1: [1]}), ("eval_data", "key 1", "str")),
    ("loss_fn a str", lambda: engine(loss_fn="mse"), ("loss_fn", "'mse'", "callable", "MSELoss")),
    ("loss_fn a number", lambda: engine(loss_fn=5), ("loss_fn", "5", "callable")),
    ("plugins a number", lambda: engine(plugins=5), ("plugins", "5", "list")),
    ("plugins one plugin", lambda: engine(plugins=GradientClipping()), ("plugins", "GradientClipping", "[it]")),
    ("ResumableData flag a str", lambda: ResumableData(ignore_data_skip="x"), ("ignore_data_skip", "True or False")),
    ("label_names a str", lambda: engine(label_names="labels"), ("label_names", "'labels'", "('labels',)")),
    ("label_names a number", lambda: engine(label_names=5), ("label_names", "5", "list or tuple of str")),
    ("label_names holds a number", lambda: engine(label_names=["y", 5]), ("label_names", "5", "str only")),
    ("trace a str", lambda: engine(trace="yes"), ("trace", "'yes'", "True or False")),
    ("hooks compute_loss a str", lambda: engine(hooks=Hooks(compute_loss="x"), loss_fn=torch.nn.MSELoss()),
     ("compute_loss", "'x'")),
    ("hooks compute_loss and loss_fn", lambda: engine(hooks=Hooks(compute_loss=lambda o, b: o.sum()),
     loss_fn=torch.nn.MSELoss()), ("loss_fn=", "both give the loss", "pass one of them")),
    ("evaluate data a number", lambda: engine().evaluate(5), ("evaluate()'s data", "5", "iterable of batches")),
    ("evaluate prefix a number", lambda: engine(eval_data=[1]).evaluate(prefix=5), ("prefix", "5", "str")),
    ("predict data a number", lambda: engine().predict(5), ("predict()'s data", "5", "iterable of batches")),
    # plugins
    ("clipping max_norm negative", lambda: GradientClipping(max_norm=-1), ("max_norm must be", "-1")),
    ("clipping norm_type a bool", lambda: GradientClipping(norm_type=True), ("norm_type", "True")),
    ("preemption signal 99", lambda: Preemption(signals=[99]), ("signals", "99", "cannot catch", "SIGTERM")),
    ("preemption SIGKILL", lambda: Preemption(signals=[signal.SIGKILL]), ("SIGKILL", "cannot catch")),
    ("preemption one signal bare", lambda: Preemption(signals=15), ("signals must be a list", "15")),
    ("preemption signal by name", lambda: Preemption(signals=["TERM"]), ("'TERM'", "signal.SIGTERM")),
    ("preemption no signals", lambda: Preemption(signals=[]), ("signals is empty",)),
    ("preemption resume_hint a number", lambda: Preemption(resume_hint=5), ("resume_hint", "5", "str")),
    ("preemption return_after_stop a str", lambda: Preemption(return_after_stop="y"),
     ("return_after_stop", "'y'", "True or False")),
    ("accumulation prescaled a number", lambda: GradientAccumulation(2, prescaled=5), ("prescaled", "5")),
    ("accumulation count_items a number", lambda: GradientAccumulation(2, count_items=5), ("count_items", "5")),
    ("early stopping greater_is_better a str", lambda: EarlyStopping(greater_is_better="yes"),
     ("greater_is_better", "'yes'", "True, False or None")),
    ("best metric greater_is_better a str", lambda: BestMetric("loss", greater_is_better="y"),
     ("greater_is_better", "'y'")),
    ("best metric save_on_best a str", lambda: BestMetric("loss", save_on_best="y"), ("save_on_best", "'y'")),
    ("progress max_str_len negative", lambda: ProgressBars(max_str_len=-1), ("max_str_len", "-1")),
    ("flos_of a number", lambda: FloCounter(5), ("flos_of", "5", "function")),
    ("flow logging_steps a str", lambda: FlowControl(logging_steps="x"), ("logging_steps", "'x'", "number")),
    ("flow eval_delay negative", lambda: FlowControl(eval_delay=-1), ("eval_delay", "-1", ">= 0")),
    ("flow logging_first_step a str", lambda: FlowControl(logging_first_step="x"), ("logging_first_step", "'x'")),
    ("flow eval_on_start a str", lambda: FlowControl(eval_on_start="x"), ("eval_on_start", "'x'")),
    ("checkpointing best_metric_key a number", lambda: check_checkpointing_options(5, False, False, None),
     ("best_metric_key", "5")),
    ("checkpointing only_best_at_end a str", lambda: check_checkpointing_options(None, "x", False, None),
     ("only_best_at_end", "'x'")),
    ("precision scaler a number", lambda: MixedPrecision("fp16", scaler=5), ("scaler", "5", "GradScaler")),
    ("compile backend a number", lambda: TorchCompile(backend=5), ("backend", "5")),
    ("compile fullgraph a str", lambda: TorchCompile(fullgraph="x"), ("fullgraph", "'x'")),
    ("compile unknown keyword", lambda: TorchCompile(full_graph=True), ("'full_graph'", "torch.compile")),
    ("pruning report a str", lambda: TrialPruning(object(), lambda m: 0.0, report="x"), ("report", "'x'")),
    ("collector include_inputs a str", lambda: EvalCollector(include_inputs="x"), ("include_inputs", "'x'")),
    ("collector prediction_loss_only a str", lambda: EvalCollector(prediction_loss_only="x"),
     ("prediction_loss_only", "'x'")),
    ("debug trace_batch_nums a number", lambda: UnderflowOverflowDebug(trace_batch_nums=5), ("trace_batch_nums", "5")),
    ("debug trace_batch_nums of str", lambda: UnderflowOverflowDebug(trace_batch_nums=["x"]), ("trace_batch_nums",)),
    ("debug abort_after negative", lambda: UnderflowOverflowDebug(abort_after_batch_num=-1),
     ("abort_after_batch_num", "-1")),
    ("label smoothing shift_labels a str", lambda: LabelSmoothing(0.1, shift_labels="x"), ("shift_labels", "'x'")),
    ("plots output_dir a number", lambda: PlotCurves(5), ("output_dir", "5", "path")),
    ("plots filename a number", lambda: PlotCurves("out", filename=5), ("filename", "5", "path")),
    ("adapter switch a number", lambda: AdapterSwitch(5), ("AdapterSwitch", "5", "adapter names")),
    ("checkpointing only_best_at_end a str", lambda: Checkpointing("out", only_best_at_end="x"),
     ("only_best_at_end", "'x'")),
    ("jsonl sink path a number", lambda: JsonlSink(5), ("path", "5", "path")),
    ("csv sink path None", lambda: CsvSink(None), ("path", "None", "path")),
    ("tensorboard log_dir a number", lambda: TensorBoardSink(5), ("log_dir", "5", "path")),
    ("logger nan_inf_filter a str", lambda: TrainLogger(nan_inf_filter="x"), ("nan_inf_filter", "'x'")),
    ("console stream a number", lambda: ConsoleSink(5), ("stream", "write")),
    ("scheduler warmup a str", lambda: LRScheduler("linear", num_warmup_steps="x"), ("num_warmup_steps", "'x'")),
    ("tracker config a number", lambda: TrackerSink(config=5), ("config", "5", "dict")),
    ("wandb project a number", lambda: WandbSink(project=5), ("project", "5", "str")),
    ("mlflow name a number", lambda: MLflowSink(name=5), ("name", "5", "str")),
]  # fmt: skip


@pytest.mark.parametrize("make, texts", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_fails_at_construction_naming_it(make: Callable[[], Any], texts: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as raised:
        make()
    for text in texts:
        assert text in str(raised.value), f"{text!r} not in: {raised.value}"


def test_a_type_mistake_is_still_a_type_error() -> None:
    """Before, these raised TypeError (late); ``except TypeError`` still catches them, now at construction."""
    for make in (lambda: engine(loss_fn="mse"), lambda: engine(plugins=5), lambda: Preemption(signals=15)):
        with pytest.raises(TypeError):
            make()


def test_the_good_inputs_are_still_taken(tmp_path: Path) -> None:
    engine(eval_data={"a": [1], "b": (2,)}, label_names=("y",), plugins=(GradientClipping(norm_type=1),), trace=True)
    engine(loss_fn=torch.nn.MSELoss(), label_names=[], plugins=[], eval_data=[(torch.ones(1, 2), torch.ones(1, 1))])
    engine(loss_fn=torch.nn.MSELoss(), hooks=Hooks())  # the default compute_loss: loss_fn gives the loss
    assert Preemption(signals=[signal.SIGUSR1, int(signal.SIGTERM)]).signals == (signal.SIGUSR1, signal.SIGTERM)
    assert Preemption(signals=[signal.SIGRTMIN]).signals == (int(signal.SIGRTMIN),)
    GradientAccumulation(2, prescaled=lambda: True)
    EarlyStopping(greater_is_better=None)
    ProgressBars(max_str_len=0)
    FlowControl(logging_steps=0.5, eval_delay=2.5, logging_first_step=True)
    check_checkpointing_options("eval_loss", True, True, lambda path: None)
    TorchCompile(backend=lambda gm, inputs: gm, fullgraph=True, dynamic=None, mode="default")
    UnderflowOverflowDebug(trace_batch_nums=[0, 3], abort_after_batch_num=0)
    LabelSmoothing(0.1, shift_labels=None)
    PlotCurves(tmp_path, filename="curves.png")
