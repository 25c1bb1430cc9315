"""A model's weights in a checkpoint: under which names they are saved, and how a saved state is fitted back.

``state_to_save``: of the names sharing one tensor (tied weights: GPT-2's ``lm_head.weight`` and
``transformer.wte.weight``, T5's ``shared.weight`` and its encoder / decoder / head copies) the one
transformers keeps, so ``from_pretrained`` finds it. safetensors stores a tensor once, and its own
rule keeps the first name in sorted order (``lm_head.weight``, ``decoder.embed_tokens.weight``);
transformers drops the names its models declare as tied targets (``_tied_weights_keys``, on any
submodule) and keeps the source, and the ``from_pretrained`` of transformers 4.57 loads only the
source: a GPT-2 checkpoint holding ``lm_head.weight`` loaded with its embedding left on the meta
device. Here the declared targets are dropped as transformers does (a pattern searched in the name,
prefixed with its submodule's path); of several undeclared names the sorted first is kept, as
safetensors would.

``load_weights`` checks names, ties, shapes and dtypes (``check_dtypes``) before it copies. Keys left
out only because they are tied to a loaded one are fine (a checkpoint may hold either name of a tied
pair), as are keys a checkpoint leaves out on purpose (``may_lack``: a verified frozen base's
parameters); anything else that does not fit is refused before a tensor is copied. ``io.py`` re-exports it.
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.nn.modules.module import _IncompatibleKeys

from trainbus.engine import ConfigError

#: set to 1 to load weights holding NaN (or a parameter holding an infinity) with a warning instead of refusing them
NONFINITE_OPT_IN = "TRAINBUS_ALLOW_NONFINITE_WEIGHTS"


def tied_target_patterns(model: torch.nn.Module) -> list[str]:
    """Every tied target the model's submodules declare, as a pattern searched in a full name.

    transformers 5 declares ``_tied_weights_keys = {target: source}``, 4.x a list of targets (and
    ``_dynamic_tied_weights_keys`` set at run time); both are regular expressions.
    """
    patterns: list[str] = []
    for path, module in model.named_modules():
        for attribute in ("_tied_weights_keys", "_dynamic_tied_weights_keys"):  # the latter: 4.x's encoder-decoder ties
            declared = getattr(module, attribute, None) or ()
            for key in declared.keys() if isinstance(declared, dict) else declared:
                if isinstance(key, str):
                    patterns.append(f"{re.escape(path)}\\.{key}" if path else key)
    return patterns


def state_to_save(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with one name per tied tensor, the one transformers keeps (see the module doc)."""
    state = model.state_dict()
    aliases: defaultdict[tuple[object, ...], list[str]] = defaultdict(list)
    for name, tensor in state.items():
        if tensor.data_ptr() != 0:  # an empty or meta tensor shares nothing
            key = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
            aliases[key].append(name)
    groups = [sorted(names) for names in aliases.values() if len(names) > 1]
    if not groups:
        return state
    patterns = tied_target_patterns(model)
    for names in groups:
        targets = [n for n in names if any(re.search(p, n) for p in patterns)]
        # all of them declared targets: transformers keeps the last in sorted order
        keep = next((n for n in names if n not in targets), names[-1])
        for name in names:
            if name != keep:
                del state[name]
    return state


def load_weights(
    model: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str, may_lack: Iterable[str] = ()
) -> Any:
    """Copy ``state`` into ``model``; keys missing only because they are tied to a loaded one are fine.

    ``may_lack`` names keys a checkpoint leaves out on purpose (a verified frozen base's parameters).
    Raises ConfigError naming ``where`` on unexpected or missing keys or shape mismatches. A model with a
    ``load_state_dict`` of its own gets it called, ``load_state_dict(state, False)`` as transformers calls it,
    and it decides what fits (only dtypes are checked first).
    Returns what ``load_state_dict`` returns (missing and unexpected keys): the tied keys the state left out.
    """
    own = model.state_dict(keep_vars=True)  # names and storages: no detached copies needed
    if type(model).load_state_dict is not torch.nn.Module.load_state_dict:
        return _own_loading(model, state, where)
    unexpected = sorted(set(state) - set(own))
    if unexpected:
        raise ConfigError(f"{where} has weights the model lacks: {unexpected[:10]}")
    may_lack = set(may_lack)
    if len(state) < len(own):  # some not loaded: each must be tied to a loaded one, or may be lacking
        loaded_ptrs = {(own[k].device, own[k].data_ptr()) for k in state if own[k].data_ptr() != 0}
        missing = [
            k
            for k in own
            if k not in state and k not in may_lack and (own[k].device, own[k].data_ptr()) not in loaded_ptrs
        ]
        if missing:
            raise ConfigError(f"{where} lacks weights of the model: {missing[:10]}")
    check_weights(model, state, where, own)  # first: a misread header can look like another shape too
    misfits = [k for k, t in state.items() if own[k].shape != t.shape]
    if misfits:  # refused before anything is copied (load_state_dict copies the fitting ones, then raises)
        shapes = [(k, tuple(state[k].shape), tuple(own[k].shape)) for k in misfits[:5]]
        raise ConfigError(f"{where} does not fit the model: (name, saved shape, model shape) {shapes}")
    if plain_loading(model):
        with torch.no_grad():
            for key, tensor in state.items():
                own[key].copy_(tensor)
        return _IncompatibleKeys([k for k in own if k not in state and k not in may_lack], [])
    try:
        return model.load_state_dict(dict(state), False)
    except RuntimeError as exc:
        raise ConfigError(f"{where} does not fit the model: {exc}") from exc


def _own_loading(model: torch.nn.Module, state: Mapping[str, torch.Tensor], where: str) -> Any:
    """A model with a ``load_state_dict`` of its own decides what fits (a buffer it resizes, keys it renames):
    it gets the state as transformers' Trainer gives it, ``load_state_dict(state, False)``; dtypes are checked."""
    check_weights(model, state, where)
    try:
        return model.load_state_dict(dict(state), False)
    except RuntimeError as exc:
        raise ConfigError(f"{where} does not fit the model: {exc}") from exc


def plain_loading(model: torch.nn.Module) -> bool:
    """Whether ``load_state_dict`` would only copy each tensor in place (what ``load_weights`` then does itself).

    ``load_state_dict`` hands every module the whole state and each filters it by prefix: quadratic in
    the number of modules (a 300-layer MLP's resume spent 0.85 of 1.3 s there, measured). A module that
    loads in a way of its own (its ``_load_from_state_dict``, extra state or load hooks: BatchNorm,
    lazy modules, FSDP) or torch's swap-on-load switch sends the load through ``load_state_dict``.
    """
    if type(model).load_state_dict is not torch.nn.Module.load_state_dict:
        return False
    if torch.__future__.get_swap_module_params_on_conversion():
        return False
    base = torch.nn.Module
    return not any(
        type(module)._load_from_state_dict is not base._load_from_state_dict
        or type(module).set_extra_state is not base.set_extra_state
        or module._load_state_dict_pre_hooks
        or module._load_state_dict_post_hooks
        for module in model.modules()
    )


def check_weights(
    model: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    where: str,
    own: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Everything saved weights are checked for before a tensor is copied: ``check_dtypes``, ``check_finite``."""
    own = model.state_dict(keep_vars=True) if own is None else own
    check_dtypes(model, state, where, own)
    check_finite(state, where, own)


def check_finite(state: Mapping[str, torch.Tensor], where: str, own: Mapping[str, torch.Tensor]) -> None:
    """Refuse (ConfigError) saved weights holding NaN, or a parameter holding an infinity (#37 item 7).

    A run that diverged saves such weights, and a run resumed from them trains on NaN without a word.
    Buffers may hold infinities (an attention mask of -inf), never NaN. Each tensor costs one sum in its
    own dtype, no copy (NaN and infinities survive a sum); only a tensor whose sum is not finite (which an
    overflow of finite values can cause too) is counted value by value. With ``TRAINBUS_ALLOW_NONFINITE_WEIGHTS=1``
    they load, with a warning naming them.
    """
    bad = []
    for name, tensor in state.items():
        if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0 or tensor.is_meta:
            continue
        values = torch.view_as_real(tensor) if tensor.is_complex() else tensor
        if math.isfinite(torch.sum(values).item()):  # native: 3-11 GB/s on a CPU core, float64 accumulation 0.2
            continue
        nan, inf = int(torch.isnan(values).sum()), int(torch.isinf(values).sum())
        parameter = isinstance(own.get(name), torch.nn.Parameter)
        if nan or (parameter and inf):
            bad.append(f"{name!r}: {nan} NaN, {inf if parameter else 0} infinite of {values.numel()}")
    if not bad:
        return
    text = (
        f"{where} holds non-finite weights ({len(bad)} tensor(s): {'; '.join(bad[:5])}): the run that saved them "
        "had diverged, and training on from them trains on NaN. Resume an earlier checkpoint"
    )
    if os.environ.get(NONFINITE_OPT_IN) == "1":
        warnings.warn(f"{text}; loading them anyway, as {NONFINITE_OPT_IN}=1 asks", UserWarning, stacklevel=3)
        return
    raise ConfigError(f"{text}, or set {NONFINITE_OPT_IN}=1 to load them anyway")


def check_dtypes(
    model: torch.nn.Module,
    state: Mapping[str, torch.Tensor],
    where: str,
    own: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Refuse saved weights whose dtype could only be a misreading of the model's: ConfigError naming them.

    ``load_state_dict`` casts silently, so an ``int32`` header over ``float32`` bytes (same shapes,
    same sizes) would load the bits as integers, and ``float16`` over ``bfloat16`` as other numbers:
    garbage that trains on. Refused: another kind (floating point, integer, bool, complex), or
    another dtype of the same size. A cast between precisions of one kind (float32 saved, a float64
    or bfloat16 model) keeps the values and is left to ``load_state_dict``, as transformers does.
    """
    own = model.state_dict(keep_vars=True) if own is None else own
    wrong = [k for k, t in state.items() if k in own and (_misread(t.dtype, own[k].dtype) or _recut(t, own[k]))]
    if wrong:
        listed = [(k, _name(state[k].dtype), _name(own[k].dtype)) for k in wrong[:5]]
        recut = [(k, tuple(state[k].shape), tuple(own[k].shape)) for k in wrong[:5] if _recut(state[k], own[k])]
        shapes = (
            f", declared with a shape holding exactly the model's bytes (name, saved, model) {recut}" if recut else ""
        )
        raise ConfigError(
            f"{where} does not fit the model: {len(wrong)} weight(s) saved with a dtype that is not the model's "
            f"(name, saved dtype, model dtype) {listed}{shapes}; their bytes would be read as other numbers. Load it "
            "into a model of the dtypes that saved it (and cast the model after loading if you need others)"
        )


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _recut(saved: torch.Tensor, model: torch.Tensor) -> bool:
    """Another dtype *and* another shape over exactly the model tensor's bytes (a float16 header doubling the last
    dimension of a float32 weight): a header misread, not another model, which differs in its bytes too."""
    if saved.dtype == model.dtype or saved.shape == model.shape:
        return False
    return saved.numel() * saved.element_size() == model.numel() * model.element_size()


def _misread(saved: torch.dtype, model: torch.dtype) -> bool:
    if saved == model:
        return False
    kinds = {(d.is_floating_point, d.is_complex, d == torch.bool) for d in (saved, model)}
    return len(kinds) > 1 or saved.itemsize == model.itemsize  # same size: the bytes of one read as the other
