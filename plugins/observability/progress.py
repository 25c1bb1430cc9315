"""Progress bars (tqdm) for train / eval / predict, and the printer used when bars are off.

HF's Trainer shows a ProgressCallback by default and a PrinterCallback with ``disable_tqdm=True``;
these are their plugin counterparts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tqdm.auto import tqdm

from trainbus.engine import Event, Plugin, Priority, data_length
from trainbus.engine.errors import check_positive_int

from .logging import ConsoleSink, format_logs

if TYPE_CHECKING:
    from trainbus.engine import Engine, EvalStartEvent, LogEvent, PredictStartEvent, StepEndEvent, TrainStartEvent


class ProgressBars(Plugin):
    """A training bar over optimizer steps, a bar per evaluation / prediction, logs written above them.

    Args:
        max_str_len: strings in logs longer than this are shown shortened.
        **tqdm_kwargs: passed to every bar (e.g. ``file=``, ``disable=``).

    Example:
        >>> from trainbus.plugins.observability.progress import ProgressBars
        >>> bars = ProgressBars(disable=True)
    """

    priority = Priority.CONSUMER

    def __init__(self, max_str_len: int = 100, **tqdm_kwargs: Any) -> None:
        check_positive_int("max_str_len", max_str_len, minimum=0)
        self.max_str_len = max_str_len
        self.tqdm_kwargs = {"dynamic_ncols": True, **tqdm_kwargs}
        self.training_bar: Any = None
        self.prediction_bar: Any = None
        self._shown = 0

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_START, self.train_start)
        self.on(engine, Event.STEP_END, self.step_end)
        self.on(engine, Event.EVAL_START, self.eval_start)
        self.on(engine, Event.PREDICT_START, self.eval_start)
        self.on(engine, Event.EVAL_BATCH_END, self.batch_end)
        self.on(engine, Event.PREDICT_BATCH_END, self.batch_end)
        self.on(engine, Event.EVAL_END, self.eval_end)
        self.on(engine, Event.PREDICT_END, self.eval_end)
        self.on(engine, Event.LOG, self.log)
        # after the final train metrics are logged (TrainLogger logs them at TRAIN_END, PRODUCER)
        self.on(engine, Event.TRAIN_END, self.train_end, priority=Priority.LAST, cleanup=True)  # failed runs too

    def detach(self, engine: Engine) -> None:
        self._close_all()
        super().detach(engine)

    def train_start(self, ev: TrainStartEvent) -> None:
        state = ev.engine.state
        if state.is_world_process_zero:
            self._shown = state.global_step
            self.training_bar = tqdm(total=state.max_steps, initial=state.global_step, **self.tqdm_kwargs)

    def step_end(self, ev: StepEndEvent) -> None:
        if self.training_bar is not None:
            step = ev.engine.state.global_step
            self.training_bar.update(step - self._shown)
            self._shown = step

    def eval_start(self, ev: EvalStartEvent | PredictStartEvent) -> None:
        if ev.engine.state.is_world_process_zero and self.prediction_bar is None:
            self.prediction_bar = tqdm(
                total=data_length(ev.dataloader), leave=self.training_bar is None, **self.tqdm_kwargs
            )

    def batch_end(self, ev: Any) -> None:
        if self.prediction_bar is not None:
            self.prediction_bar.update(1)

    def eval_end(self, ev: Any) -> None:
        if self.prediction_bar is not None:
            self.prediction_bar.close()
            self.prediction_bar = None

    def log(self, ev: LogEvent) -> None:
        if self.training_bar is None or not ev.logs:
            return
        shown = {
            k: (f"[string of length {len(v)}]" if isinstance(v, str) and len(v) > self.max_str_len else v)
            for k, v in format_logs(ev.logs).items()
        }
        self.training_bar.write(str(shown))

    def train_end(self, ev: Any) -> None:
        if self.training_bar is not None:
            self.training_bar.close()
            self.training_bar = None

    def _close_all(self) -> None:
        for bar in (self.training_bar, self.prediction_bar):
            if bar is not None:
                bar.close()
        self.training_bar = self.prediction_bar = None


class Printer(ConsoleSink):
    """Prints each log record (HF's PrinterCallback); used when ``disable_tqdm=True``."""
