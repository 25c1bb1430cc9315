"""Fitting a saved state into a model: ``load_weights`` checks names, ties and shapes before it copies.

Keys left out only because they are tied to a loaded one are fine, as are keys a checkpoint leaves
out on purpose (``may_lack``: a verified frozen base's parameters); anything else that does not fit
is refused before a tensor is copied. ``io.py`` re-exports it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from trainbus.engine import ConfigError


def load_weights(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str, may_lack: Iterable[str] = ()
) -> None:
    """Copy ``state`` into ``model``; keys missing only because they are tied to a loaded one are fine.

    ``may_lack`` names keys a checkpoint leaves out on purpose (a verified frozen base's parameters).
    Raises ConfigError naming ``where`` on unexpected or missing keys or shape mismatches.
    """
    own = model.state_dict(keep_vars=True)  # names and storages: no detached copies needed
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ConfigError(f"{where} has weights the model lacks: {unexpected[:10]}")
    if len(state) < len(own):  # some not loaded: each must be tied to a loaded one, or may be lacking
        may_lack = set(may_lack)
        loaded_ptrs = {(own[k].device, own[k].data_ptr()) for k in state if own[k].data_ptr() != 0}
        missing = [
            k
            for k in own
            if k not in state and k not in may_lack and (own[k].device, own[k].data_ptr()) not in loaded_ptrs
        ]
        if missing:
            raise ConfigError(f"{where} lacks weights of the model: {missing[:10]}")
    misfits = [k for k, t in state.items() if own[k].shape != t.shape]
    if misfits:  # refused before anything is copied (load_state_dict copies the fitting ones, then raises)
        shapes = [(k, tuple(state[k].shape), tuple(own[k].shape)) for k in misfits[:5]]
        raise ConfigError(f"{where} does not fit the model: (name, saved shape, model shape) {shapes}")
    try:
        model.load_state_dict(dict(state), strict=False)
    except RuntimeError as exc:
        raise ConfigError(f"{where} does not fit the model: {exc}") from exc
