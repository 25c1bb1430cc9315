"""MemoryMetrics: HF's ``skip_memory_metrics=False``, the memory each stage of a run allocated, CPU and GPU.

The metrics are those of transformers' ``TrainerMemoryTracker`` (read in transformers/trainer_utils.py), measured
the same way: psutil's resident set size for the CPU, with a thread sampling its peak, and ``torch.cuda`` allocated /
peak-allocated memory with a GPU; ``gc.collect()`` (and the CUDA cache emptied) at both ends of a stage. HF's class
is not used: it finds its stage from the name of the Trainer method calling it (here the callers are event
handlers), and importing ``transformers.trainer_utils`` takes seconds (it pulls in peft and bitsandbytes). Stages,
and where their metrics go, as in HF:

- ``init``: the Trainer's constructor (``start("init")`` / ``stop("init")``); reported with the first stage that
  reports, together with ``before_init_mem_cpu`` (and ``before_init_mem_gpu``);
- ``train``: TRAIN_START to TRAIN_END, added to the train-end log record (``train_mem_cpu_alloc_delta``,
  ``train_mem_cpu_peaked_delta``, and ``train_mem_gpu_*`` with CUDA); an evaluation during training belongs to it;
- ``eval``: EVAL_START to EVAL_END, added to the metrics ``evaluate()`` returns after they were logged (HF adds them
  after logging too);
- ``test``: PREDICT_START to PREDICT_END, added to the prediction's metrics.

``alloc_delta`` is the memory held at the end minus at the start; ``peaked_delta`` how far above the end the stage
peaked. HF's sampling thread spins without sleeping; this one samples every millisecond, so a training step is not
slowed by a thread competing for the GIL, and a peak that lasts under a millisecond can be missed.
"""

from __future__ import annotations

import gc
import threading
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority

if TYPE_CHECKING:
    from trainbus.engine import Engine
    from trainbus.engine.events import (
        EvalEndEvent,
        EvalStartEvent,
        LogEvent,
        PredictEndEvent,
        PredictStartEvent,
        TrainEndEvent,
        TrainStartEvent,
    )

STAGES = ("init", "train", "eval", "test")
SAMPLE_SECONDS = 0.001


class MemoryMetrics(Plugin):
    """Adds HF's ``{stage}_mem_{cpu,gpu}_{alloc,peaked}_delta`` metrics to train, eval and predict results.

    Attributes:
        metrics: the memory metrics of each stage's last report, by stage name.

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(2, 1)
        >>> memory = MemoryMetrics()
        >>> engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), max_epochs=1, plugins=[memory],
        ...                 loss_fn=torch.nn.MSELoss(), train_data=[(torch.randn(4, 2), torch.randn(4, 1))])
        >>> _ = engine.fit()
        >>> sorted(k for k in memory.metrics["train"] if "cpu" in k)
        ['train_mem_cpu_alloc_delta', 'train_mem_cpu_peaked_delta']
    """

    priority = Priority.FIRST  # start before, stop after the other plugins' work

    def __init__(self) -> None:
        try:
            import psutil
        except ImportError as err:  # a dependency of accelerate, so normally present
            raise ConfigError("skip_memory_metrics=False needs psutil (pip install psutil)") from err
        self._process = psutil.Process()
        self.metrics: dict[str, dict[str, Any]] = {}
        self._stage: str | None = None  # the stage being measured
        self._begin: dict[str, int] = {}
        self._peak_rss = 0
        self._sampler: tuple[threading.Thread, threading.Event] | None = None
        self._init: dict[str, dict[str, int]] | None = None  # measured, not yet reported
        self._train_record: dict[str, Any] | None = None  # for the train-end log record

    @staticmethod
    def _gpu() -> bool:
        return torch.cuda.is_available()

    def _rss(self) -> int:
        return int(self._process.memory_info().rss)

    def start(self, stage: str) -> None:
        """Start measuring ``stage``; ignored while another stage runs (an evaluation inside training)."""
        _check_stage(stage)
        if self._stage is not None and self._stage != stage:
            return
        self._stop_sampler()
        self._stage = stage
        gc.collect()
        if self._gpu():
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.empty_cache()
            self._begin["gpu"] = torch.cuda.memory_allocated()
        self._begin["cpu"] = self._peak_rss = self._rss()
        done = threading.Event()
        thread = threading.Thread(target=self._sample, args=(done,), name="trainbus-memory-peak", daemon=True)
        thread.start()
        self._sampler = (thread, done)

    def _sample(self, done: threading.Event) -> None:
        while True:
            self._peak_rss = max(self._peak_rss, self._rss())
            if done.wait(SAMPLE_SECONDS):
                return

    def _stop_sampler(self) -> None:
        if self._sampler is not None:
            thread, done = self._sampler
            done.set()
            thread.join()
            self._sampler = None

    def stop(self, stage: str, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
        """Stop measuring ``stage`` and add its metrics to ``metrics`` (HF's ``stop_and_update_metrics``).

        Returns the memory metrics added: none for a stage nested in another, nor for ``init``, which is
        reported with the next stage (as HF does).
        """
        _check_stage(stage)
        if self._stage != stage:
            return {}
        self._stop_sampler()
        gc.collect()
        deltas: dict[str, dict[str, int]] = {}
        if self._gpu():
            torch.cuda.empty_cache()
            now, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            deltas["gpu"] = {
                "begin": self._begin["gpu"],
                "alloc": now - self._begin["gpu"],
                "peaked": max(0, peak - now),
            }
        now = self._rss()
        deltas["cpu"] = {
            "begin": self._begin["cpu"],
            "alloc": now - self._begin["cpu"],
            "peaked": max(0, self._peak_rss - now),
        }
        self._stage = None
        if stage == "init":
            self._init = deltas
            return {}
        added: dict[str, Any] = {}
        measured = [("init", self._init), (stage, deltas)] if self._init is not None else [(stage, deltas)]
        for name, by_device in measured:  # HF's key order
            for kind in ("alloc", "peaked"):
                for device, values in by_device.items():
                    added[f"{name}_mem_{device}_{kind}_delta"] = values[kind]
        if self._init is not None:
            for device, values in self._init.items():
                added[f"before_init_mem_{device}"] = values["begin"]
            self._init = None
        self.metrics[stage] = dict(added)
        if metrics is not None:
            metrics.update(added)
        return added

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_START, self.train_start)
        self.on(engine, Event.TRAIN_END, self.train_end)  # before TrainLogger logs the train metrics
        self.on(engine, Event.TRAIN_END, self.forget_train_record, priority=Priority.LAST)
        self.on(engine, Event.LOG, self.log, priority=Priority.DEFAULT)  # after they are filled, before the history
        self.on(engine, Event.EVAL_START, self.eval_start)
        self.on(engine, Event.EVAL_END, self.eval_end, priority=Priority.LAST)  # after the metrics were logged
        self.on(engine, Event.PREDICT_START, self.predict_start)
        self.on(engine, Event.PREDICT_END, self.predict_end, priority=Priority.LAST)

    def train_start(self, ev: TrainStartEvent) -> None:
        self.start("train")

    def train_end(self, ev: TrainEndEvent) -> None:
        self._train_record = self.stop("train") or None

    def log(self, ev: LogEvent) -> None:
        if self._train_record is not None and not ev.window and "train_runtime" in ev.logs:  # TrainLogger's record
            ev.logs.update(self._train_record)
            self._train_record = None

    def forget_train_record(self, ev: TrainEndEvent) -> None:
        self._train_record = None  # nobody logged train metrics: they stay in ``metrics["train"]`` only

    def eval_start(self, ev: EvalStartEvent) -> None:
        self.start("eval")

    def eval_end(self, ev: EvalEndEvent) -> None:
        self.stop("eval", ev.metrics)

    def predict_start(self, ev: PredictStartEvent) -> None:
        self.start("test")

    def predict_end(self, ev: PredictEndEvent) -> None:
        metrics = getattr(ev.output, "metrics", None)
        self.stop("test", metrics if isinstance(metrics, dict) else ev.metrics)


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ConfigError(f"unknown memory stage {stage!r}; stages: {', '.join(STAGES)}")
