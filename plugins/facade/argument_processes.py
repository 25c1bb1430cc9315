"""The process side of TrainingArguments: accelerate's PartialState, ranks, device, ``parallel_mode`` and
``main_process_first``, as transformers' TrainingArguments offers them.

A mixin, not fields: ``HfArgumentParser`` makes a command-line option of every dataclass field, and
these are derived from the launch (``WORLD_SIZE``), not chosen by the user.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
from collections.abc import Iterator
from typing import Any

from ..distributed.attempt_group import init_attempt_group
from .argument_checks import LOG_LEVELS

logger = logging.getLogger("trainbus")


class ParallelMode(str, enum.Enum):
    """transformers' ``ParallelMode`` values; members compare equal to their strings.

    trainbus runs one device per process, so only ``NOT_PARALLEL`` (one process) and ``DISTRIBUTED``
    (several processes) occur; HF scripts test ``parallel_mode.value == "distributed"``.
    """

    NOT_PARALLEL = "not_parallel"
    NOT_DISTRIBUTED = "not_distributed"
    DISTRIBUTED = "distributed"
    SAGEMAKER_MODEL_PARALLEL = "sagemaker_model_parallel"
    SAGEMAKER_DATA_PARALLEL = "sagemaker_data_parallel"
    TPU = "tpu"


class ProcessArguments:
    """Read-only process facts of a TrainingArguments (the fields below are the dataclass's)."""

    use_cpu: bool
    ddp_backend: str | None
    ddp_timeout: int
    log_level: str
    log_level_replica: str
    log_on_each_node: bool

    def _process_state(self) -> Any:
        """accelerate's ``PartialState`` when launched on several processes (torchrun / accelerate launch), else None.

        Made once, with ``ddp_backend`` and ``ddp_timeout``: it initialises the process group.
        """
        if "_processes" not in self.__dict__:
            import datetime

            import torch

            launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
            if not launched and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                self.__dict__["_processes"] = None
            else:
                from accelerate import PartialState

                cpu = self.use_cpu or not torch.cuda.is_available()
                kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=self.ddp_timeout)}
                if self.ddp_backend is not None:
                    kwargs["backend"] = self.ddp_backend
                # a torchrun attempt makes its group on a store of its own: a restart reconnects
                init_attempt_group(self.ddp_backend, cpu=cpu, timeout=kwargs["timeout"])
                self.__dict__["_processes"] = PartialState(cpu=cpu, **kwargs)
        return self.__dict__["_processes"]

    @property
    def world_size(self) -> int:
        state = self._process_state()
        return 1 if state is None else int(state.num_processes)

    @property
    def process_index(self) -> int:
        state = self._process_state()
        return 0 if state is None else int(state.process_index)

    @property
    def local_process_index(self) -> int:
        state = self._process_state()
        return 0 if state is None else int(state.local_process_index)

    @property
    def n_gpu(self) -> int:
        return 0 if self.use_cpu else int(__import__("torch").cuda.device_count() > 0)

    @property
    def parallel_mode(self) -> ParallelMode:
        """HF's ``parallel_mode``: ``DISTRIBUTED`` under several processes, else ``NOT_PARALLEL`` (one CPU or GPU;
        trainbus never uses ``nn.DataParallel``, so ``NOT_DISTRIBUTED`` does not occur)."""
        return ParallelMode.DISTRIBUTED if self.world_size > 1 else ParallelMode.NOT_PARALLEL

    @property
    def should_save(self) -> bool:
        """Whether this process writes checkpoints and models: the main process only (HF)."""
        return self.process_index == 0

    def get_process_log_level(self) -> int:
        """The ``logging`` level of this process (HF): ``log_level`` where ``should_log``, else ``log_level_replica``;
        "passive" keeps the level the ``trainbus`` logger has."""
        level = self.log_level if self.should_log else self.log_level_replica
        chosen = LOG_LEVELS[level]
        return logging.getLogger("trainbus").getEffectiveLevel() if chosen is None else chosen

    def apply_log_level(self) -> None:
        """HF's ``train()`` sets the process's level on transformers' loggers (``log_level`` not "passive"):
        trainbus's logger takes it, and transformers' too, where trainbus writes transformers' messages."""
        level = self.log_level if self.should_log else self.log_level_replica
        logging.getLogger("trainbus").setLevel(self.get_process_log_level())
        if LOG_LEVELS[level] is not None:
            logging.getLogger("transformers").setLevel(LOG_LEVELS[level])

    @property
    def should_log(self) -> bool:
        """Whether this process logs: the main process, or each node's with log_on_each_node (HF)."""
        return (self.local_process_index if self.log_on_each_node else self.process_index) == 0

    @property
    def device(self) -> Any:
        import torch

        if not torch.cuda.is_available() or self.use_cpu:
            return torch.device("cpu")
        state = self._process_state()
        return torch.device("cuda") if state is None else torch.device(state.device)  # this rank's GPU

    @contextlib.contextmanager
    def main_process_first(self, local: bool = True, desc: str = "work") -> Iterator[None]:
        """Run the body on the main process first while the others wait at a barrier, then run it on the others.

        As transformers' ``main_process_first``: for ``datasets.map`` and downloads, which the main
        process does once and caches, so the replicas load the cache. ``local=True`` means the first
        process of each node (no shared file system), ``local=False`` the first process of all. In one
        process it just runs the body. The main process releases the others also when its body raises
        (HF does the same), so they are not left waiting; they then run the body themselves.
        """
        if self.world_size <= 1:
            yield
            return
        import torch.distributed as dist

        state = self._process_state()
        is_main = bool(state.is_local_main_process if local else state.is_main_process)
        who = "main local process" if local else "main process"
        try:
            if not is_main:
                logger.debug("%d: waiting for the %s to perform %s", self.process_index, who, desc)
                dist.barrier()
            yield
        finally:
            if is_main:
                logger.debug("%d: %s completed %s, releasing all replicas", self.process_index, who, desc)
                dist.barrier()
