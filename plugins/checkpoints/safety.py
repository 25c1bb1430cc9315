"""What a checkpoint may make trainbus read: plain names inside its directory, bounded JSON, no links.

A checkpoint directory is data from disk, and disks (and people) damage data. Whatever a checkpoint
holds, reading it must not reach outside its directory, follow a link, wait on a device, or run out
of memory or stack. So:

- every name a manifest or an index lists is a plain file name (``plain_name``): no separator, no
  ``..``, no absolute path, no NUL; the files are opened with ``O_NOFOLLOW`` (``io.open_regular``) and
  must be regular files (not ``/dev/zero``, not a FIFO); a checkpoint directory that is a symlink is
  refused (``real_directory``);
- JSON is bounded before it is parsed (``MAX_MANIFEST_BYTES`` for a manifest or an index,
  ``MAX_JSON_BYTES`` for the rest), in the memory its parse would take (``parse_cost``: objects,
  lists and values counted in its bytes, at most ``PARSE_RATIO`` times its size) and its nesting
  after (``MAX_DEPTH``); the parser's own errors
  (a 5,000-digit integer, a nesting deeper than the interpreter's stack) are damage, like a syntax
  error;
- any exception while reading a checkpoint means the checkpoint is damaged (``DamagedCheckpoint``,
  a ConfigError naming the file): ``resume_from_checkpoint=True`` skips it and falls back to the one
  before, an explicit path fails with that error.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from trainbus.engine import ConfigError

#: a manifest or a tensor index lists files and slices: a few KB, a sharded model's a few MB
MAX_MANIFEST_BYTES = 16 << 20
#: any other JSON file of a checkpoint (an optimizer's param groups, plugin states, the trainer state)
MAX_JSON_BYTES = 512 << 20
#: nesting of any JSON value a checkpoint holds (a state's is under 10 levels)
MAX_DEPTH = 64
#: safetensors' own bound on its JSON header
MAX_SAFETENSORS_HEADER = 100_000_000
#: what parsing a JSON file may take, estimated from its bytes before it is parsed (``parse_cost``):
#: PARSE_RATIO times its size, at least PARSE_FLOOR, never more than PARSE_MAX. Real files take 4-12
#: times their size (a log record of 5 numbers: 3.8); empty objects 24 (estimated 52), so a 64 MB
#: trainer_state.json of them (3.7 GB parsed) is refused, as is anything over 1.2 MB of them.
PARSE_RATIO = 32
PARSE_FLOOR = 64 << 20
PARSE_MAX = 1 << 30
#: bytes estimated per object or list (a dict of a few keys is 184 in CPython, a list 56 + 8 per item)
#: and per separator (a value: a float 24, a pointer 8); the upper bound of what json.loads builds
CONTAINER_COST = 120
VALUE_COST = 32

__all__ = [
    "MAX_DEPTH",
    "MAX_JSON_BYTES",
    "MAX_MANIFEST_BYTES",
    "PARSE_FLOOR",
    "PARSE_MAX",
    "PARSE_RATIO",
    "DamagedCheckpoint",
    "check_depth",
    "check_parse_cost",
    "check_safetensors_header",
    "damaged",
    "parse_bounded_json",
    "parse_cost",
    "plain_name",
    "real_directory",
]


class DamagedCheckpoint(ConfigError):
    """A checkpoint that cannot be read as written: a file missing, altered, out of bounds or unparsable.

    Distinct from a ConfigError saying a sound checkpoint does not fit this run (another optimizer,
    another number of processes): a resume falls back past damage, not past a mismatch.
    """


def damaged(where: Path | str, exc: BaseException) -> DamagedCheckpoint:
    """``exc`` raised while reading ``where``, as the DamagedCheckpoint that names it (kept when it is one)."""
    if isinstance(exc, DamagedCheckpoint):
        return exc
    if isinstance(exc, ConfigError):
        return DamagedCheckpoint(str(exc))
    return DamagedCheckpoint(f"checkpoint file {where} cannot be read: {type(exc).__name__}: {exc}")


def plain_name(name: Any, listed_in: Path) -> str:
    """``name`` if it is a plain file name inside the checkpoint directory, else DamagedCheckpoint.

    Refused: anything but a non-empty str, ``.``, ``..``, a separator (``/`` or ``\\``), NUL.
    """
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
        or len(name) > 255
    ):
        raise DamagedCheckpoint(f"{listed_in} lists {name!r}, which is not a plain file name inside its directory")
    return name


def real_directory(directory: Path) -> None:
    """Refuse a checkpoint directory that is a symlink (or no directory): its files could be anywhere."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError as exc:
        raise DamagedCheckpoint(f"checkpoint directory {directory} does not exist") from exc
    except OSError as exc:
        raise DamagedCheckpoint(f"checkpoint directory {directory} cannot be read: {exc}") from exc
    if stat.S_ISLNK(info.st_mode):
        raise DamagedCheckpoint(f"checkpoint directory {directory} is a symlink; trainbus reads no linked checkpoint")
    if not stat.S_ISDIR(info.st_mode):
        raise DamagedCheckpoint(f"checkpoint {directory} is not a directory")


def parse_bounded_json(data: bytes, path: Path, *, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse JSON read from ``path``: bounded in size before and in depth after; any failure is damage."""
    if len(data) > limit:
        raise DamagedCheckpoint(f"checkpoint file {path} has {len(data)} bytes, more than the {limit} a JSON file may")
    check_parse_cost(parse_cost(data), len(data), f"checkpoint file {path}")
    try:
        value = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError, MemoryError) as exc:  # JSONDecodeError is a ValueError
        raise DamagedCheckpoint(f"checkpoint file {path} is not valid JSON: {type(exc).__name__}: {exc}") from exc
    if data.count(b"[") + data.count(b"{") > MAX_DEPTH:  # fewer containers cannot nest that deep
        check_depth(value, path)
    return value


def parse_cost(data: bytes) -> tuple[int, int, int]:
    """(estimated bytes ``json.loads(data)`` takes, objects and lists, values): counted, not parsed.

    Every ``{`` or ``[`` is counted as a container and every ``,`` or ``:`` as a value, also those
    inside strings: an over-estimate, never an under-estimate of the count.
    """
    containers = data.count(b"{") + data.count(b"[")
    values = data.count(b",") + data.count(b":") + 1
    return len(data) + CONTAINER_COST * containers + VALUE_COST * values, containers, values


def allowed_parse(size: int) -> int:
    """The most a JSON file of ``size`` bytes may take to parse (or files of ``size`` bytes in all)."""
    return min(PARSE_MAX, max(PARSE_FLOOR, PARSE_RATIO * size))


def check_parse_cost(cost: tuple[int, int, int], size: int, what: str, allowed: int | None = None) -> None:
    """Refuse to parse ``what`` (``size`` bytes) when ``cost`` (``parse_cost``) is over what it may take."""
    allowed = allowed_parse(size) if allowed is None else allowed
    if cost[0] > allowed:
        raise DamagedCheckpoint(
            f"{what} would take about {cost[0] >> 20} MiB to parse ({cost[1]} objects and lists, {cost[2]} values "
            f"in {size} bytes), more than the {allowed >> 20} MiB that JSON of its size may: refused before parsing"
        )


def check_depth(value: Any, path: Path, limit: int = MAX_DEPTH) -> None:
    """Refuse a JSON value nested deeper than ``limit`` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise DamagedCheckpoint(f"checkpoint file {path} nests deeper than {limit} levels")
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values() if isinstance(child, dict | list))
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item if isinstance(child, dict | list))


def check_safetensors_header(fd: int, size: int, path: Path) -> None:
    """The safetensors header length (the first 8 bytes) must fit the file and safetensors' own bound."""
    if size < 8:
        raise DamagedCheckpoint(f"checkpoint file {path} is not a valid safetensors file: it has {size} bytes")
    length = int.from_bytes(os.pread(fd, 8, 0), "little")
    if length > min(MAX_SAFETENSORS_HEADER, size - 8):
        raise DamagedCheckpoint(
            f"checkpoint file {path} is not a valid safetensors file: its header says {length} bytes, "
            f"in a {size}-byte file"
        )
