"""``SFTConfig`` and ``DPOConfig``: trainbus ``TrainingArguments`` with TRL's own fields and defaults.

The classes are made from the installed TRL's dataclasses, not written out: every field TRL adds to
``transformers.TrainingArguments`` (``max_length``, ``packing``, ``beta``, ``loss_type``, ...) is a field
here with TRL's name, annotation and default, and every transformers field whose default TRL changes
(``learning_rate``, ``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16=None``) takes TRL's
default. A script's ``SFTConfig(...)`` therefore means what it means under TRL, for the TRL release that is
installed. Transformers fields trainbus takes only at their default stay so (a clear error otherwise),
and a misspelt name fails with the closest names, as with ``TrainingArguments``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainbus.engine import ConfigError
from trainbus.engine.errors import suggest
from trainbus.plugins import TrainingArguments
from trainbus.plugins.facade.argument_checks import UNSUPPORTED


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _copied(f: dataclasses.Field[Any]) -> tuple[str, Any, Any]:
    """``(name, type, field)`` for make_dataclass, with TRL's default (a factory stays a factory)."""
    if f.default_factory is not dataclasses.MISSING:
        kept = dataclasses.field(default_factory=f.default_factory, metadata=f.metadata)
    else:
        kept = dataclasses.field(default=f.default, metadata=f.metadata)
    return f.name, f.type, kept


def trl_fields(trl_config: type) -> list[tuple[str, Any, Any]]:
    """The fields of ``trl_config`` that trainbus's TrainingArguments lacks or defaults otherwise."""
    import transformers

    hf = {f.name: f for f in dataclasses.fields(transformers.TrainingArguments)}
    ours = {f.name for f in dataclasses.fields(TrainingArguments)}
    chosen = []
    for f in dataclasses.fields(trl_config):
        if not f.init:
            continue
        if f.name not in hf:
            chosen.append(_copied(f))  # a TRL field
        elif f.name in ours and (_default_of(f) != _default_of(hf[f.name]) or f.type != hf[f.name].type):
            chosen.append(_copied(f))  # a transformers field whose default TRL changes
    return chosen


def _checking_init(cls: type) -> None:
    """Wrap the generated ``__init__``: unsupported transformers fields only at their default, unknown names
    rejected with the closest known ones (TrainingArguments' own rule, for the wider field list)."""
    generated = cls.__init__  # type: ignore[misc]
    known = {f.name for f in dataclasses.fields(cls)}

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        for name in list(kwargs):
            if name in known:
                continue
            if name in UNSUPPORTED:
                default, hint = UNSUPPORTED[name]
                if kwargs[name] == default:
                    del kwargs[name]
                    continue
                raise ConfigError(
                    f"{cls.__name__}: {name}={kwargs[name]!r} is a transformers argument that trainbus does not "
                    f"support{' (' + hint + ')' if hint else ''}; remove it or set it to {default!r}"
                )
            raise ConfigError(f"{cls.__name__} got an unknown argument {name!r}{suggest(name, sorted(known))}")
        generated(self, *args, **kwargs)

    __init__.__doc__ = generated.__doc__
    cls.__init__ = __init__  # type: ignore[misc]


def _pad_to_multiple_of(args: Any) -> None:
    """TRL's reading of ``pad_to_multiple_of``: a command-line string, or "auto" (128 on Neuron, else None)."""
    value = args.pad_to_multiple_of
    if isinstance(value, str) and value != "auto":
        value = None if value.lower() in ("none", "null") else int(value)
    if value == "auto":
        value = 128 if args.device.type == "neuron" else None
    args.pad_to_multiple_of = value


def _trl_post_init(self: Any) -> None:
    """TRL's conversions, then TrainingArguments' checks: bf16 is ``not fp16`` when unset (TRL's base config),
    a single DPO ``loss_type`` becomes a list, ``pad_to_multiple_of`` is read as TRL reads it."""
    if self.bf16 is None:
        self.bf16 = not self.fp16
    if isinstance(getattr(self, "loss_type", None), str) and hasattr(self, "beta"):
        self.loss_type = [self.loss_type]
    weights = getattr(self, "loss_weights", None)
    if weights is not None and len(weights) != len(self.loss_type):
        raise ConfigError(
            f"loss_weights must have one weight per loss_type: {len(weights)} weights for {self.loss_type}"
        )
    TrainingArguments.__post_init__(self)
    _pad_to_multiple_of(self)
    if getattr(self, "loss_type", None) == "chunked_nll":  # TRL's deprecated name of "nll"
        self.loss_type = "nll"
    if self.truncation_mode not in ("keep_start", "keep_end"):
        raise ConfigError(f"truncation_mode must be 'keep_start' or 'keep_end', got {self.truncation_mode!r}")


def make_config(name: str, trl_config: type, doc: str) -> type:
    cls = dataclasses.make_dataclass(
        name, trl_fields(trl_config), bases=(TrainingArguments,), namespace={"__post_init__": _trl_post_init}
    )
    cls.__doc__ = doc
    cls.__module__ = __name__
    _checking_init(cls)
    return cls


def _trl_classes() -> tuple[type, type]:
    from trl.trainer.dpo_config import DPOConfig as TRLDPOConfig
    from trl.trainer.sft_config import SFTConfig as TRLSFTConfig

    return TRLSFTConfig, TRLDPOConfig


_SFT, _DPO = _trl_classes()

SFTConfig: Any = make_config(
    "SFTConfig",
    _SFT,
    "trainbus TrainingArguments with TRL's SFTConfig fields and defaults (max_length, packing, "
    "completion_only_loss, assistant_only_loss, ...): the installed TRL's, field by field.",
)
DPOConfig: Any = make_config(
    "DPOConfig",
    _DPO,
    "trainbus TrainingArguments with TRL's DPOConfig fields and defaults (beta, loss_type, "
    "precompute_ref_log_probs, ...): the installed TRL's, field by field.",
)
