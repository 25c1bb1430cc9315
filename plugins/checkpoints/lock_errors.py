"""What to say when the output_dir's lock cannot be taken for a reason other than another run holding it.

A raw ``OSError`` at the start of training says what failed but not what to do. Each case here names
the path and the remedy: a read-only filesystem, no permission, a lock file that is a link, a
directory or a FIFO (trainbus opens it without following links and refuses anything but a regular
file), a filesystem without locks (NFS without its lock service, some FUSE mounts), a full disk.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from trainbus.engine import ConfigError

__all__ = ["NO_LOCKS", "check_regular", "unusable"]

#: what flock raises on a filesystem that has no locks
NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EINVAL})

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def _kind(path: Path) -> str | None:
    """What ``path`` is when it is not a regular file (None for a regular file or nothing)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def not_a_lock_file(path: Path, kind: str) -> ConfigError:
    link = ""
    if kind == "a symbolic link":
        link = f" to {os.readlink(path)!r}, which trainbus never follows (the lock file is written to)"
    return ConfigError(
        f"{path} is {kind}{link}, not trainbus's lock file (a regular file it creates in output_dir). "
        f"Remove it (rm {'-r ' if kind == 'a directory' else ''}{path}) and start the run again, or give output_dir "
        "another directory"
    )


def check_regular(fd: int, path: Path) -> None:
    """Refuse an opened lock file that is not a regular file (a FIFO opens without blocking, then fails later),
    or one with other names (a hard link: the holder record would overwrite another file's contents)."""
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode):
        raise not_a_lock_file(path, _KINDS.get(stat.S_IFMT(found.st_mode), "not a regular file"))
    if found.st_nlink > 1:
        raise ConfigError(
            f"{path} has {found.st_nlink} names (hard links): it may be another file, which writing the lock's holder "
            f"record would overwrite. Remove this name (rm {path}; the other names keep the file) and start the run "
            "again, or give output_dir another directory"
        )


def unusable(path: Path, exc: OSError, *, creating: bool = False, writing: bool = False) -> ConfigError:
    """A ConfigError for ``exc``, raised taking the lock at ``path`` (the lock file, or output_dir being created)."""
    directory = path if creating else path.parent
    code = exc.errno
    reason = f"{type(exc).__name__}: {exc.strerror or exc}"
    if code == errno.EROFS:
        return ConfigError(
            f"output_dir {directory} is on a read-only filesystem ({reason}): a run cannot write its lock or its "
            "checkpoints there. Give output_dir a writable directory"
        )
    if code in (errno.EACCES, errno.EPERM):
        what = "create the directory" if creating else ("write" if writing else "create or open")
        return ConfigError(
            f"no permission to {what} {path} ({reason}, as user id {os.getuid()}): a run writes its lock and its "
            f"checkpoints in output_dir. Make {directory} writable for this user (chmod / chown), or give "
            "output_dir a directory this user can write"
        )
    kind = _kind(path) if code in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.ENOTDIR) else None
    if kind is not None:
        return not_a_lock_file(path, kind)
    if code in (errno.ENOSPC, errno.EDQUOT):
        return ConfigError(
            f"no space left on the device of output_dir {directory} ({reason}, writing {path}): a run there could not "
            "write its checkpoints either. Free space (or raise the quota), or give output_dir another filesystem"
        )
    if code in NO_LOCKS and not creating:
        return ConfigError(
            f"the filesystem of output_dir {directory} does not support file locks ({reason}, locking {path}): "
            "trainbus locks output_dir so that two runs never write into it at once. Give output_dir a directory on "
            "a filesystem with locks (a local disk, or NFS with its lock service running)"
        )
    return ConfigError(
        f"cannot take the lock {path} of output_dir {directory} ({reason}). Check that output_dir is a writable "
        "directory on a local filesystem, or give output_dir another directory"
    )
