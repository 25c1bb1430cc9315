"""The public helper methods of HF's ``Trainer`` that scripts call (the seeds' method index, "utilities").

A mixin of ``Trainer``: each method has HF's name, signature and behaviour, over trainbus's engine.
Only the main process writes files or prints (as HF).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import ConfigError

from ..evaluation.collector import EvalLoopOutput
from ..observability.flos import FloCounter
from ..optimization.optimizers import get_decay_parameter_names, optimizer_cls_and_kwargs


class TrainerUtilities:
    """HF ``Trainer`` methods for scripts: learning rates, parameter counts, FLOs, metrics files, loops."""

    # provided by Trainer / Engine
    args: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    state: Any
    label_names: Any
    _count_items: Any  # fn(batch) -> the items the model's loss averages over (loss_protocol.item_counter)
    flo_counter: FloCounter  # HF's FLOs (attached by composition when the model has an estimate)

    # -- optimizer and parameters ------------------------------------------------------------------
    def _need_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise ConfigError("the Trainer has no optimizer yet: call create_optimizer() or train() first")
        return self.optimizer

    def get_learning_rates(self) -> list[float]:
        """The learning rate of each optimizer parameter group (HF)."""
        return [float(group["lr"]) for group in self._need_optimizer().param_groups]

    def get_num_trainable_parameters(self) -> int:
        """Elements of the parameters that require a gradient (HF)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def get_optimizer_group(self, param: str | torch.nn.Parameter | None = None) -> Any:
        """HF's: the optimizer group (its dict) holding ``param``; without one, every group's parameter list.

        ``get_optimizer_group()`` is ``[group["params"] for group in optimizer.param_groups]``, the
        weight-decay group first, as transformers returns it. ``param`` may also be a parameter's name
        (trainbus's addition); a parameter in no group (a frozen one) raises instead of HF's falling back
        to the list of all groups. Membership is by identity (HF's ``in`` compares the values of one-element
        tensors, so two equal scalar parameters can find each other's group there).
        """
        optimizer = self._need_optimizer()
        if param is None:
            return [group["params"] for group in optimizer.param_groups]
        if isinstance(param, str):
            named = dict(self.model.named_parameters())
            if param not in named:
                raise ConfigError(f"the model has no parameter named {param!r}")
            param = named[param]
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return group
        raise ConfigError("that parameter is in no optimizer group (is it frozen?)")

    def get_total_train_batch_size(self, args: Any = None) -> int:
        """Samples per optimizer step over all processes: per-device batch x accumulation x processes (HF)."""
        args = self.args if args is None else args
        per_device = getattr(self, "_train_batch_size", None) or args.per_device_train_batch_size  # after auto halving
        return int(per_device * args.gradient_accumulation_steps * args.world_size)

    def get_decay_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """Parameters that get weight decay: all but biases and normalisation layers (HF's rules)."""
        return get_decay_parameter_names(model)

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: Any, model: torch.nn.Module | None = None) -> tuple[Any, dict[str, Any]]:
        """The optimizer class and keyword arguments for ``args.optim`` (HF); see ``optimizer_cls_and_kwargs``."""
        return optimizer_cls_and_kwargs(args, model)

    def get_tp_size(self) -> int:
        """Tensor-parallel size: trainbus does no tensor parallelism, so 1 (HF)."""
        return int(getattr(self.model, "_tp_size", None) or 1)

    def set_initial_training_values(self, args: Any, dataloader: Any) -> tuple[int, int, int, int, int, int, int]:
        """HF's plan of a run: (num_train_epochs, num_update_steps_per_epoch, num_examples, num_train_samples,
        total_train_batch_size, steps_in_epoch, max_steps)."""
        k = args.gradient_accumulation_steps
        total_batch = self.get_total_train_batch_size(args)
        try:
            batches: int | None = len(dataloader)
        except TypeError:
            batches = None
        if batches:
            per_epoch = max(math.ceil(batches / k), 1)
            max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * per_epoch)
            examples = len(dataloader.dataset) if hasattr(dataloader, "dataset") else batches * total_batch
            if args.max_steps > 0:
                epochs, samples = math.ceil(max_steps / per_epoch), max_steps * total_batch
            else:
                epochs, samples = math.ceil(args.num_train_epochs), int(examples * args.num_train_epochs)
        elif args.max_steps > 0:  # no length: as many passes as max_steps needs
            max_steps = per_epoch = args.max_steps
            epochs, examples, samples = sys.maxsize, total_batch * max_steps, total_batch * max_steps
        else:
            raise ConfigError("the train dataloader has no length: set max_steps to a positive number")
        steps_in_epoch = batches if batches is not None else max_steps * k
        return epochs, per_epoch, examples, samples, total_batch, steps_in_epoch, max_steps

    # -- floating point operations (the FloCounter plugin counts; composition.flo_counter) --------
    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """FLOs of one forward and backward on ``inputs`` (HF): the model's own ``floating_point_ops`` if it has
        one, else for transformers models 6 x main-input elements x non-embedding parameters, else 0.

        The FloCounter plugin calls this method per micro-batch, so a subclass's override is what counts."""
        return self.flo_counter.estimate(inputs, self.model)

    def store_flos(self) -> None:
        """Add the FLOs counted since the last call to ``state.total_flos`` (summed over processes, as HF)."""
        engine: Any = self
        self.flo_counter.store(engine)

    @property
    def current_flos(self) -> float:
        """FLOs counted since they were last added to ``state.total_flos`` (HF)."""
        return self.flo_counter.current_flos

    @current_flos.setter
    def current_flos(self, value: float) -> None:
        self.flo_counter.current_flos = float(value)

    # -- metrics and state files -----------------------------------------------------------------
    @staticmethod
    def metrics_format(metrics: dict[str, Any]) -> dict[str, Any]:
        """Metrics for reading (HF): memory in MB, runtimes as h:mm:ss.xx, total_flos in GF, floats rounded."""
        return format_metrics(metrics)

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print ``metrics`` as HF does (``***** train metrics *****``, aligned, humanised), main process only."""
        if not self.is_world_process_zero():
            return
        print(f"***** {split} metrics *****")
        shown = format_metrics(metrics)
        if not shown:
            return
        key_width = max(len(str(k)) for k in shown)
        value_width = max(len(str(v)) for v in shown.values())
        for key in sorted(shown):
            print(f"  {key: <{key_width}} = {shown[key]:>{value_width}}")

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """Write ``{split}_results.json`` in output_dir and merge into ``all_results.json`` (HF), main process only."""
        if not self.is_world_process_zero():
            return
        root = Path(self.args.output_dir)
        root.mkdir(parents=True, exist_ok=True)
        _write_json(root / f"{split}_results.json", metrics)
        if combined:
            everything = root / "all_results.json"
            merged = json.loads(everything.read_text(encoding="utf-8")) if everything.exists() else {}
            merged.update(metrics)
            _write_json(everything, merged)

    def save_state(self) -> None:
        """Write ``trainer_state.json`` in output_dir (HF; save_model saves only the model), main process only."""
        if not self.is_world_process_zero():
            return
        Path(self.args.output_dir).mkdir(parents=True, exist_ok=True)
        self.state.save_to_json(os.path.join(self.args.output_dir, "trainer_state.json"))

    # -- loops and contexts -----------------------------------------------------------------------
    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """One pass over ``dataloader`` collecting predictions, labels and ``{metric_key_prefix}_*`` metrics (HF)."""
        from trainbus.engine import Engine

        trainer: Any = self
        loss_only = self.args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only
        if trainer._evaluation_open:  # inside a subclass's evaluate(): the batches of that evaluation
            return trainer._loop_in_evaluation(dataloader, loss_only, ignore_keys, metric_key_prefix)  # type: ignore[no-any-return]
        trainer._loop_only = True  # a loop, not predict(): no on_predict (HF)
        try:
            out = trainer._with(loss_only, ignore_keys, lambda: Engine.predict(trainer, dataloader))
        finally:
            trainer._loop_only = False
        metrics = {
            f"{metric_key_prefix}_{key[5:]}" if key.startswith("test_") else key: value
            for key, value in (out.metrics or {}).items()
        }
        try:
            samples = len(dataloader.dataset)
        except (AttributeError, TypeError):
            samples = _count_samples(out.predictions if out.predictions is not None else out.label_ids)
        return EvalLoopOutput(out.predictions, out.label_ids, metrics, samples)

    #: HF's legacy name for the same loop
    prediction_loop = evaluation_loop

    def compute_loss_context_manager(self) -> contextlib.ExitStack[Any]:
        """The contexts compute_loss runs in (HF); autocast is the MixedPrecision plugin's, so none here."""
        stack = contextlib.ExitStack()
        autocast = self.autocast_smart_context_manager()
        if not isinstance(autocast, contextlib.nullcontext):
            stack.enter_context(autocast)
        return stack

    def autocast_smart_context_manager(
        self, cache_enabled: bool | None = True
    ) -> contextlib.AbstractContextManager[Any]:
        """HF returns a null context and lets accelerate autocast; trainbus's MixedPrecision plugin does."""
        return contextlib.nullcontext()

    # -- what trainbus does not do ----------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """Deprecated in HF in favour of ``processing_class``; kept for old scripts."""
        return getattr(self, "processing_class", None)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        """Not supported: trainbus never uploads. save_model writes what ``huggingface-cli upload`` takes."""
        raise ConfigError("push_to_hub: trainbus never uploads; save_model(), then upload the folder yourself")

    def init_hf_repo(self, *args: Any, **kwargs: Any) -> Any:
        """Not supported: trainbus never creates Hub repositories."""
        raise ConfigError("init_hf_repo: trainbus never talks to the Hub; create the repository yourself")

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of all machines (HF)."""
        return bool(self.args.process_index == 0)

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process of its machine (HF)."""
        return bool(self.args.local_process_index == 0)


class FlosThroughTrainer(FloCounter):
    """The FloCounter of a Trainer whose subclass overrides ``store_flos``: the count moves into ``state.total_flos``
    through that method, where transformers calls it (each training log, each checkpoint, the end of training;
    not the logs of an evaluation or of the train summary). Trainer's own ``store_flos`` is ``FloCounter.store``."""

    def __init__(self, flos_of: Any) -> None:
        super().__init__(flos_of)
        self.name = "FloCounter"  # its handlers' names and checkpoint key are the counter's

    def store_handler(self, ev: Any) -> None:
        if getattr(ev, "window", True):  # a LOG only at a training logging point
            ev.engine.store_flos()


def format_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """HF's ``metrics_format``: memory in MB, runtimes as h:mm:ss, total_flos in GF, floats to 4 places."""
    shown: dict[str, Any] = {}
    for key, value in metrics.items():
        if "_mem_" in key and isinstance(value, int | float):
            shown[key] = f"{int(value) >> 20}MB"
        elif "_runtime" in key and isinstance(value, int | float):
            shown[key] = str(datetime.timedelta(seconds=int(abs(value)))) + f".{int(abs(value) % 1 * 100):02d}"
        elif key == "total_flos" and isinstance(value, int | float):
            shown[key] = f"{int(value) >> 30}GF"
        elif isinstance(value, float):
            shown[key] = round(value, 4)
        else:
            shown[key] = value
    return shown


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=4, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)  # a crash leaves the old file, never half of the new one


def _count_samples(value: Any) -> int:
    if isinstance(value, list | tuple):
        return _count_samples(value[0]) if value else 0
    return len(value) if value is not None else 0


def log_training_plan(trainer: Any, loader: Any) -> None:
    """What HF's ``train()`` logs before the first step, on transformers' trainer logger (its tests look there)."""
    import logging

    log = logging.getLogger("transformers.trainer").info
    args, dataset = trainer.args, getattr(loader, "dataset", None)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    total_batch = trainer._train_batch_size * args.gradient_accumulation_steps * max(1, args.world_size)
    log("***** Running training *****")
    if dataset is not None and hasattr(dataset, "__len__"):
        log(f"  Num examples = {len(dataset):,}")
    log(f"  Num Epochs = {trainer.max_epochs or 1:,}")
    log(f"  Instantaneous batch size per device = {trainer._train_batch_size:,}")
    log(f"  Total train batch size (w. parallel, distributed & accumulation) = {total_batch:,}")
    log(f"  Gradient Accumulation steps = {args.gradient_accumulation_steps}")
    log(f"  Total optimization steps = {trainer._plan()[0]:,}")
    log(f"  Number of trainable parameters = {trainable:,}")
