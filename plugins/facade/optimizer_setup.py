"""The ``Trainer``'s optimizer and scheduler: HF's ``create_optimizer`` / ``create_scheduler`` and ``lr_scheduler``.

A mixin of ``Trainer``. The scheduler is stepped by the ``LRScheduler`` plugin: ``lr_scheduler`` reads
and replaces it there (the one place the facade looks a plugin up by its class).
"""

from __future__ import annotations

from typing import Any

import torch

from ..optimization.optimizers import create_optimizer, fused_adamw_supported, parameter_groups
from ..optimization.schedulers import LRScheduler, create_scheduler


class TrainerOptimizers:
    """HF's optimizer and scheduler methods (a mixin of ``Trainer``)."""

    # provided by Trainer / Engine
    args: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    optimizer_cls_and_kwargs: Any
    train_data: Any
    max_steps: int | None
    get_plugin: Any
    pop_plugin: Any
    add_plugin: Any
    overrides: Any
    get_optimizer_cls_and_kwargs: Any
    get_decay_parameter_names: Any
    _plan: Any

    @property
    def lr_scheduler(self) -> Any:
        plugin = self.get_plugin(LRScheduler)
        return getattr(plugin, "scheduler", None)

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        """HF code assigns ``self.lr_scheduler = ...`` (in create_scheduler): the LRScheduler plugin steps it."""
        old = self.pop_plugin(LRScheduler)
        if scheduler is not None:
            self.add_plugin(LRScheduler(scheduler, metric=getattr(old, "metric", "loss")))

    def _rebuild_named_schedule(self) -> None:
        """A schedule built from its name is built again at the next TRAIN_START (auto_find_batch_size:
        the run has a new number of steps, as HF's ``self.lr_scheduler = None``); a given one stays."""
        plugin = self.get_plugin(LRScheduler)
        if isinstance(plugin, LRScheduler) and plugin.scheduler_name is not None:
            plugin.scheduler = None

    def create_optimizer(self, model: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """HF's: the optimizer of ``args`` over ``model`` (default the Trainer's), unless there is one already.

        The trainable parameters come in two groups, the weight-decay group first and both present even
        when one is empty (HF's ``optimizer_grouped_parameters``).
        """
        opt_model = self.model if model is None else model
        if self.optimizer is None and (
            self.optimizer_cls_and_kwargs is not None
            or self.overrides("get_optimizer_cls_and_kwargs")
            or self.overrides("get_decay_parameter_names")  # HF's groups from the override's names
        ):
            self.optimizer = self._optimizer_from_cls_and_kwargs(opt_model)
        if self.optimizer is None:
            args = self.args
            name = args.optim
            if name == "adamw_torch_fused" and not fused_adamw_supported(opt_model):
                name = "adamw_torch"
            # for schedule-free warmup; before train() made the loader only max_steps is known
            total_steps = self._plan()[0] if self.train_data is not None else (self.max_steps or 0)
            self.optimizer = create_optimizer(
                opt_model, name, args.learning_rate, args.weight_decay, args.adam_beta1, args.adam_beta2,
                args.adam_epsilon, args.optim_args, optim_target_modules=args.optim_target_modules,
                warmup_steps=args.get_warmup_steps(total_steps),
            )  # fmt: skip
        return self.optimizer

    def _optimizer_from_cls_and_kwargs(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """HF's path for ``optimizer_cls_and_kwargs`` or an overridden ``get_optimizer_cls_and_kwargs``:
        the class gets the weight-decay groups, unless the kwargs bring ``params`` or ``model`` (GaLore, LOMO)."""
        if self.optimizer_cls_and_kwargs is not None:
            optimizer_cls, kwargs = self.optimizer_cls_and_kwargs
        else:
            optimizer_cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model)
        kwargs = dict(kwargs)
        params: Any = parameter_groups(model, self.args.weight_decay, self.get_decay_parameter_names(model))
        for key in ("params", "model"):
            if key in kwargs:
                params = kwargs.pop(key)
        return optimizer_cls(params, **kwargs)  # type: ignore[no-any-return]

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Build the scheduler now (HF); the LRScheduler plugin then steps this instance."""
        if self.lr_scheduler is None:
            args = self.args
            scheduler = create_scheduler(
                str(args.lr_scheduler_type), optimizer or self.create_optimizer(), num_training_steps,
                args.warmup_steps, args.warmup_ratio, args.lr_scheduler_kwargs,
            )  # fmt: skip
            self.lr_scheduler = scheduler
        return self.lr_scheduler

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        self.create_optimizer()
        self.create_scheduler(num_training_steps, self.optimizer)
