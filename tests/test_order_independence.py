"""tests/conftest.py puts back what a test changes (#27 item 8): a test that changes every piece of process state it
restores, and one that expects none of it, pass in either order under it, and fail without it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

CONFTEST = Path(__file__).with_name("conftest.py")

#: the first test changes what a test or the code under test may change; the second expects the state
#: every test starts from (and draws the random numbers the first one drew)
PAIR = textwrap.dedent(
    """
    import logging, os, random, signal, sys
    import numpy as np
    import torch

    DRAWS = []

    def draws():
        return (torch.rand(3).tolist(), random.random(), float(np.random.rand()))

    def test_a_changes_everything():
        DRAWS.append(draws())
        logging.getLogger("trainbus").setLevel(logging.ERROR)  # as Trainer(log_level="error")
        logging.getLogger("trainbus.plugins.new").setLevel(logging.ERROR)
        logging.getLogger("transformers").setLevel(logging.ERROR)
        logging.root.addHandler(logging.NullHandler())
        torch.use_deterministic_algorithms(True)  # as full_determinism=True
        torch.set_default_dtype(torch.float64)
        torch.set_num_threads(2)
        torch.set_grad_enabled(False)
        os.environ["TRAINBUS_ORDER_TEST"] = "1"
        os.chdir("/")
        sys.path.insert(0, "/nonexistent")
        signal.signal(signal.SIGTERM, lambda *a: None)

    def test_b_expects_none_of_it():
        DRAWS.append(draws())
        assert len(DRAWS) < 2 or DRAWS[0] == DRAWS[1]  # every test starts from the same random state
        assert logging.getLogger("trainbus").level == logging.NOTSET
        assert logging.getLogger("trainbus.plugins.new").level == logging.NOTSET
        assert logging.getLogger("transformers").level == logging.NOTSET
        assert not any(type(h) is logging.NullHandler for h in logging.root.handlers)
        assert not torch.are_deterministic_algorithms_enabled()
        assert torch.get_default_dtype() is torch.float32 and torch.get_num_threads() == 1
        assert torch.is_grad_enabled()
        assert "TRAINBUS_ORDER_TEST" not in os.environ and os.getcwd() != "/"
        assert "/nonexistent" not in sys.path
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    """
)


def run(directory: Path, *options: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *options],
        cwd=directory, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )  # fmt: skip


def test_a_test_that_changes_process_state_does_not_reach_the_next_in_either_order(tmp_path: Path) -> None:
    (tmp_path / "test_pair.py").write_text(PAIR)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # this folder is the rootdir: not the project's settings
    (tmp_path / "conftest.py").write_text("import logging\nlogging.getLogger('transformers')\n")
    unguarded = run(tmp_path)
    assert "1 failed, 1 passed" in unguarded.stdout, unguarded.stdout  # the pair does detect a leak
    (tmp_path / "conftest.py").write_text(CONFTEST.read_text() + "\nlogging.getLogger('transformers')\n")
    guarded = run(tmp_path)
    assert "2 passed" in guarded.stdout, (guarded.stdout, guarded.stderr)
    reverse = run(tmp_path, "--order=reverse", "-vv")
    assert "2 passed" in reverse.stdout, (reverse.stdout, reverse.stderr)
    assert reverse.stdout.index("test_b_expects") < reverse.stdout.index("test_a_changes")  # the option works
