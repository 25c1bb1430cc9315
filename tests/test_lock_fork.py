"""The output_dir lock is the main process's alone (#29 item 1): forked children (DataLoader workers) never
hold it, so a SIGKILLed run frees its output_dir at once, however long its workers live; and a lock whose
acquisition fails (a full disk writing the holder record) is released, not kept until the process exits.

The subprocess test runs this file as a script (``python tests/test_lock_fork.py OUT``): a bare Engine with
Checkpointing and a DataLoader of 2 forked workers, stepping slowly until the parent SIGKILLs it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainbus.engine import ConfigError
from trainbus.plugins.checkpoints import lock as lock_module
from trainbus.plugins.checkpoints.lock import LOCK_FILE, OutputDirInUse, OutputDirLock

ROOT = Path(__file__).resolve().parent.parent


def free(output_dir: Path) -> bool:
    """Whether nobody holds ``output_dir``'s lock (probed with a new open file description, as another run would)."""
    path = output_dir / LOCK_FILE
    if not path.exists():
        return True
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing our descriptor drops our probe's lock
    return True


def _slow_run(out: Path) -> None:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from trainbus.engine import Engine, Event
    from trainbus.plugins.checkpoints.checkpoint import Checkpointing

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 2), torch.randn(64, 1)), batch_size=2, num_workers=2)
    model = torch.nn.Linear(2, 1)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), max_steps=1000, train_data=data,
                    loss_fn=torch.nn.MSELoss(), plugins=[Checkpointing(out)])  # fmt: skip

    def pace(ev: object) -> None:
        (out / "progress").write_text("stepping")
        time.sleep(0.05)

    engine.on(Event.STEP_END, pace)
    engine.fit()


def test_a_killed_run_frees_its_output_dir_at_once_though_its_dataloader_workers_live(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen([sys.executable, __file__, str(tmp_path)], cwd=ROOT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "progress").exists():
            assert run.poll() is None and time.monotonic() < deadline, "the run did not start stepping"
            time.sleep(0.05)
        workers = [pid for pid in _children(run.pid)]
        assert len(workers) >= 2, workers  # the DataLoader's forked workers
        assert not free(tmp_path)
        run.send_signal(signal.SIGKILL)
        run.wait(timeout=30)
        assert any(_alive(pid) for pid in workers)  # the orphaned workers still live (they notice within 5 s)
        assert free(tmp_path)  # ... yet the lock went with the main process
        lock = OutputDirLock.acquire(tmp_path)  # a restarted job takes it at once
        lock.release()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)  # the orphaned workers too (the run leads its own session)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_forked_child_does_not_hold_the_lock_its_parent_took(tmp_path: Path) -> None:
    lock = OutputDirLock.acquire(tmp_path)
    read, write = os.pipe()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: holds nothing, believes it holds nothing; waits until told to go
        os.close(write)
        held = bool(OutputDirLock._held)
        os.write(ready_write, b"r")  # running: its fork hooks have run
        os.read(read, 1)
        os._exit(3 if held else 0)
    os.close(read)
    os.close(ready_write)
    assert os.read(ready_read, 1) == b"r"
    os.close(ready_read)
    try:
        assert lock.fd is not None and not free(tmp_path)
        os.close(lock.fd)  # the parent's descriptor gone, as when it dies: the lock file stays
        lock.fd = None
        OutputDirLock._held.clear()
        assert free(tmp_path)  # the child still lives, and does not keep the lock
    finally:
        os.write(write, b"x")
        os.close(write)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0  # the child's table of held locks was empty


def test_a_failed_acquisition_releases_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lock_module.os, "pwrite", full_disk)
    with pytest.raises(ConfigError, match=r"no space left") as caught:
        OutputDirLock.acquire(tmp_path)
    assert str(tmp_path / LOCK_FILE) in str(caught.value) and not isinstance(caught.value, OutputDirInUse)
    assert free(tmp_path) and not OutputDirLock._held
    monkeypatch.undo()
    OutputDirLock.acquire(tmp_path).release()  # the same process takes it fine afterwards


if __name__ == "__main__":
    _slow_run(Path(sys.argv[1]))
