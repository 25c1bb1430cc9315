"""The trainer state of a checkpoint, with a save cost that does not grow with the log history.

``state.log_history`` grows by one record per log; rewriting all of it into every checkpoint made a
save at step 20,000 (logging every step) cost about 9x one at step 1,000. So the history is cut into
segments of ``SEGMENT`` records: record ``i`` lives in segment ``i // SEGMENT``. The full segments
are files of their own, ``log_history-000000.json``, ... (listed, in order, under the manifest's
``log_history_segments``), and a full segment never changes: the next save hard-links the copy the
previous save wrote (the same inode, size and modification time as when it was written, so
unchanged since) instead of writing it again. Only the records
after the last full segment, fewer than ``SEGMENT``, go into ``trainer_state.json``'s ``log_history``.
A save therefore serialises at most ``SEGMENT - 1`` records and links one file per ``SEGMENT``
records (measured in ``benchmarks/checkpoint_growth.py``).

``trainer_state.json`` is transformers' ``TrainerState`` JSON, its fields only (``TrainerState.load_from_json``
reads it); the engine's other fields are ``trainbus_state.json``'s (a checkpoint written before that split
has them all in ``trainer_state.json``, and is read as before). A run with fewer than ``SEGMENT`` records
has its whole history there; a longer run has the newest records there and the older ones in the
segments, which ``read_log_history`` puts back in front, so a resume gets the history bit for bit.

A segment is reused only while the records it was written from are the same objects (the first and
last of the segment, held by the cache) at the same places in ``log_history``: the history is
append-only (as HF's), and a run that replaces records gets fresh segments. Where the file system
has no hard links, the segment is written again.

A linked segment is one inode in every checkpoint that lists it, so a damaged one (a flipped bit
keeps the mtime, and the next save links it again) costs only its records: ``read_log_history``
warns and reads the checkpoint without them, instead of failing every checkpoint of the run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from trainbus.engine import State

from . import io as cio
from . import verified
from .safety import DamagedCheckpoint, check_parse_cost, damaged, parse_cost, plain_name

SEGMENT = 256
#: transformers' ``TrainerState`` fields (4.57 to 5.24): ``trainer_state.json`` holds these and only these, so
#: ``TrainerState.load_from_json`` reads it; the engine's other State fields are ``trainbus_state.json``'s
HF_STATE_FIELDS = frozenset({
    "epoch", "global_step", "max_steps", "logging_steps", "eval_steps", "save_steps", "train_batch_size",
    "num_train_epochs", "num_input_tokens_seen", "total_flos", "log_history", "best_metric", "best_global_step",
    "best_model_checkpoint", "is_local_process_zero", "is_world_process_zero", "is_hyper_param_search", "trial_name",
    "trial_params", "stateful_callbacks",
})  # fmt: skip
OWN_STATE = "trainbus_state.json"
OWN_FORMAT = "trainbus-state"
FORMAT = "trainbus-log-history"
MANIFEST_KEY = "log_history_segments"
logger = logging.getLogger("trainbus.checkpoint")
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}

__all__ = [
    "MANIFEST_KEY", "SEGMENT", "TakenState", "read_log_history", "segment_name", "take_trainer_state", "untag",
    "write_trainer_state",
]  # fmt: skip


class _Segment(NamedTuple):
    name: str
    entry: dict[str, Any]  # its manifest entry: size and hash
    path: Path  # where the published copy lives
    stamp: tuple[int, int, int, int]  # its device, inode, size and mtime when written: unchanged since if equal
    first: Any  # the first and last records it was written from (held: their ids cannot be reused)
    last: Any


#: output_dir -> the segments its last save wrote, in order
_CACHE: dict[str, list[_Segment]] = {}


def segment_name(index: int) -> str:
    return f"log_history-{index:06d}.json"


class TakenState(NamedTuple):
    """A trainer state as it was when a save took it, for a write that happens later (a background save)."""

    history: list[dict[str, Any]]  # the records (the same objects: append-only), in a list of its own
    hf_text: str  # trainer_state.json, with the records after the last full segment
    own_text: str  # trainbus_state.json


def take_trainer_state(state: State) -> TakenState:
    """What ``write_trainer_state`` writes, taken now: the two JSON texts and the history's list (no records copied)."""
    history = list(state.log_history)
    hf_text, own_text = split_state(state, history[len(history) // SEGMENT * SEGMENT :])
    return TakenState(history, hf_text, own_text)


def write_trainer_state(
    state: State | TakenState, tmp: Path, final: Path
) -> tuple[dict[str, dict[str, Any]], dict[str, Any], set[str]]:
    """Write ``trainer_state.json`` and the history's segments into ``tmp`` (to be published as ``final``).

    ``state`` is the engine's State, or one taken earlier (``take_trainer_state``). Returns the files'
    manifest entries, what the manifest lists (the segments' names), and the names of the files that
    were linked (already durable: they need no fsync).
    """
    taken = state if isinstance(state, TakenState) else take_trainer_state(state)
    history = taken.history
    full = len(history) // SEGMENT
    key = str(final.parent.absolute())
    cached = _CACHE.get(key, [])
    segments: list[_Segment] = []
    files: dict[str, dict[str, Any]] = {}
    linked: set[str] = set()
    for index in range(full):
        name = segment_name(index)
        first, last = history[index * SEGMENT], history[(index + 1) * SEGMENT - 1]
        old = cached[index] if index < len(cached) else None
        if old is not None and old.first is first and old.last is last and _link(old, tmp / name):
            entry, stamp = old.entry, old.stamp
            linked.add(name)
        else:
            entry = cio.write_text(tmp / name, _encode_segment(history[index * SEGMENT : (index + 1) * SEGMENT]))
            stamp = _stamp(tmp / name)
        files[name] = entry
        segments.append(_Segment(name, entry, final / name, stamp, first, last))
    files["trainer_state.json"] = cio.write_text(tmp / "trainer_state.json", taken.hf_text)
    files[OWN_STATE] = cio.write_text(tmp / OWN_STATE, taken.own_text)
    _CACHE[key] = segments
    listed = {MANIFEST_KEY: [s.name for s in segments]} if segments else {}
    return files, listed, linked


def split_state(state: State, log_history: list[dict[str, Any]] | None = None) -> tuple[str, str]:
    """``trainer_state.json``'s text (transformers' ``TrainerState`` fields only, as its ``save_to_json`` writes
    them, non-finite floats tagged: strict JSON) and ``trainbus_state.json``'s (the engine's other fields)."""
    fields = {f.name: getattr(state, f.name) for f in dataclasses.fields(State)}  # a subclass's view: every field
    if log_history is not None:
        fields["log_history"] = log_history
    hf = {k: v for k, v in fields.items() if k in HF_STATE_FIELDS}
    own = {k: v for k, v in fields.items() if k not in HF_STATE_FIELDS}
    hf_text = json.dumps(_tag(hf), indent=2, sort_keys=True, allow_nan=False) + "\n"
    own_text = json.dumps({"format": OWN_FORMAT, "state": _tag(own)}, indent=1, sort_keys=True, allow_nan=False)
    return hf_text, own_text


def join_state(hf: dict[str, Any], own_document: Any, path: Path) -> dict[str, Any]:
    """The engine State's fields from ``trainer_state.json``'s object and ``trainbus_state.json``'s document."""
    if not isinstance(own_document, dict) or own_document.get("format") != OWN_FORMAT:
        raise DamagedCheckpoint(f"checkpoint file {path} is not a {OWN_FORMAT} file")
    own = own_document.get("state")
    if not isinstance(own, dict) or set(own) & HF_STATE_FIELDS:
        raise DamagedCheckpoint(f"checkpoint file {path} does not hold the engine's own state fields")
    return {**{k: v for k, v in hf.items() if k in HF_STATE_FIELDS}, **untag(own)}


def _stamp(path: Path) -> tuple[int, int, int, int]:
    info = os.stat(path, follow_symlinks=False)
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _link(segment: _Segment, target: Path) -> bool:
    """Hard-link a published segment to ``target`` if it is still the file written then, unchanged.

    Two system calls per segment (link, stat), no read: a segment altered since was written to
    (its mtime moved) or replaced (another inode), and is written afresh instead.
    """
    try:
        os.link(segment.path, target, follow_symlinks=False)
    except OSError:  # gone (rotated away), no hard links here, another file system
        return False
    if _stamp(target) != segment.stamp:
        target.unlink()
        return False
    return True


def _encode_segment(records: list[dict[str, Any]]) -> str:
    try:
        body = json.dumps(records, sort_keys=True, allow_nan=False, separators=(",", ":"))
    except ValueError:  # a non-finite float: tagged as State.to_json tags it
        body = json.dumps(_tag(records), sort_keys=True, allow_nan=False, separators=(",", ":"))
    return f'{{"format":"{FORMAT}","records":{body}}}'


def _tag(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")}
    if isinstance(value, dict):
        return {str(k): _tag(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_tag(v) for v in value]
    return value


def untag(value: Any) -> Any:
    """The non-finite floats ``_tag`` (and State.to_json) wrote as ``{\"__float__\": ...}``, back."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _NONFINITE:
            return _NONFINITE[value["__float__"]]
        return {k: untag(v) for k, v in value.items()}
    if isinstance(value, list):
        return [untag(v) for v in value]
    return value


def read_log_history(files: verified.CheckedFiles, manifest: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The records a checkpoint keeps in segments (none for a short run), oldest first, each file checked.

    A segment file that is damaged (altered, truncated, missing, unparsable) costs its own records,
    with a warning, never the checkpoint: the full segments are hard links shared by every checkpoint
    of the run, so one flipped bit would otherwise make all of them unresumable, for a log. What the
    manifest says (the list, each name plain and listed) is the checkpoint's, and damage there is its.
    """
    names = manifest.get(MANIFEST_KEY, [])
    if not isinstance(names, list):
        raise DamagedCheckpoint(f"{files.manifest_path}: {MANIFEST_KEY} must be a list, got {names!r}")
    for name in names:
        if plain_name(name, files.manifest_path) not in files.files:
            raise DamagedCheckpoint(f"{files.manifest_path} lists the log history segment {name} among no files")
    records: list[dict[str, Any]] = []
    read = [0, 0, 0, 0]  # the bytes and the parse cost of the segments so far: bounded together
    for name in names:
        path = files.directory / name
        try:
            data = files.read_bytes(name)
        except Exception as exc:  # missing, altered: this segment's records only
            _lost(path, damaged(path, exc))
            continue
        read = [a + b for a, b in zip(read, (len(data), *parse_cost(data)), strict=True)]
        # the checkpoint's: a flipped bit does not make many files of empty objects (safety.check_parse_cost)
        check_parse_cost((read[1], read[2], read[3]), read[0], f"the log history of {files.directory}")
        try:
            records.extend(_parse_segment(data, path))
        except DamagedCheckpoint as exc:
            _lost(path, exc)
    return records


def _parse_segment(data: bytes, path: Path) -> list[dict[str, Any]]:
    try:
        document = cio.parse_json(data, path)
    except Exception as exc:  # a file of the checkpoint made reading fail: damaged, whatever the error
        raise damaged(path, exc) from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise DamagedCheckpoint(f"checkpoint file {path} is not a {FORMAT} file")
    segment = document.get("records")
    if not isinstance(segment, list) or not all(isinstance(r, dict) for r in segment):
        raise DamagedCheckpoint(f"checkpoint file {path} does not hold a list of log records")
    return untag(segment) if b'"__float__"' in data else segment  # type: ignore[no-any-return]


def _lost(path: Path, exc: DamagedCheckpoint) -> None:
    message = (
        f"the log history segment {path} is damaged ({exc}): its {SEGMENT} log records are lost; the checkpoint "
        "resumes without them (a segment is shared by the run's checkpoints, so only the log pays)"
    )
    logger.warning(message)
    warnings.warn(message, stacklevel=4)
