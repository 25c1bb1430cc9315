"""``Distributed``: data-parallel training for any Engine, on the processes accelerate set up.

Launch the script with ``torchrun --nproc_per_node N`` or ``accelerate launch``; in a plain
``python`` run there is one process and the plugin only sets the process flags. With N > 1:

- accelerate wraps the model in ``DistributedDataParallel`` (its ``prepare_model``, with the DDP
  options given here); ``engine.model`` stays the user's module, so checkpoints, evaluation and
  callbacks see plain weights, and only the training forward goes through the DDP wrapper;
- the micro-batches before the last of an accumulation window run inside ``no_sync()`` (one
  gradient all-reduce per optimizer step): ``GradientAccumulation`` owns that, on the module this
  plugin offers as ``trained_module()``;
- the train loader is replaced by this rank's share of each global batch, eval and test loaders
  by a ``DistributedSampler`` shard (``sharding.py``); the ranks agree on the train data (samples,
  per-device batch, drop_last when the loader is sharded; batches per epoch at every TRAIN_START),
  or every rank raises the same ConfigError naming each rank's value: unequal data would otherwise
  abort the job at the first collective (gloo: SIGABRT) or train unequal shares silently;
- ``state.is_world_process_zero`` / ``is_local_process_zero`` are set (again at every TRAIN_START,
  since a resume loads rank 0's saved State), so only the main process writes.

What the other features do across processes lives with them, on ``processes.py``: accumulation
normalises by the items of the window on all ranks (one all-reduce of the counts per window), the
logger averages the window's loss over ranks (one all-reduce per logging window), checkpoints are
written by rank 0 with every rank's RNG state, and evaluation gathers in data-set order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import check_positive_int

from .attempt_group import init_attempt_group
from .deepspeed import ZeroSteps
from .fsdp import local_grad_norm, shard_model
from .processes import close_group_at_exit, world_size
from .sharding import check_same_data, shard_eval_loader, shard_train_loader

if TYPE_CHECKING:
    from trainbus.engine import Engine
    from trainbus.engine.events import TrainStartEvent

#: DDP options trainbus passes to accelerate's DistributedDataParallelKwargs (HF's ddp_* arguments)
DDP_OPTIONS: dict[str, type | tuple[type, ...]] = {
    "find_unused_parameters": bool,
    "bucket_cap_mb": int,
    "broadcast_buffers": bool,
    "static_graph": bool,
}


class Distributed(Plugin):
    """Data-parallel training across the processes of a ``torchrun`` / ``accelerate launch`` job.

    Args:
        accelerator: an ``accelerate.Accelerator`` to use; by default one is made (on the CPU when
            the engine's device is the CPU or no GPU is present) with the DDP options below.
        find_unused_parameters, bucket_cap_mb, broadcast_buffers, static_graph: passed to
            ``DistributedDataParallel`` through accelerate (None keeps torch's default).
        global_batch_size: optional check: the samples per optimizer step you mean (per-device
            batch x processes x accumulation steps); a mismatch fails at TRAIN_START.
        fsdp: accelerate's ``FullyShardedDataParallelPlugin`` (``fsdp.fsdp_plugin()`` builds one):
            the model is sharded in place with FSDP2 at attach instead of wrapped in DDP (data is
            sharded the same way); the DDP options are then unused.
        deepspeed: accelerate's ``DeepSpeedPlugin`` (``deepspeed.deepspeed_plugin_for(args)``): DeepSpeed's
            engine runs the training step (``deepspeed.ZeroSteps``), also in one process.

    Compose ``GradientAccumulation`` (any number of steps, 1 included) for losses normalised by the
    items of the whole step on all ranks; without it each rank's mean loss is averaged, as plain DDP
    does, which equals the one-process loss only when ranks hold equal item counts.
    """

    priority = Priority.FIRST

    def __init__(
        self,
        accelerator: Any = None,
        *,
        find_unused_parameters: bool | None = None,
        bucket_cap_mb: int | None = None,
        broadcast_buffers: bool | None = None,
        static_graph: bool | None = None,
        global_batch_size: int | None = None,
        fsdp: Any = None,
        deepspeed: Any = None,
    ) -> None:
        given = dict(
            find_unused_parameters=find_unused_parameters,
            bucket_cap_mb=bucket_cap_mb,
            broadcast_buffers=broadcast_buffers,
            static_graph=static_graph,
        )
        for name, value in given.items():
            kind = DDP_OPTIONS[name]
            if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
                raise ConfigError(f"{name} must be {getattr(kind, '__name__', kind)} or None, got {value!r}")
        if bucket_cap_mb is not None:
            check_positive_int("bucket_cap_mb", bucket_cap_mb)
        if global_batch_size is not None:
            check_positive_int("global_batch_size", global_batch_size)
        self.ddp_options = {k: v for k, v in given.items() if v is not None}
        self.global_batch_size = global_batch_size
        if fsdp is not None and deepspeed is not None:
            raise ConfigError("Distributed got both fsdp and deepspeed: pick one way to shard the model")
        self.fsdp = fsdp  # accelerate's FullyShardedDataParallelPlugin: FSDP2 instead of DDP
        self.deepspeed = deepspeed  # accelerate's DeepSpeedPlugin: DeepSpeed's engine instead of DDP
        self.zero: ZeroSteps | None = None
        self._accelerator = accelerator
        self.num_processes = 1
        self.process_index = 0
        self.model: torch.nn.Module | None = None  # the user's module
        self.ddp: torch.nn.Module | None = None  # its DDP wrapper (N > 1)

    # -- accelerate ------------------------------------------------------------------------------
    def accelerator_for(self, engine: Engine) -> Any:
        if self._accelerator is None:
            from accelerate import Accelerator
            from accelerate.utils import DistributedDataParallelKwargs

            device = engine.device
            cpu = not torch.cuda.is_available() or (device is not None and torch.device(device).type == "cpu")
            init_attempt_group(cpu=cpu and self.deepspeed is None)  # a torchrun restart's group on its own store
            handlers = [DistributedDataParallelKwargs(**self.ddp_options)] if self.ddp_options else []
            if self.deepspeed is not None:  # accelerate runs DeepSpeed only with cpu=False (DS_ACCELERATOR: the device)
                from accelerate.state import AcceleratorState

                AcceleratorState._reset_state()  # a new DeepSpeed plugin needs a fresh state (as HF's hp search does)
                self._accelerator = Accelerator(deepspeed_plugin=self.deepspeed)
            else:
                self._accelerator = Accelerator(cpu=cpu, kwargs_handlers=handlers)
        return self._accelerator

    # -- attach ----------------------------------------------------------------------------------
    def attach(self, engine: Engine) -> None:
        accelerator = self.accelerator_for(engine)
        self.num_processes = int(accelerator.num_processes)
        self.process_index = int(accelerator.process_index)
        self._is_local_main = bool(accelerator.is_local_main_process)
        if self.num_processes != world_size():
            raise ConfigError(
                f"accelerate sees {self.num_processes} processes but torch.distributed has {world_size()}: "
                "launch with torchrun or `accelerate launch` and let accelerate set up the process group"
            )
        self._set_flags(engine)
        self.on(engine, Event.TRAIN_START, self.train_start)
        if self.num_processes == 1 and self.deepspeed is None:
            return
        close_group_at_exit()
        self.model = engine.model
        if self.deepspeed is not None:  # prepared once the optimizer exists (prepare_optimizer / TRAIN_START)
            self.zero = ZeroSteps(self, engine, accelerator)
        elif self.fsdp is not None:  # the sharded module all-gathers in its own forward: no wrapper
            shard_model(engine.model, self.fsdp, accelerator, engine.optimizer)
            self.on(engine, Event.BEFORE_OPTIMIZER_STEP, local_grad_norm, priority=Priority.CONSUMER)
        else:
            self.ddp = accelerator.prepare_model(engine.model)
            self.wrap_hook(engine, "forward", self._through_ddp)
        if engine.train_data is not None:
            engine.train_data = self.shard_train(engine.train_data)
        self.wrap_hook(engine, "eval_data", self._sharded_eval)

    def prepare_optimizer(self, engine: Engine) -> None:
        """The optimizer exists now: under DeepSpeed, build its engine (before a resume loads a checkpoint)."""
        if self.zero is not None:
            self.zero.prepare(engine)

    def _set_flags(self, engine: Engine) -> None:
        engine.state.is_world_process_zero = self.process_index == 0
        engine.state.is_local_process_zero = self._is_local_main

    # -- data ------------------------------------------------------------------------------------
    def shard_train(self, loader: Any) -> Any:
        """This rank's train loader (the identity in one process)."""
        if self.num_processes == 1:
            return loader
        return shard_train_loader(loader, self.num_processes, self.process_index)

    def shard_eval(self, loader: Any) -> Any:
        """This rank's eval / test loader (the identity in one process)."""
        if self.num_processes == 1:
            return loader
        return shard_eval_loader(loader, self.num_processes, self.process_index)

    def _sharded_eval(self, inner: Callable[[Iterable[Any]], Iterable[Any]]) -> Callable[[Iterable[Any]], Any]:
        return lambda data: self.shard_eval(inner(data))

    # -- the training step -----------------------------------------------------------------------
    def _through_ddp(self, inner: Callable[[torch.nn.Module, Any], Any]) -> Callable[[torch.nn.Module, Any], Any]:
        model, ddp = self.model, self.ddp

        def forward(m: torch.nn.Module, batch: Any) -> Any:
            # training forwards go through DDP (its backward hooks all-reduce the gradients);
            # evaluation uses the plain module, as HF does: no collective per eval batch
            if m is model and m.training and torch.is_grad_enabled():
                return inner(ddp, batch)  # type: ignore[arg-type]
            return inner(m, batch)

        return forward

    def train_start(self, ev: TrainStartEvent) -> None:
        engine = ev.engine
        self._set_flags(engine)  # a fresh State, or rank 0's State loaded by a resume
        if self.num_processes == 1:
            return
        self._check_global_batch(engine)
        check_same_data({"batches per epoch": _batches_per_epoch(engine.train_data)}, "at train start")

    def wrapped_model(self) -> Any:
        """The model as training runs it, when it is not ``engine.model``: the DDP wrapper or DeepSpeed's engine."""
        zero = None if self.zero is None else self.zero.ds_engine
        return self.ddp or zero

    def trained_module(self) -> torch.nn.Module | None:
        """The module the training forward runs through when it is not ``engine.model``: the DDP wrapper.

        The gradient-sync protocol: ``GradientAccumulation`` runs the micro-batches before the last
        of a window inside its ``no_sync()``.
        """
        return self.ddp

    def _check_global_batch(self, engine: Engine) -> None:
        if self.global_batch_size is None:
            return
        per_device = getattr(engine.train_data, "batch_sampler", None)
        size = getattr(getattr(per_device, "global_batches", None), "batch_size", None)
        made = None if size is None else int(size) * engine.accumulation_steps
        if made != self.global_batch_size:
            per = None if size is None else int(size) // self.num_processes
            raise ConfigError(
                f"global_batch_size={self.global_batch_size} cannot be made from per-device batch {per} x "
                f"{self.num_processes} processes x {engine.accumulation_steps} accumulation steps (= {made})"
            )


def _batches_per_epoch(data: Any) -> int | None:
    """The train loader's batches per epoch (None without a length: an iterable)."""
    try:
        return len(data)
    except TypeError:
        return None


__all__ = ["DDP_OPTIONS", "Distributed"]
