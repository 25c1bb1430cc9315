"""Shared test setup: a derandomized, bounded hypothesis profile for CI, and tests that restore what they change.

The suite passes in any order, in one process (#27 item 8). Every test starts from the same random
state (``pytest_runtest_setup``) and, after it, the process-wide state a test or the code under
test may change is put back (``_restore_process_state``): logger levels, handlers and switches (a
Trainer sets the ``trainbus`` logger's level from ``log_level``; transformers' and optuna's
``set_verbosity``), torch's global switches (``use_deterministic_algorithms`` under
``full_determinism``, the default dtype, threads, grad mode, anomaly detection, matmul precision),
environment variables, the working directory, ``sys.path`` and the SIGINT / SIGTERM handlers.

Order options, to check that: ``pytest tests --order=reverse`` runs the collected tests last to
first; ``--order=shuffle --order-seed=N`` in a seeded random order.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=40,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)  # tests run in parallel workers on 2 cores

# the random state every test starts from: torch's default seed, fixed seeds for the others (which
# would otherwise be seeded from the OS, a different stream in every process)
random.seed(0)
np.random.seed(0)
_RNG = (torch.get_rng_state(), random.getstate(), np.random.get_state())
_SIGNALS = (signal.SIGINT, signal.SIGTERM)
logging.getLogger("trainbus")  # exists from the start, so that every test's level for it is put back


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("trainbus order")
    group.addoption("--order", choices=("given", "reverse", "shuffle"), default="given",
                    help="run the collected tests as given, last to first, or shuffled (--order-seed)")  # fmt: skip
    group.addoption("--order-seed", type=int, default=0, help="the seed of --order=shuffle")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    order = config.getoption("--order")
    if order == "reverse":
        items.reverse()
    elif order == "shuffle":
        random.Random(config.getoption("--order-seed")).shuffle(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before any fixture of the test: the random state every test starts from, whatever ran before it."""
    torch.set_rng_state(_RNG[0])
    random.setstate(_RNG[1])
    np.random.set_state(_RNG[2])


def _loggers() -> dict[str, logging.Logger]:
    found = {
        name: logger for name, logger in logging.root.manager.loggerDict.items() if isinstance(logger, logging.Logger)
    }
    return {"": logging.root, **found}


def _logging_state() -> dict[str, tuple[Any, ...]]:
    return {name: (logger.level, logger.disabled, logger.propagate, list(logger.handlers), list(logger.filters))
            for name, logger in _loggers().items()}  # fmt: skip


def _restore_logging(saved: dict[str, tuple[Any, ...]], disabled: int) -> None:
    for name, logger in _loggers().items():
        if name not in saved:
            if name.startswith("trainbus."):  # trainbus configures none of its loggers: back as created
                logger.setLevel(logging.NOTSET)
                logger.disabled, logger.propagate, logger.handlers[:], logger.filters[:] = False, True, [], []
            continue  # another library's, created as the test imported it: its own setup, kept
        level, off, propagate, handlers, filters = saved[name]
        logger.setLevel(level)
        logger.disabled, logger.propagate, logger.filters[:] = off, propagate, filters
        if name:
            logger.handlers[:] = handlers
        else:  # the root's: pytest's capture handlers come and go per phase; only what the test added goes
            for handler in [h for h in logger.handlers if h not in handlers and "_pytest" not in type(h).__module__]:
                logger.removeHandler(handler)
    logging.disable(disabled)


def _torch_state() -> dict[str, Any]:
    return {
        "deterministic": (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        "dtype": torch.get_default_dtype(),
        "threads": torch.get_num_threads(),
        "grad": torch.is_grad_enabled(),
        "anomaly": (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
        "matmul": torch.get_float32_matmul_precision(),
    }


def _restore_torch(saved: dict[str, Any]) -> None:
    if _torch_state() == saved:
        return
    mode, warn_only = saved["deterministic"]
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)
    torch.set_default_dtype(saved["dtype"])
    torch.set_num_threads(saved["threads"])
    torch.set_grad_enabled(saved["grad"])
    torch.autograd.set_detect_anomaly(*saved["anomaly"])
    torch.set_float32_matmul_precision(saved["matmul"])


@pytest.fixture(autouse=True)
def _restore_process_state() -> Iterator[None]:
    """Put back after each test the process-wide state it (or the code it runs) changed."""
    logs, disabled = _logging_state(), logging.root.manager.disable
    flags, environ, cwd, path = _torch_state(), dict(os.environ), os.getcwd(), list(sys.path)
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS}
    yield
    _restore_logging(logs, disabled)
    _restore_torch(flags)
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    if os.getcwd() != cwd:
        os.chdir(cwd)
    sys.path[:] = path
    for sig, handler in handlers.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)
