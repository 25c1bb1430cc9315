"""The files of the JSON lines and CSV sinks: their lines, each record's run, and moving a file aside whole.

A sink never deletes another run's records (``sinks.py``): a file holding them is renamed beside itself,
``<stem>.<time><suffix>`` (its last write, UTC), with a hard link and an unlink where the filesystem has
links, so an existing file of that name is never replaced and a record appended meanwhile by another
process lands in the file set aside, not in nowhere.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

__all__ = ["RUN_ID", "json_run_id", "lines_of", "replace_file", "set_aside_beside"]

#: the key of the run's id in every record a file sink writes (``checkpoints/identity.py``)
RUN_ID = "run_id"


def lines_of(path: Path) -> list[bytes]:
    """The file's lines (a last line without its newline gets one: a record torn by a crash stays a line)."""
    with path.open("rb") as f:
        lines = f.readlines()
    if lines and not lines[-1].endswith(b"\n"):
        lines[-1] += b"\n"
    return lines


def json_run_id(line: bytes) -> str | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    found = record.get(RUN_ID) if isinstance(record, dict) else None
    return found if isinstance(found, str) else None


def set_aside_beside(path: Path) -> Path | None:
    """Rename ``path`` to ``<stem>.<time><suffix>`` beside it (its last write, UTC; ``-2``, ... when taken); None when
    ``path`` is gone (another process set it aside first)."""
    try:
        stamp = datetime.datetime.fromtimestamp(path.stat().st_mtime, datetime.UTC).strftime("%Y-%m-%dT%H-%M-%SZ")
        for n in range(1, 10_000):
            target = path.with_name(f"{path.stem}.{stamp}{'' if n == 1 else f'-{n}'}{path.suffix}")
            try:
                os.link(path, target)  # never over an existing file: a set-aside file is never replaced
            except FileExistsError:
                continue
            except FileNotFoundError:
                raise
            except OSError:  # no hard links here: a rename that checks first
                if target.exists():
                    continue
                os.replace(path, target)
                return target
            path.unlink()
            return target
    except FileNotFoundError:
        return None
    raise FileExistsError(f"no free name to set {path} aside")


def replace_file(path: Path, content: bytes) -> None:
    """Write ``content`` to ``path`` through a temporary file and an atomic rename."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        f.write(content)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
