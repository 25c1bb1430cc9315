"""FSDP: HF's ``fsdp`` / ``fsdp_config`` arguments -> accelerate's FSDP plugin -> torch's FSDP2 ``fully_shard``.

``fsdp_plugin_kwargs`` reads the two arguments as transformers does (``_process_fsdp_args``: a JSON file
or a dict, ``fsdp_`` prefixes dropped, the legacy ``"full_shard offload"`` strings) and checks every
key and value, so a bad option fails when ``TrainingArguments`` is made. ``fsdp_plugin`` turns the
result into accelerate's ``FullyShardedDataParallelPlugin`` (which also reads the ``FSDP_*``
variables ``accelerate launch --config_file`` sets, for the options the arguments leave out).

``shard_model`` wraps the model in place with accelerate's own FSDP2 helpers (``fsdp2_apply_ac``,
``fsdp2_prepare_model``: the auto-wrap policy, separate units for the embeddings and the output
head, the mixed-precision and offload policies). accelerate only switches its state to FSDP on
GPUs (a multi-CPU run stays DDP), so the helpers get a small view of the accelerator whose FSDP
plugin is ours; that way the same code shards on CPUs (gloo) and GPUs (NCCL).

Only FSDP2 is supported: FSDP1 is deprecated in transformers and torch.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from trainbus.engine import ConfigError
from trainbus.engine.errors import suggest

logger = logging.getLogger("trainbus.fsdp")

#: fsdp_config keys trainbus passes on (transformers' names, without the ``fsdp_`` prefix)
FSDP_CONFIG_KEYS = (
    "version",
    "reshard_after_forward",
    "cpu_offload",
    "activation_checkpointing",
    "auto_wrap_policy",
    "transformer_layer_cls_to_wrap",
    "min_num_params",
    "state_dict_type",
)
#: keys transformers reads only for FSDP1: with FSDP2 it ignores them, and so does trainbus
FSDP1_ONLY_KEYS = (
    "forward_prefetch",
    "backward_prefetch",
    "use_orig_params",
    "sync_module_states",
    "limit_all_gathers",
)
#: keys transformers knows that trainbus refuses unless they are off
REFUSED_KEYS = {
    "cpu_ram_efficient_loading": "every rank builds the model; the loading path is not supported",
    "xla": "XLA FSDP is not supported",
    "xla_fsdp_v2": "XLA FSDP is not supported",
    "xla_fsdp_grad_ckpt": "XLA FSDP is not supported",
    "xla_fsdp_settings": "XLA FSDP is not supported",
}
#: the legacy ``fsdp`` strings FSDP2 understands: a sharding strategy, offload, auto_wrap
FSDP_OPTIONS = ("full_shard", "shard_grad_op", "offload", "auto_wrap")
FSDP1_STRATEGIES = ("no_shard", "hybrid_shard", "hybrid_shard_zero2")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
_TRUE, _FALSE = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")


def _as_bool(key: str, value: Any) -> bool:
    text = str(value).lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"fsdp_config[{key!r}] must be true or false, got {value!r}")


def read_fsdp_config(fsdp_config: Mapping[str, Any] | str | os.PathLike[str] | None) -> dict[str, Any]:
    """``fsdp_config`` as a dict with the ``fsdp_`` prefixes dropped (a path is read as JSON; so is a JSON string)."""
    if fsdp_config is None:
        return {}
    if isinstance(fsdp_config, str) and fsdp_config.lstrip().startswith("{"):  # JSON from the command line
        try:
            fsdp_config = json.loads(fsdp_config)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"the fsdp_config JSON string is not valid JSON: {exc}") from exc
    if isinstance(fsdp_config, str | os.PathLike):
        path = Path(fsdp_config)
        try:
            loaded = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ConfigError(f"fsdp_config file {str(path)!r} does not exist") from exc
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"fsdp_config file {str(path)!r} is not valid JSON: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"fsdp_config file {str(path)!r} must hold a JSON object, got {type(loaded).__name__}")
        fsdp_config = loaded
    if not isinstance(fsdp_config, Mapping):
        raise ConfigError(f"fsdp_config must be a dict or a path to a JSON file, got {type(fsdp_config).__name__}")
    return {(k[5:] if k.startswith("fsdp_") else k): v for k, v in fsdp_config.items()}


def _legacy_options(fsdp: Any, config: dict[str, Any]) -> None:
    """transformers' old ``fsdp="full_shard offload"`` strings, written into ``config`` as it does."""
    items = fsdp.split() if isinstance(fsdp, str) else list(fsdp)
    for item in items:
        if item == "full_shard":
            config.setdefault("reshard_after_forward", True)
        elif item == "shard_grad_op":
            config.setdefault("reshard_after_forward", False)
        elif item == "offload":
            config.setdefault("cpu_offload", True)
        elif item == "auto_wrap":
            continue  # the default auto_wrap_policy already wraps
        elif item in FSDP1_STRATEGIES:
            raise ConfigError(
                f"fsdp={item!r} is an FSDP1 strategy; trainbus shards with FSDP2: use one of {FSDP_OPTIONS}"
            )
        else:
            raise ConfigError(
                f"unknown fsdp option {item!r}{suggest(str(item), FSDP_OPTIONS)}; allowed: {FSDP_OPTIONS}"
            )


def fsdp_plugin_kwargs(fsdp: Any, fsdp_config: Mapping[str, Any] | str | None) -> dict[str, Any] | None:
    """accelerate FSDP plugin arguments from HF's ``fsdp`` / ``fsdp_config``; None when ``fsdp`` is off.

    Every key and value is checked here (ConfigError naming it), as transformers' defaults are
    filled in: FSDP2, ``reshard_after_forward=True``, ``TRANSFORMER_BASED_WRAP`` (the model's
    ``_no_split_modules`` unless ``transformer_layer_cls_to_wrap`` names the classes).
    """
    if fsdp is None or fsdp is False or fsdp == "" or fsdp == []:
        if fsdp_config is not None:
            raise ConfigError("fsdp_config is set but fsdp is off: pass fsdp=True to shard with FSDP")
        return None
    if not isinstance(fsdp, bool | str | list | tuple):
        raise ConfigError(f"fsdp must be True, an option string or a list of options, got {type(fsdp).__name__}")
    config = read_fsdp_config(fsdp_config)
    if not isinstance(fsdp, bool):
        _legacy_options(fsdp, config)
    for key in config:
        if key not in (*FSDP_CONFIG_KEYS, *FSDP1_ONLY_KEYS, *REFUSED_KEYS):
            known = (*FSDP_CONFIG_KEYS, *REFUSED_KEYS)
            raise ConfigError(
                f"unknown fsdp_config key {key!r}{suggest(key, known)}; allowed: {list(FSDP_CONFIG_KEYS)}"
            )
    for key, why in REFUSED_KEYS.items():
        if (
            key in config
            and config[key] not in (None, {})
            and (key == "xla_fsdp_settings" or _as_bool(key, config[key]))
        ):
            raise ConfigError(f"fsdp_config[{key!r}]={config[key]!r} is not supported by trainbus ({why})")
    ignored = sorted(set(config) & set(FSDP1_ONLY_KEYS))
    if ignored:
        logger.info(
            "fsdp_config keys %s only apply to FSDP1 and are ignored (as transformers does with FSDP2)", ignored
        )
    return _plugin_kwargs(config)


def _plugin_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    from accelerate.utils.constants import FSDP_AUTO_WRAP_POLICY

    version = config.get("version", 2)
    if str(version) != "2":
        raise ConfigError(
            f"fsdp_config['version']={version!r}: trainbus shards with FSDP2 (torch's fully_shard); set version 2"
        )
    kwargs: dict[str, Any] = {
        "fsdp_version": 2,
        "reshard_after_forward": _as_bool("reshard_after_forward", config.get("reshard_after_forward", True)),
        "cpu_offload": _as_bool("cpu_offload", config.get("cpu_offload", False)),
        "activation_checkpointing": _as_bool("activation_checkpointing", config.get("activation_checkpointing", False)),
    }
    policy = str(config.get("auto_wrap_policy", FSDP_AUTO_WRAP_POLICY[0])).upper()
    if policy not in FSDP_AUTO_WRAP_POLICY:
        raise ConfigError(
            f"fsdp_config['auto_wrap_policy']={config['auto_wrap_policy']!r}; allowed: {FSDP_AUTO_WRAP_POLICY}"
        )
    kwargs["auto_wrap_policy"] = policy
    classes = config.get("transformer_layer_cls_to_wrap")
    if isinstance(classes, str):
        classes = [classes]
    if classes is not None:
        if not isinstance(classes, list) or not all(isinstance(c, str) and c for c in classes):
            raise ConfigError(
                f"fsdp_config['transformer_layer_cls_to_wrap'] must be a class name or a list of them, got {classes!r}"
            )
        if policy == "TRANSFORMER_BASED_WRAP":
            kwargs["transformer_cls_names_to_wrap"] = list(classes)
    min_params = config.get("min_num_params", 0)
    if isinstance(min_params, bool) or not isinstance(min_params, int) or min_params < 0:
        raise ConfigError(f"fsdp_config['min_num_params'] must be an integer >= 0, got {min_params!r}")
    if policy == "SIZE_BASED_WRAP":
        if min_params == 0:
            raise ConfigError("fsdp_config auto_wrap_policy='SIZE_BASED_WRAP' needs min_num_params > 0")
        kwargs["min_num_params"] = min_params
    if kwargs["activation_checkpointing"] and policy == "NO_WRAP":
        raise ConfigError(
            "fsdp_config activation_checkpointing=True checkpoints the layers the auto_wrap_policy picks; "
            "'NO_WRAP' picks none: use 'TRANSFORMER_BASED_WRAP' or 'SIZE_BASED_WRAP'"
        )
    state_dict_type = str(config.get("state_dict_type", "SHARDED_STATE_DICT")).upper()
    if state_dict_type not in STATE_DICT_TYPES:
        raise ConfigError(f"fsdp_config['state_dict_type']={config['state_dict_type']!r}; allowed: {STATE_DICT_TYPES}")
    # trainbus checkpoints are always per-rank shards and save_model always one consolidated file,
    # whichever type is named; accelerate's plugin still gets the name
    kwargs["state_dict_type"] = state_dict_type
    return kwargs


def fsdp_from_accelerate_launch() -> dict[str, Any] | None:
    """``{}`` (every option from accelerate's ``FSDP_*`` variables) when ``accelerate launch`` asked for FSDP."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() not in _TRUE:
        return None
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ConfigError(
            f"the accelerate config asks for FSDP version {version}: trainbus shards with FSDP2; "
            "set fsdp_version: 2 in it (or pass fsdp=True and fsdp_config to TrainingArguments)"
        )
    return {}


def fsdp_plugin(kwargs: Mapping[str, Any] | None = None, mixed_precision: str = "no") -> Any:
    """accelerate's ``FullyShardedDataParallelPlugin`` from ``fsdp_plugin_kwargs``' result.

    ``mixed_precision`` ("no", "bf16", "fp16") sets FSDP's ``MixedPrecisionPolicy``: the all-gathered
    parameters are cast to that dtype for compute, gradients are reduce-scattered in float32, and
    the sharded parameters and optimizer states stay float32. Autocast and fp16 loss scaling stay
    with trainbus's ``MixedPrecision`` plugin.
    """
    from accelerate.utils import FullyShardedDataParallelPlugin

    options = dict(kwargs or {})
    options.setdefault("fsdp_version", 2)
    try:
        plugin = FullyShardedDataParallelPlugin(**options)
    except (ValueError, TypeError, ImportError) as exc:
        raise ConfigError(f"accelerate refused the FSDP options {options}: {exc}") from exc
    if plugin.fsdp_version != 2:
        raise ConfigError(f"fsdp_version={plugin.fsdp_version}: trainbus shards with FSDP2; set fsdp_version 2")
    if mixed_precision not in ("no", "bf16", "fp16"):
        raise ConfigError(f"mixed_precision must be 'no', 'bf16' or 'fp16', got {mixed_precision!r}")
    if mixed_precision != "no" and plugin.mixed_precision_policy is None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        dtype = torch.bfloat16 if mixed_precision == "bf16" else torch.float16
        plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return plugin


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters (FSDP2 has sharded it)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def local_grad_norm(ev: Any) -> None:
    """BEFORE_OPTIMIZER_STEP, after clipping: the grad norm of sharded gradients as a plain tensor.

    ``clip_grad_norm_`` over DTensor gradients returns the total norm (reduced over the shards) as a
    replicated DTensor; its local tensor is that value, and loggers can stack it with plain tensors.
    """
    from torch.distributed.tensor import DTensor

    norm = ev.engine.step_outputs.get("grad_norm")
    if isinstance(norm, DTensor):
        ev.engine.step_outputs["grad_norm"] = norm.to_local()


def shard_model(
    model: torch.nn.Module, plugin: Any, accelerator: Any, optimizer: torch.optim.Optimizer | None = None
) -> None:
    """Shard ``model`` in place with FSDP2 as accelerate would; ``optimizer`` is pointed at the sharded parameters.

    The optimizer must not have stepped yet (its states would belong to the unsharded parameters).
    """
    from accelerate.utils.fsdp_utils import fsdp2_apply_ac, fsdp2_prepare_model

    if optimizer is not None and optimizer.state:
        raise ConfigError("FSDP must shard the model before the optimizer's first step; this optimizer has state")
    policy = plugin.mixed_precision_policy
    view = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        device=accelerator.device,
        is_main_process=accelerator.is_main_process,
        # accelerate upcasts trainable low-precision parameters to float32 master weights when this is not "no"
        mixed_precision="no" if policy is None or policy.param_dtype is None else str(policy.param_dtype),
        torch_device_mesh=None,
        parallelism_config=None,
    )
    try:
        plugin.set_auto_wrap_policy(model)
        if plugin.activation_checkpointing:
            fsdp2_apply_ac(view, model)  # replaces the layers in place
        names = {id(p): name for name, p in model.named_parameters()}
        old_groups = [list(g["params"]) for g in optimizer.param_groups] if optimizer is not None else []
        sharded = fsdp2_prepare_model(view, model)
    except ValueError as exc:  # e.g. a transformer_layer_cls_to_wrap the model does not have
        raise ConfigError(f"FSDP could not shard {type(model).__name__}: {exc}") from exc
    if sharded is not model:
        raise ConfigError("FSDP replaced the model object; trainbus needs it sharded in place")
    if optimizer is not None:
        new = dict(model.named_parameters())
        for group, old in zip(optimizer.param_groups, old_groups, strict=True):
            group["params"] = [new[names[id(p)]] for p in old]


__all__ = [
    "FSDP_CONFIG_KEYS",
    "fsdp_from_accelerate_launch",
    "fsdp_plugin",
    "fsdp_plugin_kwargs",
    "is_sharded",
    "local_grad_norm",
    "read_fsdp_config",
    "shard_model",
]
