"""TrainLogger: HF's training logs (loss of the window, learning_rate, grad_norm, epoch) with one host sync per window.

Per micro-batch the logger only keeps the detached loss (no device op, no host read). At each
logging point the window's losses, the grad norm and any pending token count are stacked and read
together, so a run with L logging windows makes L host reads for logging and none per step. NaN /
Inf losses are then filtered on the host exactly as HF's ``logging_nan_inf_filter`` does (a bad
micro-batch loss adds the window's running mean instead).

A checkpoint can fall inside a logging window. At SAVE (before Checkpointing writes) every rank reads
the window so far in one transfer (one all-reduce across processes, as at a logging point) and holds
the values; ``state_dict`` carries them with the sum of the windows logged so far and the step the
run started at, so a resumed run logs the same losses, bit for bit, and ``train_loss`` is the mean over
the whole run (transformers' covers only the resumed part). A save costs one more host read when its
window is not empty; steps still make none.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import ConfigTypeError, check_flag
from trainbus.hooks import batch_size_of

from ..distributed.processes import all_reduce_sum, collective_device, world_size

if TYPE_CHECKING:
    from trainbus.engine import (
        Engine,
        EvalEndEvent,
        LogEvent,
        LossEvent,
        SaveEvent,
        TrainEndEvent,
        TrainStartEvent,
    )

#: where TrainLogger appends to state.log_history: after producers, before sinks and callbacks
HISTORY_PRIORITY = Priority.CONSUMER.before("*")


class TrainLogger(Plugin):
    """Fills LOG payloads like HF's Trainer and appends them to ``state.log_history``.

    Args:
        nan_inf_filter: replace a NaN / Inf micro-batch loss by the window's running mean (HF default).
        include_num_input_tokens_seen: "no" | "all" (every input token) | "non_padding" (attention_mask sum).
        input_name: the batch key of the model's main input (for token counting).
        log_eval_metrics: log the metrics of each evaluation (HF's ``evaluate`` does).

    Example:
        >>> from trainbus.plugins.observability.logging import TrainLogger
        >>> logger = TrainLogger(nan_inf_filter=True)
    """

    priority = Priority.PRODUCER
    #: the payload fields its handlers read (the engine runs every writer of a field before its readers)
    reads: ClassVar[Mapping[str, str]] = {"eval_end": "metrics"}

    def __init__(
        self,
        nan_inf_filter: bool = True,
        include_num_input_tokens_seen: str = "no",
        input_name: str = "input_ids",
        log_eval_metrics: bool = True,
    ) -> None:
        check_flag("nan_inf_filter", nan_inf_filter)
        check_flag("log_eval_metrics", log_eval_metrics)
        if include_num_input_tokens_seen not in ("no", "all", "non_padding"):
            raise ConfigError(
                "include_num_input_tokens_seen must be 'no', 'all' or 'non_padding', "
                f"got {include_num_input_tokens_seen!r}"
            )
        self.nan_inf_filter = nan_inf_filter
        self.tokens = include_num_input_tokens_seen
        self.input_name = input_name
        self.log_eval_metrics = log_eval_metrics
        self.train_metrics: dict[str, float] = {}
        self._window: list[tuple[torch.Tensor, int]] | None = None  # (loss, global_step at the time)
        self._lr: Any = None
        self._pending_tokens: Any = 0  # int, or a device tensor for non_padding counts
        self._last_logged = 0
        self._total_loss = 0.0  # the run's logged window sums (train_loss = this / the run's steps)
        self._run_start = 0  # the step the run started at (kept across a resume)
        self._held: list[tuple[float, int]] = []  # the window's losses read at a save, with their steps
        self._resumed = False  # load_state_dict ran: the next TRAIN_START continues the loaded run
        self._start_step = 0  # this fit()'s first step (for steps per second)
        self._start_time = 0.0
        self._samples = 0

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_START, self.train_start, priority=Priority.FIRST)
        self.on(engine, Event.LOSS, self.loss, priority=Priority.CONSUMER)  # after loss normalisation
        self.on(engine, Event.LOG, self.fill)
        self.on(engine, Event.LOG, self.record, priority=HISTORY_PRIORITY)
        self.on(engine, Event.TRAIN_END, self.train_end)
        # before Checkpointing (CONSUMER) writes the plugins' states
        self.on(engine, Event.SAVE, self.hold_window, priority=Priority.PRODUCER)
        if self.log_eval_metrics:
            # after every handler that adds metrics (HF logs them before on_evaluate: before CallbackAdapter's)
            after_producers = Priority.DEFAULT.after("*").before("CallbackAdapter")
            self.on(engine, Event.EVAL_END, self.eval_end, priority=after_producers)

    # -- per step: device work only ----------------------------------------------------------------
    def train_start(self, ev: TrainStartEvent) -> None:
        engine = ev.engine
        self._window = []
        self._start_step = engine.state.global_step
        if not self._resumed:  # a fresh fit(); a resumed one keeps the loaded window and totals
            self._last_logged = self._run_start = engine.state.global_step
            self._total_loss = 0.0
            self._held = []
        self._resumed = False
        self._samples = 0
        self._lr = None
        self._start_time = time.perf_counter()
        self.train_metrics = {}

    def loss(self, ev: LossEvent) -> None:
        assert self._window is not None
        self._window.append((ev.loss.detach(), ev.engine.state.global_step))
        if ev.micro_index == 0:
            # the rate this step uses, read before a scheduler moves it at OPTIMIZER_STEP (HF logs the same)
            optimizer = ev.engine.optimizer
            lr = optimizer.param_groups[0]["lr"] if optimizer is not None and optimizer.param_groups else None
            # torchao keeps lr as a tensor the scheduler fills in place: keep this step's value
            self._lr = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr
        batch = ev.batch
        self._samples += batch_size_of(batch)
        if self.tokens == "no":
            return
        if not isinstance(batch, Mapping) or self.input_name not in batch:
            raise ConfigError(
                f"include_num_input_tokens_seen needs dict batches with {self.input_name!r}; "
                f"got {type(batch).__name__}{' with keys ' + str(sorted(batch)) if isinstance(batch, Mapping) else ''}"
            )
        mask = batch.get("attention_mask")
        if self.tokens == "non_padding" and isinstance(mask, torch.Tensor):
            self._pending_tokens = self._pending_tokens + mask.sum()  # stays on the device
        else:
            self._pending_tokens += int(batch[self.input_name].numel())  # a shape: no sync

    # -- logging points: one host read ------------------------------------------------------------
    def _read(self, engine: Engine, *, extras_too: bool = True) -> tuple[list[tuple[float, int]], dict[str, Any]]:
        """Read the window's losses (with their steps), grad norm, lr and tokens with a single device-to-host
        transfer; the tokens go into ``state.num_input_tokens_seen``. ``extras_too=False``: losses and tokens."""
        assert self._window is not None
        window, self._window = self._window, []
        # the grad norm of the latest step: step_outputs keeps it until the next STEP_START
        grad_norm = engine.step_outputs.get("grad_norm") if extras_too else None
        lr = self._lr if extras_too else None
        extras: list[tuple[str, torch.Tensor]] = []
        tokens = self._pending_tokens
        if world_size() > 1 and not isinstance(tokens, torch.Tensor) and self.tokens != "no":
            tokens = torch.tensor(float(tokens))  # summed over ranks with the losses
        for name, value in (
            ("grad_norm", grad_norm),
            ("learning_rate", lr),
            ("tokens", tokens),
        ):
            if isinstance(value, torch.Tensor):
                extras.append((name, value.detach().reshape(())))
        tensors = [loss.reshape(()) for loss, _ in window] + [value for _, value in extras]
        values: list[float] = []
        if tensors:
            device = tensors[0].device
            names = ["loss"] * len(window) + [name for name, _ in extras]
            values = self._across_processes(torch.stack([t.to(device, torch.float64) for t in tensors]), names)
        losses = list(zip(values[: len(window)], [step for _, step in window], strict=True))
        read: dict[str, Any] = dict(zip([name for name, _ in extras], values[len(window) :], strict=True))
        for name, value in (
            ("grad_norm", grad_norm),
            ("learning_rate", lr),
            ("tokens", tokens),
        ):
            if value is not None and not isinstance(value, torch.Tensor):
                read[name] = value
        self._flush_tokens(engine, read.pop("tokens", 0))
        return losses, read

    def _read_window(self, engine: Engine) -> dict[str, Any]:
        """The logging point's read: the window's filtered loss sum (held values first) and the extras."""
        losses, read = self._read(engine)
        losses, self._held = self._held + losses, []
        read["loss"] = self._filtered_sum([loss for loss, _ in losses], [step for _, step in losses])
        return read

    def hold_window(self, ev: SaveEvent) -> None:
        """At a save, read the window so far and hold its values, so ``state_dict`` carries them.

        Every rank runs it at the same SAVE, so the one all-reduce of a multi-process read matches up;
        the values are the ones the logging point would read (each loss averaged over ranks), and the
        logging point sums them in the same order: the logged loss does not change.
        """
        if self._window:
            losses, _ = self._read(ev.engine, extras_too=False)
            self._held.extend(losses)

    def state_dict(self) -> dict[str, Any]:
        """The open window's losses, the logged sums and the run's first step (JSON: plain floats and ints).

        A window not yet held (a save outside a SAVE event) is read here, locally: exact in one
        process; under several processes only the SAVE path averages the ranks' losses.
        """
        pending = [(float(loss), step) for loss, step in self._window or []]
        tokens = self._pending_tokens
        return {
            "held": [[loss, step] for loss, step in self._held + pending],
            "last_logged": self._last_logged,
            "total_loss": self._total_loss,
            "run_start": self._run_start,
            "pending_tokens": int(tokens) if isinstance(tokens, int) else int(tokens.item()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the checkpointed run: the next TRAIN_START keeps these instead of starting afresh."""
        self._held = [(float(loss), int(step)) for loss, step in state.get("held", [])]
        self._last_logged = int(state.get("last_logged", 0))
        self._total_loss = float(state.get("total_loss", 0.0))
        self._run_start = int(state.get("run_start", 0))
        self._pending_tokens = int(state.get("pending_tokens", 0))
        self._window = []
        self._resumed = True

    def _across_processes(self, local: torch.Tensor, names: list[str]) -> list[float]:
        """The values to log, read in one transfer. Across processes, in one all-reduce: each loss (a
        rank's share of a step's loss) averaged over ranks, the token count summed; grad norm and
        learning rate are the same on every rank and stay local."""
        processes = world_size()
        if processes == 1:
            return local.tolist()  # type: ignore[no-any-return]
        summed = all_reduce_sum(local.to(collective_device()))
        both = torch.cat([local.to(summed.device), summed]).tolist()
        values, totals = both[: len(names)], both[len(names) :]
        for i, name in enumerate(names):
            if name == "loss":
                values[i] = totals[i] / processes
            elif name == "tokens":
                values[i] = totals[i]
        return values

    def _filtered_sum(self, losses: list[float], steps: list[int]) -> float:
        """The window's loss sum; with the filter, a non-finite loss adds the running mean (HF's rule)."""
        total = 0.0
        for loss, step in zip(losses, steps, strict=True):
            if self.nan_inf_filter and not math.isfinite(loss):
                total += total / (1 + step - self._last_logged)
            else:
                total += loss
        return total

    def _flush_tokens(self, engine: Engine, tokens: float) -> None:
        engine.state.num_input_tokens_seen += int(tokens)
        self._pending_tokens = 0

    def fill(self, ev: LogEvent) -> None:
        engine, logs = ev.engine, ev.logs
        state = engine.state
        if ev.window and self._window is not None and state.global_step > self._last_logged:
            read = self._read_window(engine)
            self._total_loss += read["loss"]
            if not _without_loop_loss(engine):
                logs["loss"] = read["loss"] / (state.global_step - self._last_logged)
            if read.get("grad_norm") is not None:
                logs["grad_norm"] = float(read["grad_norm"])
            if read.get("learning_rate") is not None:
                logs["learning_rate"] = float(read["learning_rate"])
            self._last_logged = state.global_step
        if logs:
            logs["epoch"] = state.epoch
            if self.tokens != "no":
                logs["num_input_tokens_seen"] = state.num_input_tokens_seen

    def record(self, ev: LogEvent) -> None:
        if ev.logs:
            ev.engine.state.log_history.append({**ev.logs, "step": ev.engine.state.global_step})

    def eval_end(self, ev: EvalEndEvent) -> None:
        if ev.metrics and not ev.reported:  # reported: whoever made them logged them (a Trainer's own evaluate())
            ev.engine.log(ev.metrics)  # HF's evaluate() logs its metrics (and adds "epoch" to them)

    def train_end(self, ev: TrainEndEvent) -> None:
        engine = ev.engine
        state = engine.state
        if self._window is None:
            return
        read = self._read_window(engine)
        self._total_loss += read["loss"]
        steps = state.global_step - self._start_step
        runtime = time.perf_counter() - self._start_time
        metrics: dict[str, float] = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(self._samples / runtime, 3) if runtime > 0 else 0.0,
            "train_steps_per_second": round(steps / runtime, 3) if runtime > 0 else 0.0,
            "total_flos": float(state.total_flos),
            "train_loss": self._total_loss / max(state.global_step - self._run_start, 0.001),  # the whole run
        }
        if _without_loop_loss(engine):
            del metrics["train_loss"]
        self._window = None
        self.train_metrics = dict(metrics)
        engine.log(metrics)


def _without_loop_loss(engine: Engine) -> bool:
    """A step function's engine has no loop loss (no LOSS fires): a 0.0 would be a wrong number, so none is logged;
    what the function returns is in ``engine.step_outputs``."""
    return getattr(engine, "step_function", None) is not None


class ConsoleSink(Plugin):
    """Prints every log record as HF's PrinterCallback does (floats with 4 significant digits).

    Args:
        stream: a writer with ``write`` (default: print to stdout).
    """

    priority = Priority.CONSUMER

    def __init__(self, stream: Any = None) -> None:
        if stream is not None and not callable(getattr(stream, "write", None)):
            raise ConfigTypeError(
                f"ConsoleSink's stream must have a write(text) method (a file, sys.stderr, io.StringIO) or be None "
                f"(print to stdout), got {stream!r:.80} ({type(stream).__name__})"
            )
        self.stream = stream

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.LOG, self.write)

    def write(self, ev: LogEvent) -> None:
        if not ev.logs or not ev.engine.state.is_local_process_zero:
            return
        text = str(format_logs(ev.logs))
        if self.stream is None:
            print(text)
        else:
            self.stream.write(text + "\n")


def format_logs(logs: Mapping[str, Any]) -> dict[str, Any]:
    """Logs for display: floats as 4 significant digits, total_flos left out (as HF prints them)."""
    return {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in logs.items() if k != "total_flos"}


#: report_to names -> sink factories (``factory(args) -> Plugin``); other sink modules may add theirs
SINKS: dict[str, Any] = {"console": lambda args: ConsoleSink()}
