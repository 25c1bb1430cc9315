"""Whether a saved optimizer state was written by the kind of optimizer it is about to be loaded into.

``torch.optim.Optimizer.load_state_dict`` copies the saved param groups wholesale and checks only
their number and sizes, so an AdamW checkpoint loads into SGD without a word and the first step fails
with ``KeyError: 'momentum'``. The hyperparameter keys of the param groups tell optimizer classes
apart; a checkpoint from an older torch only lacks keys a newer torch added (which the optimizer's
``__setstate__`` fills in), so a mismatch is called only when keys are missing on *both* sides.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trainbus.engine import ConfigError


def check_optimizer_fits(optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], where: object) -> None:
    """Raise ConfigError when ``saved`` (an ``optimizer.state_dict()``) comes from another optimizer class.

    Args:
        optimizer: the optimizer the state is about to be loaded into.
        saved: the checkpoint's optimizer state dict.
        where: the checkpoint (named in the message).
    """
    saved_groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not saved_groups or not optimizer.param_groups:
        return
    saved_keys = set(saved_groups[0]) - {"params"}
    current_keys = set(optimizer.param_groups[0]) - {"params"}
    only_saved, only_current = sorted(saved_keys - current_keys), sorted(current_keys - saved_keys)
    if only_saved and only_current:
        name = type(optimizer).__name__
        raise ConfigError(
            f"checkpoint {where} holds the state of another optimizer class than this run's {name}: its "
            f"hyperparameters {only_saved} are not {name}'s, and {name}'s {only_current} are missing. Resume with the "
            "optimizer the checkpoint was trained with (TrainingArguments.optim), or start a new run in another "
            "output_dir"
        )
