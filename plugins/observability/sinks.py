"""Log sinks on the LOG event: JSON lines, CSV and TensorBoard, registered as ``report_to`` names.

Each sink writes the record TrainLogger put in the LOG payload plus ``step`` (the global step),
the same dict HF appends to ``state.log_history``. Only the world main process writes. Sinks run
at ``Priority.CONSUMER``, after the producers have filled the payload.

Importing this module adds ``"jsonl"``, ``"csv"`` and ``"tensorboard"`` to ``logging.SINKS``, so
``TrainingArguments(report_to=["jsonl", "csv", "tensorboard"])`` writes ``logs.jsonl``,
``logs.csv`` and ``runs/<time>_<host>/`` (or ``logging_dir``) under ``output_dir``.

Logs are data: a sink never deletes or rewrites another run's records. Every record carries the run's
id (``run_id``: ``checkpoints/identity.py``; a new key, so readers of the records as they were read them
as before). At TRAIN_START, a file holding records of another run (another id, or none: a file from an
older release, or anyone's) is renamed beside itself, ``logs.<time>.jsonl`` (its last write, UTC), with
a warning naming it, and this run starts the file anew (copying back the records it wrote itself before,
an ``evaluate()`` before ``fit()``). A file of this run's records only is appended to. A resumed run
rewinds its own records first: a sink's state (in every checkpoint) is the number of this run's records
it had written, and the records after them (written between the checkpoint and a crash, which the resumed
run logs again) are cut, so the file holds each record once, as the uninterrupted run's does. A resume that
the Checkpointing plugin judges a new run (a branch from a checkpoint elsewhere: ``lineage.py``) has an id
of its own, so it cuts nothing of the run it branched from.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import logging
import math
import os
import socket
import warnings
from collections.abc import Mapping
from numbers import Integral, Real
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import Composition, ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import check_path

from ..checkpoints.identity import run_id
from .logging import SINKS, TrainLogger
from .record_files import RUN_ID, json_run_id, lines_of, replace_file, set_aside_beside

if TYPE_CHECKING:
    from trainbus.engine import Engine, LogEvent, TrainEndEvent, TrainStartEvent

__all__ = ["RUN_ID", "CsvSink", "JsonlSink", "TensorBoardSink", "default_logging_dir", "to_json_value"]

logger = logging.getLogger("trainbus.logging")


def to_json_value(value: Any) -> Any:
    """A strict-JSON value: ints/floats as numbers (NaN / inf as "nan" / "inf" / "-inf"), else a string.

    One-element tensors are read with ``.item()`` (a sink runs once per logging window, not per step).

    Example:
        >>> to_json_value(float("nan")), to_json_value(2), to_json_value(-math.inf)
        ('nan', 2, '-inf')
    """
    value = _scalar(value)
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, Integral):
        return int(value)
    if isinstance(value, Real):
        number = float(value)
        return number if math.isfinite(number) else str(number)
    return str(value)


def _scalar(value: Any) -> Any:
    """A one-element tensor as a Python number; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


def _record(ev: LogEvent) -> dict[str, Any]:
    return {**ev.logs, "step": ev.engine.state.global_step}


def _without_logger(composition: Composition, where: object) -> list[str] | None:
    """The composition problem of a sink with no TrainLogger to fill its records (None when one is attached)."""
    if composition.get(TrainLogger) is not None:
        return None
    return [
        f"no TrainLogger is attached, so no LOG record carries the loss, learning rate or metrics: {where} gets "
        "only what engine.log() is called with; attach TrainLogger() and FlowControl(logging_steps=...)"
    ]


class _FileSink(Plugin):
    """Shared behaviour: write on LOG from the main process, each record with the run's id; at TRAIN_START, set
    another run's file aside (never delete it) and cut a resumed run's own records back to its checkpoint."""

    priority = Priority.CONSUMER

    def __init__(self, path: str | os.PathLike[str]) -> None:
        check_path("path", path)
        self.path = Path(path)
        #: this run's records in the file (and the records of the runs it resumes); None: unknown (a checkpoint
        #: from before sinks kept it: nothing is cut)
        self.records: int | None = None
        #: where the last TRAIN_START moved another run's file (None: it moved nothing)
        self.set_aside: Path | None = None

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_START, self.train_start)
        self.on(engine, Event.LOG, self.log)

    def check_composition(self, composition: Composition) -> list[str] | None:
        return _without_logger(composition, self.path)

    def state_dict(self) -> dict[str, Any]:
        return {"records": self.records}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        records = state.get("records")
        self.records = records if isinstance(records, int) and not isinstance(records, bool) and records >= 0 else None

    def train_start(self, ev: TrainStartEvent) -> None:
        state = ev.engine.state
        self.set_aside = None
        if state.global_step == 0:
            self.records = None  # a fresh run keeps the records it logged before (an evaluate() before fit())
        if not state.is_world_process_zero:
            return
        own = run_id(state)
        ids = self.run_ids() if self.path.exists() else []
        mine = [i for i, found in enumerate(ids) if found == own]
        keep = len(mine) if self.records is None else min(self.records, len(mine))
        if len(mine) < len(ids):  # another run's records (or records without an id): that run's file, kept whole
            self.set_aside = set_aside_beside(self.path)
            if self.set_aside is None:  # another process moved it meanwhile: nothing of it is left here
                self.records = 0
                return
            message = (
                f"{type(self).__name__}: {self.path} held records of another run; this run (run_id {own}) moved "
                f"that file to {self.set_aside} and starts {self.path} anew"
            )
            logger.warning(message)
            warnings.warn(message, stacklevel=2)
            if keep:  # this run's own records in it (written before this TRAIN_START), copied back
                self.restore(self.set_aside, mine[:keep])
        elif keep < len(mine):
            self.rewind(keep)  # a resumed run logs again what came after its checkpoint
        self.records = keep

    def log(self, ev: LogEvent) -> None:
        state = ev.engine.state
        if ev.logs and state.is_world_process_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.write({**_record(ev), RUN_ID: run_id(state)})
            if self.records is not None:
                self.records += 1

    def write(self, record: dict[str, Any]) -> None:
        raise NotImplementedError

    def run_ids(self) -> list[str | None]:
        """The run id of each record in the file, in order (None for a record without one)."""
        raise NotImplementedError

    def rewind(self, records: int) -> None:
        """Keep the file's first ``records`` records (all when it holds fewer)."""
        raise NotImplementedError

    def restore(self, source: Path, indices: list[int]) -> None:
        """Write the records at ``indices`` of ``source`` (a file of this format) as this file's first records."""
        raise NotImplementedError


class JsonlSink(_FileSink):
    """Appends each log record as one JSON object per line, flushed at once (strict JSON: no NaN).

    Args:
        path: the ``.jsonl`` file (its folder is created on the first write).

    Example:
        >>> from trainbus.plugins.observability.sinks import JsonlSink
        >>> sink = JsonlSink("out/logs.jsonl")
    """

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps({str(k): to_json_value(v) for k, v in record.items()}, allow_nan=False)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()

    def rewind(self, records: int) -> None:
        lines = lines_of(self.path)
        if len(lines) > records:
            replace_file(self.path, b"".join(lines[:records]))

    def run_ids(self) -> list[str | None]:
        return [json_run_id(line) for line in lines_of(self.path)]

    def restore(self, source: Path, indices: list[int]) -> None:
        lines = lines_of(source)
        with self.path.open("ab") as f:
            f.write(b"".join(lines[i] for i in indices))


class CsvSink(_FileSink):
    """Writes log records as rows of a CSV table: ``step`` first, then every key in order of appearance.

    A record with a key the header lacks rewrites the file with the union of the columns (rows
    written before get empty cells there), through a temporary file and an atomic rename, so the
    file is always one well-formed table. Records with known keys are appended.

    Args:
        path: the ``.csv`` file (its folder is created on the first write).

    Example:
        >>> from trainbus.plugins.observability.sinks import CsvSink
        >>> sink = CsvSink("out/logs.csv")
    """

    def write(self, record: dict[str, Any]) -> None:
        row = {str(k): _csv_value(v) for k, v in record.items()}
        header = self._header()
        new = [k for k in row if k not in header]
        if header and not new:
            with self.path.open("a", encoding="utf-8", newline="") as f:
                csv.DictWriter(f, fieldnames=header).writerow(row)
            return
        header = header or ["step"]
        header = header + [k for k in new if k not in header]
        rows = [*self._rows(), row]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", encoding="utf-8", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header, restval="")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)

    def rewind(self, records: int) -> None:
        rows = self._rows()
        if len(rows) <= records:
            return
        kept = rows[:records]
        header = [k for k in self._header() if k == "step" or any(row.get(k) not in (None, "") for row in kept)]
        with io.StringIO(newline="") as text:
            writer = csv.DictWriter(text, fieldnames=header, restval="", extrasaction="ignore")
            writer.writeheader()
            writer.writerows(kept)
            replace_file(self.path, text.getvalue().encode("utf-8"))

    def run_ids(self) -> list[str | None]:
        return [row.get(RUN_ID) or None for row in self._rows()]

    def restore(self, source: Path, indices: list[int]) -> None:
        with source.open(encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            header, rows = list(reader.fieldnames or []), list(reader)
        kept = [rows[i] for i in indices]
        try:
            with self.path.open("x", encoding="utf-8", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=header, restval="", extrasaction="ignore")
                writer.writeheader()
                writer.writerows(kept)
        except FileExistsError:  # another process wrote a record here meanwhile: add ours as records, header grown
            for row in kept:
                self.write({k: v for k, v in row.items() if v not in (None, "")})

    def _header(self) -> list[str]:
        if not self.path.exists():
            return []
        with self.path.open(encoding="utf-8", newline="") as f:
            return next(csv.reader(f), [])

    def _rows(self) -> list[dict[str, str]]:
        if not self.path.exists():
            return []
        with self.path.open(encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))


def _csv_value(value: Any) -> Any:
    value = to_json_value(value)
    return "" if value is None else value


def default_logging_dir(output_dir: str | os.PathLike[str]) -> str:
    """HF's ``logging_dir`` default: ``{output_dir}/runs/{Mon DD_HH-MM-SS}_{hostname}``."""
    stamp = datetime.datetime.now().strftime("%b%d_%H-%M-%S")
    return os.path.join(os.fspath(output_dir), "runs", f"{stamp}_{socket.gethostname()}")


def rewrite_key(key: str) -> str:
    """HF's TensorBoard tag for a log key: ``eval_loss`` -> ``eval/loss``, ``loss`` -> ``train/loss``."""
    for prefix in ("eval_", "test_"):
        if key.startswith(prefix):
            return prefix[:-1] + "/" + key[len(prefix) :]
    return "train/" + key


class TensorBoardSink(Plugin):
    """Writes numeric log values as TensorBoard scalars (tags as HF's ``TensorBoardCallback``).

    The writer opens on the first record and is flushed after each one; it closes at TRAIN_END
    (a later ``evaluate()`` opens a new event file in the same folder). Needs ``tensorboard``.

    Args:
        log_dir: the event file folder.

    Raises:
        ConfigError: tensorboard is not installed.

    Example:
        >>> from trainbus.plugins.observability.sinks import TensorBoardSink
        >>> sink = TensorBoardSink("out/runs")
    """

    priority = Priority.CONSUMER

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        check_path("log_dir", log_dir)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                f"TensorBoardSink (report_to='tensorboard') needs the tensorboard package: "
                f"pip install tensorboard ({exc})"
            ) from None
        self._writer_class = SummaryWriter
        self.log_dir = os.fspath(log_dir)
        self.writer: Any = None

    def check_composition(self, composition: Composition) -> list[str] | None:
        return _without_logger(composition, "TensorBoard")

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.LOG, self.log)
        # after the final train metrics; also when training fails (cleanup): the file is closed either way
        self.on(engine, Event.TRAIN_END, self.close, priority=Priority.LAST, cleanup=True)

    def detach(self, engine: Engine) -> None:
        self.close(None)
        super().detach(engine)

    def log(self, ev: LogEvent) -> None:
        if not ev.logs or not ev.engine.state.is_world_process_zero:
            return
        if self.writer is None:
            self.writer = self._writer_class(log_dir=self.log_dir)
        step = ev.engine.state.global_step
        for key, value in ev.logs.items():
            number = _scalar(value)
            if isinstance(number, Real) and not isinstance(number, bool):  # HF skips non-numbers too
                self.writer.add_scalar(rewrite_key(str(key)), float(number), step)
        self.writer.flush()

    def close(self, ev: TrainEndEvent | None) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _output(args: Any, name: str) -> str:
    return os.path.join(os.fspath(args.output_dir), name)


def _tensorboard(args: Any) -> TensorBoardSink:
    return TensorBoardSink(args.logging_dir or default_logging_dir(args.output_dir))


_REGISTERED: Mapping[str, Any] = {
    "jsonl": lambda args: JsonlSink(_output(args, "logs.jsonl")),
    "csv": lambda args: CsvSink(_output(args, "logs.csv")),
    "tensorboard": _tensorboard,
}
SINKS.update(_REGISTERED)
