"""TrainingArguments: Hugging Face's field names and defaults for everything trainbus supports.

A field HF has but trainbus does not support raises ``ConfigError`` when it is set to anything but
HF's default (a script that passes the default keeps working); a misspelt field raises with the
closest names. Values are checked in ``__post_init__`` so a bad run fails before its first step.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from trainbus.engine import ConfigError
from trainbus.engine.errors import ConfigNotImplementedError, check_positive_int, suggest

from ..control.strategies import IntervalStrategy, SaveStrategy, check_strategy
from ..data.length_grouping import sampling_strategy
from ..data.loading import check_multiprocessing_context
from ..distributed.deepspeed import deepspeed_plugin_for
from ..distributed.fsdp import fsdp_from_accelerate_launch, fsdp_plugin_kwargs
from ..observability.debug import parse_debug_options
from ..optimization.device_settings import check_tf32
from ..optimization.liger import check_liger_kernel
from ..optimization.optimizer_names import check_optim
from .accelerator_config import parse_accelerator_config
from .argument_checks import (
    DDP_BACKENDS,
    HUB_STRATEGIES,
    LOG_LEVELS,
    UNSUPPORTED,
    check_compile_settings,
    check_field_types,
    check_lr_scheduler,
    check_numbers,
    check_output_dir,
    check_trackers,
    dict_argument,
    one_of,
    report_to_list,
)
from .argument_processes import ParallelMode, ProcessArguments
from .argument_schedules import check_best_model, check_steps


@dataclass
class TrainingArguments(ProcessArguments):
    """The arguments of a run, named and defaulted as in ``transformers.TrainingArguments``.

    Only fields trainbus implements exist; HF fields listed in ``UNSUPPORTED`` raise when set to a
    non-default value. ``do_train`` / ``do_eval`` / ``do_predict``, ``overwrite_output_dir``,
    ``run_name`` and ``logging_dir`` are accepted for scripts and, as in
    HF's Trainer, change nothing in training (``do_eval`` turns True with an ``eval_strategy``, as HF's).

    Every field's value is checked against its annotation (``argument_checks.check_field_types``).
    The annotations are transformers' own, so ``HfArgumentParser`` builds the same command line
    from this class as from HF's; ``main_process_first`` and ``parallel_mode`` come with the
    process properties (``argument_processes.ProcessArguments``).

    Example:
        >>> from trainbus.plugins.facade.arguments import TrainingArguments
        >>> args = TrainingArguments("out", eval_strategy="steps", logging_steps=10)
        >>> args.eval_steps, args.train_batch_size
        (10, 8)
        >>> TrainingArguments("out", learning_rat=1e-3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        trainbus.engine.errors.ConfigError: ... unknown argument 'learning_rat'; did you mean 'learning_rate'?
    """

    output_dir: str | None = None
    overwrite_output_dir: bool = False
    do_train: bool = False
    do_eval: bool = False
    do_predict: bool = False
    per_device_train_batch_size: int = 8
    per_device_eval_batch_size: int = 8
    num_train_epochs: float = 3.0
    max_steps: int = -1
    learning_rate: float = 5e-5
    lr_scheduler_type: str = "linear"
    lr_scheduler_kwargs: dict[str, Any] | str | None = None  # a str: JSON (the command line)
    warmup_steps: float = 0
    warmup_ratio: float = 0.0
    optim: str = "adamw_torch_fused"
    optim_args: str | None = None
    # GaLore / APOLLO: the nn.Linear layers to project. None first, as HF: HfArgumentParser tests
    # isinstance(None, <second type of the Union>), which a parameterized generic there breaks
    optim_target_modules: None | str | list[str] = None  # noqa: RUF036
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    gradient_accumulation_steps: int = 1
    average_tokens_across_devices: bool = True
    max_grad_norm: float = 1.0
    label_smoothing_factor: float = 0.0
    bf16: bool = False
    fp16: bool = False
    bf16_full_eval: bool = False
    fp16_full_eval: bool = False
    tf32: bool | None = None
    gradient_checkpointing: bool | None = None
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    activation_checkpointing: bool | None = None  # transformers 5.24's name; gradient_checkpointing mirrors it
    activation_checkpointing_kwargs: dict[str, Any] | str | None = None
    enable_jit_checkpoint: bool = False  # trainbus checkpoints on SIGTERM either way (the Preemption plugin)
    accelerator_config: Any = None  # accelerator_config.py: each key trainbus's own sharding honours
    use_cache: bool = False  # HF 5: set on model.config, so a causal LM returns no cache while training
    torch_compile: bool = False
    torch_compile_backend: str | None = None
    torch_compile_mode: str | None = None
    neftune_noise_alpha: float | None = None
    torch_empty_cache_steps: int | None = None
    use_liger_kernel: bool = False
    liger_kernel_config: dict[str, bool] | None = None
    logging_strategy: str = "steps"
    logging_steps: float = 500
    logging_first_step: bool = False
    logging_nan_inf_filter: bool = True
    logging_dir: str | None = None
    log_level: str = "passive"
    log_level_replica: str = "warning"
    log_on_each_node: bool = True
    include_num_input_tokens_seen: str | bool = "no"
    disable_tqdm: bool | None = None
    report_to: None | str | list[str] = "none"  # noqa: RUF036 (None first, as optim_target_modules)
    run_name: str | None = None
    # the experiment trackers' settings (report_to="wandb" / "mlflow" / "trackio"); trainbus never pushes
    # to the Hub, so hub_private_repo only makes a Trackio Space private
    project: str = "huggingface"
    trackio_space_id: str | None = None
    trackio_bucket_id: str | None = None
    # HF's annotation: HfArgumentParser reads a str (a bool in the Union would not parse); False = no static Space
    trackio_static_space_id: str | None | Literal[False] = None  # noqa: RUF036
    hub_private_repo: bool | None = None
    # HF's upload schedule; nothing is uploaded (push_to_hub stays False), so any of HF's values changes nothing
    hub_strategy: str = "every_save"
    eval_strategy: str = "no"
    eval_steps: float | None = None
    eval_delay: float = 0
    eval_on_start: bool = False
    prediction_loss_only: bool = False
    eval_accumulation_steps: int | None = None
    eval_do_concat_batches: bool = True
    # HF: gather eval outputs across processes as Python objects. In one process nothing is gathered (the
    # results are those of False); under several, trainbus gathers tensors padded across processes either way
    eval_use_gather_object: bool = False
    include_for_metrics: list[str] = field(default_factory=list)
    batch_eval_metrics: bool = False
    save_strategy: str = "steps"
    save_steps: float = 500
    save_total_limit: int | None = None
    save_only_model: bool = False
    # trainbus's own (transformers has no asynchronous save): the saving step copies the state to host memory and
    # a background thread writes the checkpoint (Checkpointing(save_async=True), checkpoints/background.py)
    save_async: bool = False
    load_best_model_at_end: bool = False
    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None
    ignore_data_skip: bool = False
    restore_callback_states_from_checkpoint: bool = False
    seed: int = 42
    data_seed: int | None = None
    full_determinism: bool = False
    use_cpu: bool = False
    ddp_backend: str | None = None
    ddp_timeout: int = 1800
    ddp_find_unused_parameters: bool | None = None
    ddp_bucket_cap_mb: int | None = None
    ddp_broadcast_buffers: bool | None = None
    ddp_static_graph: bool | None = None
    fsdp: str | None = None  # also True or a list of options (argument_checks.ACCEPTED)
    fsdp_config: dict[str, Any] | str | None = None
    deepspeed: dict[str, Any] | str | None = None
    auto_find_batch_size: bool = False
    dataloader_drop_last: bool = False
    dataloader_num_workers: int = 0
    dataloader_pin_memory: bool = True
    dataloader_persistent_workers: bool = False
    dataloader_prefetch_factor: int | None = None
    dataloader_multiprocessing_context: str | None = None
    remove_unused_columns: bool = True
    train_sampling_strategy: str = "random"
    group_by_length: bool = False  # transformers 4.x: True means train_sampling_strategy="group_by_length"
    use_legacy_prediction_loop: bool = False  # transformers 4.x; prediction_loop is evaluation_loop in trainbus
    length_column_name: str = "length"
    label_names: list[str] | None = None
    skip_memory_metrics: bool = True
    debug: str | list[str] = ""  # HF: "underflow_overflow" (a space-separated string or a list)
    resume_from_checkpoint: str | None = None

    def __post_init__(self) -> None:
        check_field_types(self)  # before any conversion: a wrong type fails here, naming the field
        if self.output_dir is None:
            self.output_dir = "trainer_output"  # HF 5 default
        self.output_dir = os.path.expanduser(os.fspath(self.output_dir))
        check_output_dir(self.output_dir)
        self._mirror_checkpointing_names()
        self.optim = _plain_value(self.optim)  # transformers' OptimizerNames member: its name (HF compares equal)
        if self.disable_tqdm is None:
            self.disable_tqdm = False
        if isinstance(self.include_num_input_tokens_seen, bool):
            self.include_num_input_tokens_seen = "all" if self.include_num_input_tokens_seen else "no"
        one_of("include_num_input_tokens_seen", self.include_num_input_tokens_seen, ("no", "all", "non_padding"))
        self.logging_strategy = check_strategy("logging_strategy", self.logging_strategy, IntervalStrategy)
        self.eval_strategy = check_strategy("eval_strategy", self.eval_strategy, IntervalStrategy)
        if self.eval_strategy != IntervalStrategy.NO:
            self.do_eval = True  # HF: example scripts prepare the eval set when do_eval is set
        self.save_strategy = check_strategy("save_strategy", self.save_strategy, SaveStrategy)
        self.report_to = report_to_list(self.report_to)
        one_of("log_level", self.log_level, tuple(LOG_LEVELS))
        one_of("log_level_replica", self.log_level_replica, tuple(LOG_LEVELS))
        self.debug = parse_debug_options(self.debug)
        check_trackers(self)
        for name in ("lr_scheduler_kwargs", "gradient_checkpointing_kwargs"):
            setattr(self, name, dict_argument(name, getattr(self, name)))  # CLI JSON, as HF parses it
        self.activation_checkpointing_kwargs = self.gradient_checkpointing_kwargs
        check_compile_settings(self)
        one_of("hub_strategy", self.hub_strategy, HUB_STRATEGIES)
        if self.use_cpu:
            self.dataloader_pin_memory = False  # HF: nothing is pinned for a CPU run
        check_numbers(self)
        check_steps(self)
        check_lr_scheduler(self)
        check_best_model(self)
        if self.fp16 and self.bf16:
            raise ConfigError("at most one of fp16 and bf16 can be True, got both")
        if self.fp16_full_eval and self.bf16_full_eval:
            raise ConfigError("at most one of fp16_full_eval and bf16_full_eval can be True, got both")
        self._check_processes()
        self._check_sharding()
        check_optim(
            self.optim, target_modules=self.optim_target_modules, fp16=self.fp16, weight_decay=self.weight_decay,
            gradient_accumulation_steps=self.gradient_accumulation_steps, has_cuda=self.n_gpu > 0,
        )  # fmt: skip
        self._check_devices_and_data()

    def _mirror_checkpointing_names(self) -> None:
        """transformers 5.24 renamed gradient_checkpointing* to activation_checkpointing*; the new name wins when
        set, and afterwards both names hold the same value, as there."""
        for old, new in (
            ("gradient_checkpointing", "activation_checkpointing"),
            ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
        ):
            if getattr(self, new) is None:
                setattr(self, new, getattr(self, old))
            setattr(self, old, getattr(self, new))
        if self.gradient_checkpointing is None:
            self.gradient_checkpointing = self.activation_checkpointing = False
        self.accelerator_config = parse_accelerator_config(self.accelerator_config)

    # -- checks ---------------------------------------------------------------------------------
    def _check_processes(self) -> None:
        backend = self.ddp_backend
        if backend is not None and backend not in DDP_BACKENDS:
            raise ConfigError(f"ddp_backend must be one of {list(DDP_BACKENDS)} or None, got {backend!r}")
        if backend == "nccl":
            import torch

            if self.use_cpu or not torch.cuda.is_available():
                where = "use_cpu=True" if self.use_cpu else "this machine has no CUDA GPU"
                raise ConfigError(f"ddp_backend='nccl' needs CUDA GPUs, but {where}; use ddp_backend='gloo' on CPUs")
        check_positive_int("ddp_timeout (seconds)", self.ddp_timeout)
        if self.ddp_bucket_cap_mb is not None:
            check_positive_int("ddp_bucket_cap_mb", self.ddp_bucket_cap_mb)
        for name in ("ddp_find_unused_parameters", "ddp_broadcast_buffers", "ddp_static_graph"):
            if getattr(self, name) not in (None, True, False):
                raise ConfigError(f"{name} must be True, False or None, got {getattr(self, name)!r}")

    def _check_devices_and_data(self) -> None:
        check_tf32(self.tf32)
        if self.torch_empty_cache_steps is not None:
            check_positive_int("torch_empty_cache_steps (or None)", self.torch_empty_cache_steps)
        if self.use_liger_kernel:
            check_liger_kernel(self.liger_kernel_config)
        elif self.liger_kernel_config is not None:
            raise ConfigError("liger_kernel_config is set but use_liger_kernel=False: set use_liger_kernel=True")
        self.train_sampling_strategy = sampling_strategy(self.train_sampling_strategy, self.group_by_length)
        check_multiprocessing_context(self.dataloader_multiprocessing_context, self.dataloader_num_workers)

    def _check_sharding(self) -> None:
        """FSDP / DeepSpeed options, parsed now so a bad one fails before the Trainer is made (as HF)."""
        if not isinstance(self.auto_find_batch_size, bool):
            raise ConfigError(f"auto_find_batch_size must be True or False, got {self.auto_find_batch_size!r}")
        if self.fsdp and self.deepspeed:
            raise ConfigError("fsdp and deepspeed are both set: pick one way to shard the model")
        if self.auto_find_batch_size and self.deepspeed:
            raise ConfigError("auto_find_batch_size is not supported with deepspeed: its engine fixes the micro batch")
        #: accelerate FSDP plugin arguments (None: no FSDP); an `accelerate launch` FSDP config counts
        self.fsdp_plugin_args = fsdp_plugin_kwargs(self.fsdp, self.fsdp_config)
        if self.fsdp_plugin_args is None and not self.deepspeed:
            self.fsdp_plugin_args = fsdp_from_accelerate_launch()
        #: accelerate's DeepSpeedPlugin, its "auto" values filled from these arguments (None: no DeepSpeed)
        self.deepspeed_plugin = deepspeed_plugin_for(self) if self.fsdp_plugin_args is None else None

    # -- HF conveniences ------------------------------------------------------------------------
    @property
    def train_batch_size(self) -> int:
        return self.per_device_train_batch_size

    @property
    def eval_batch_size(self) -> int:
        return self.per_device_eval_batch_size

    def get_warmup_steps(self, num_training_steps: int) -> int:
        """Warmup steps as HF computes them: warmup_steps (a ratio when < 1), else warmup_ratio."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        if self.warmup_steps > 0:
            return math.ceil(num_training_steps * self.warmup_steps)
        return math.ceil(num_training_steps * self.warmup_ratio)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-ready values, as HF's: enums (and lists of them) by value, a ``dtype`` entry (at any
        depth of dict values) by its torch name (``torch.float32`` -> ``"float32"``)."""
        data = {k: _plain_value(v) for k, v in dataclasses.asdict(self).items()}
        _dtype_names(data)
        return data

    def __getattr__(self, name: str) -> Any:
        """A transformers field trainbus takes only at its default reads as that default, as scripts read it
        (``is_main_process(training_args.local_rank)`` in transformers' examples: -1, as transformers 5 leaves it)."""
        if name in UNSUPPORTED:
            return UNSUPPORTED[name][0]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def to_sanitized_dict(self) -> dict[str, Any]:
        """``to_dict`` with every value a bool, int, float or str (HF's, for trackers' hyperparameter tables)."""
        data = {**self.to_dict(), "train_batch_size": self.train_batch_size, "eval_batch_size": self.eval_batch_size}
        return {k: v if type(v) in (bool, int, float, str) else str(v) for k, v in data.items()}


def _plain_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, list) and value and isinstance(value[0], enum.Enum):
        return [v.value for v in value]
    return value


def _dtype_names(data: dict[str, Any]) -> None:
    """HF's rule: a ``dtype`` key holding a torch dtype becomes its name, in ``data`` and in its dict values."""
    dtype = data.get("dtype")
    if dtype is not None and not isinstance(dtype, str):
        data["dtype"] = str(dtype).rsplit(".", 1)[-1]
    for value in data.values():
        if isinstance(value, dict):
            _dtype_names(value)


_FIELDS = tuple(f.name for f in dataclasses.fields(TrainingArguments))
_dataclass_init = TrainingArguments.__init__


def _checked_init(self: TrainingArguments, *args: Any, **kwargs: Any) -> None:
    """Reject HF fields trainbus lacks and misspelt names before the dataclass sees them."""
    for name in list(kwargs):
        if name in _FIELDS:
            continue
        if name == "accelerator_config" and isinstance(kwargs[name], type):  # transformers' type for it
            raise ConfigNotImplementedError(
                f"accelerator_config={kwargs[name].__name__} is a class: transformers takes only a constructed "
                "AcceleratorConfig, and trainbus none (configure accelerate with `accelerate config`)"
            )
        if name in UNSUPPORTED:
            default, hint = UNSUPPORTED[name]
            if kwargs[name] == default:
                del kwargs[name]  # the HF default changes nothing: accept it so ported scripts run
                continue
            raise ConfigError(
                f"TrainingArguments: {name}={kwargs[name]!r} is a transformers argument that trainbus does not "
                f"support{' (' + hint + ')' if hint else ''}; remove it or set it to {default!r}"
            )
        raise ConfigError(
            f"TrainingArguments got an unknown argument {name!r}{suggest(name, _FIELDS + tuple(UNSUPPORTED))}"
        )
    _dataclass_init(self, *args, **kwargs)


TrainingArguments.__init__ = _checked_init  # type: ignore[method-assign]

__all__ = ["LOG_LEVELS", "UNSUPPORTED", "IntervalStrategy", "ParallelMode", "SaveStrategy", "TrainingArguments"]
