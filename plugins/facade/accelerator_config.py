"""``TrainingArguments.accelerator_config``: transformers' ``AcceleratorConfig`` read key by key.

transformers hands these keys to accelerate's data-loader preparation. trainbus runs on accelerate too, but
shards its loaders itself (``plugins/distributed/sharding.py``: each process draws its own batches of
``per_device_train_batch_size`` from one seeded order, the last batch completed by wrapping around, the eval
set split without repeats). Each key is therefore either the behaviour trainbus has (accepted) or another
one it does not implement (a ConfigError now, saying why), never ignored.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any

from trainbus.engine import ConfigError
from trainbus.engine.errors import ConfigNotImplementedError

#: transformers' keys with its defaults: the behaviour trainbus's sharding has
DEFAULTS: dict[str, Any] = {
    "split_batches": False,
    "dispatch_batches": None,
    "even_batches": True,
    "use_seedable_sampler": True,
    "non_blocking": False,
    "gradient_accumulation_kwargs": None,
    "use_configured_state": False,
}

#: for each key, the values trainbus's own way matches, and why another value is refused
ACCEPTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "split_batches": ((False,), "each process loads per_device_train_batch_size samples; set that to the split size"),
    "dispatch_batches": ((None, False), "every process reads its own shard of the data; nothing is dispatched"),
    "even_batches": ((True,), "trainbus evens the last batches across processes (and drops the repeats in eval)"),
    "use_seedable_sampler": ((True,), "trainbus's samplers are seeded from `seed` / `data_seed` (resume replays them)"),
    # trainbus's to_device hook always copies with non_blocking=True (asynchronous when the loader pins memory,
    # dataloader_pin_memory's default): either value gives the same batches
    "non_blocking": ((False, True), ""),
    "gradient_accumulation_kwargs": ((None,), "use gradient_accumulation_steps (the GradientAccumulation plugin)"),
    "use_configured_state": ((False,), "the Distributed plugin sets accelerate up from the arguments"),
}


def parse_accelerator_config(value: Any) -> Any:
    """transformers' ``AcceleratorConfig`` (a dict of its keys without transformers) from None, a dict, a JSON
    string or file, or an AcceleratorConfig: as transformers' TrainingArguments holds it."""
    if value is None:
        value = {}
    if isinstance(value, type):  # transformers: a class is "not implemented" (its NotImplementedError)
        raise ConfigNotImplementedError(
            f"accelerator_config must be an AcceleratorConfig instance (or a dict / JSON), not the class {value!r}"
        )
    if hasattr(value, "to_dict") and type(value).__name__ == "AcceleratorConfig":
        value = value.to_dict()
    elif isinstance(value, str):
        value = _from_text(value)
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"TrainingArguments: accelerator_config must be a dict, a JSON string or file, or an AcceleratorConfig, "
            f"got {value!r}"
        )
    unknown = sorted(set(value) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"accelerator_config has unknown keys {unknown}; the keys are {sorted(DEFAULTS)}")
    config = {**DEFAULTS, **value}
    for key, (allowed, why) in ACCEPTED.items():
        if config[key] not in allowed:
            raise ConfigError(f"accelerator_config[{key!r}]={config[key]!r} is not supported by trainbus: {why}")
    if "transformers" not in sys.modules:  # transformers' class only where the script uses transformers
        return config
    from transformers.trainer_pt_utils import AcceleratorConfig

    return AcceleratorConfig(**config)


def _from_text(text: str) -> Any:
    if text.lstrip().startswith("{"):
        return json.loads(text)
    if not os.path.isfile(text):
        raise ConfigError(f"accelerator_config={text!r} is neither a JSON object nor a JSON file")
    with open(text, encoding="utf-8") as handle:
        return json.load(handle)
