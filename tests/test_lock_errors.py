"""Lock errors that say what to do (#29 item 9): when output_dir's lock cannot be taken for a reason other than
another run, the error is a ConfigError naming the path and the remedy, not a raw OSError, and nothing stays
locked. Read-only filesystems, missing permissions and filesystems without locks are simulated by making the
system call fail as the kernel would (the tests run as root, whom permissions do not stop).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from trainbus.engine import ConfigError, Engine
from trainbus.plugins.checkpoints import lock as lock_module
from trainbus.plugins.checkpoints.checkpoint import Checkpointing
from trainbus.plugins.checkpoints.lock import LOCK_FILE, OutputDirInUse, OutputDirLock


def engine(out: Path) -> Engine:
    model = torch.nn.Linear(2, 1)
    return Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), max_steps=2,
                  train_data=[(torch.ones(2, 2), torch.ones(2, 1))] * 2, loss_fn=torch.nn.MSELoss(),
                  plugins=[Checkpointing(out, save_strategy="steps", save_steps=1)])  # fmt: skip


def fit_error(out: Path) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        engine(out).fit()
    assert not isinstance(caught.value, OutputDirInUse) and not OutputDirLock._held
    return caught.value


def failing(monkeypatch: pytest.MonkeyPatch, target: Any, name: str, code: int) -> None:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(target, name, fail)


def test_a_lock_file_that_is_a_symlink_is_refused_naming_it_and_its_target(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("precious")
    (tmp_path / LOCK_FILE).symlink_to(target)
    error = str(fit_error(tmp_path))
    assert f"{tmp_path / LOCK_FILE} is a symbolic link to {str(target)!r}" in error
    assert f"rm {tmp_path / LOCK_FILE}" in error
    assert target.read_text() == "precious"  # never followed, never written


def test_a_lock_file_that_is_a_dangling_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).symlink_to(tmp_path / "nowhere")
    assert "is a symbolic link" in str(fit_error(tmp_path))
    assert not (tmp_path / "nowhere").exists()


def test_a_lock_file_that_is_a_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).mkdir()
    error = str(fit_error(tmp_path))
    assert f"{tmp_path / LOCK_FILE} is a directory" in error and f"rm -r {tmp_path / LOCK_FILE}" in error


def test_a_lock_file_that_is_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / LOCK_FILE)
    assert f"{tmp_path / LOCK_FILE} is a FIFO (named pipe)" in str(fit_error(tmp_path))


def test_a_lock_file_hard_linked_to_another_file_is_refused_and_the_file_kept(tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    os.link(precious, tmp_path / LOCK_FILE)
    assert f"{tmp_path / LOCK_FILE} has 2 names (hard links)" in str(fit_error(tmp_path))
    assert precious.read_text() == "keep me"


def test_a_read_only_filesystem_is_named_with_the_remedy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failing(monkeypatch, lock_module.os, "open", errno.EROFS)
    error = str(fit_error(tmp_path))
    assert f"output_dir {tmp_path} is on a read-only filesystem" in error and "writable directory" in error


def test_creating_output_dir_on_a_read_only_filesystem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Path, "mkdir", lambda self, *a, **k: (_ for _ in ()).throw(OSError(errno.EROFS, "Read-only")))
    with pytest.raises(ConfigError, match=rf"output_dir {tmp_path / 'new'} is on a read-only filesystem"):
        OutputDirLock.acquire(tmp_path / "new")


def test_no_permission_names_the_path_and_the_remedy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failing(monkeypatch, lock_module.os, "open", errno.EACCES)
    error = str(fit_error(tmp_path))
    assert f"no permission to create or open {tmp_path / LOCK_FILE}" in error
    assert f"Make {tmp_path} writable for this user" in error


def test_a_filesystem_without_locks_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failing(monkeypatch, lock_module.fcntl, "flock", errno.ENOLCK)
    error = str(fit_error(tmp_path))
    assert f"the filesystem of output_dir {tmp_path} does not support file locks" in error
    assert "a filesystem with locks" in error


def test_a_full_disk_writing_the_holder_record_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failing(monkeypatch, lock_module.os, "ftruncate", errno.ENOSPC)
    assert f"no space left on the device of output_dir {tmp_path}" in str(fit_error(tmp_path))
    monkeypatch.undo()
    OutputDirLock.acquire(tmp_path).release()  # nothing was left locked


def test_the_run_goes_on_once_the_remedy_is_applied(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE).mkdir()
    fit_error(tmp_path)
    (tmp_path / LOCK_FILE).rmdir()
    assert engine(tmp_path).fit().global_step == 2


def test_naming_the_holder_reads_no_link_and_no_more_than_its_record(tmp_path: Path) -> None:
    lock = OutputDirLock.acquire(tmp_path)
    try:
        assert OutputDirLock(tmp_path).holder()["pid"] == os.getpid()
        (tmp_path / LOCK_FILE).write_bytes(b" " * 10_000_000 + b"{}")  # a record no holder writes: not read whole
        assert OutputDirLock(tmp_path).holder() == {}
        moved = tmp_path / "moved"
        os.replace(tmp_path / LOCK_FILE, moved)
        (tmp_path / LOCK_FILE).symlink_to("/dev/zero")  # swapped in after the lock was taken
        assert OutputDirLock(tmp_path).holder() == {}
        os.unlink(tmp_path / LOCK_FILE)
        os.replace(moved, tmp_path / LOCK_FILE)
    finally:
        lock.release()
