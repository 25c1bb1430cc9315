"""What TRL's trainers do to the model, the tokenizer and the arguments before training, shared by SFT and DPO.

Each step is TRL's protocol, done with TRL's and transformers' public utilities: the model from a path
(``trl.trainer.utils.create_model_from_path``), the tokenizer from a processing class, the pad and eos tokens
mirrored onto the model's configs, a peft adapter from ``peft_config``, the columns the data loader keeps.
"""

from __future__ import annotations

import inspect
from typing import Any

from trainbus.engine import ConfigError
from trainbus.engine.errors import ConfigNotImplementedError


def config_from(args: Any, config_cls: type, model: Any, suffix: str) -> Any:
    """``args`` as ``config_cls``: TRL's default ``<model name>-<suffix>`` when None; plain TrainingArguments
    converted field by field (TRL converts transformers' TrainingArguments the same way)."""
    if args is None:
        name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
        return config_cls(f"{str(name).split('/')[-1]}-{suffix}")
    if isinstance(args, config_cls):
        return args
    from trainbus.plugins import TrainingArguments

    if isinstance(args, TrainingArguments):
        import dataclasses

        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(args) if f.init}
        return config_cls(**{k: (v.value if hasattr(v, "value") else v) for k, v in values.items()})
    raise ConfigError(f"args must be a trainbus {config_cls.__name__} or TrainingArguments, got {type(args).__name__}")


def model_from(model: Any, args: Any) -> Any:
    """The model: loaded from a path or Hub id with ``args.model_init_kwargs`` (TRL's loader), else as given."""
    if not isinstance(model, str):
        return model
    from trl.trainer.utils import create_model_from_path

    kwargs = dict(args.model_init_kwargs or {})
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    return create_model_from_path(model, **kwargs)


def tokenizer_of(processing_class: Any, model: Any) -> tuple[Any, Any]:
    """``(processing_class, tokenizer)``; a processing class is loaded from the model's name when None."""
    from transformers import AutoProcessor, PreTrainedTokenizerBase, ProcessorMixin

    if processing_class is None:
        processing_class = AutoProcessor.from_pretrained(model.config._name_or_path)  # type: ignore[no-untyped-call]
    if isinstance(processing_class, ProcessorMixin):
        raise ConfigNotImplementedError(
            "trainbus.trl trains language models: a multimodal processor (vision-language models) is not supported; "
            "pass a tokenizer as processing_class"
        )
    if not isinstance(processing_class, PreTrainedTokenizerBase):
        raise ConfigError(f"processing_class must be a transformers tokenizer, got {type(processing_class).__name__}")
    return processing_class, processing_class


def set_pad_token(model: Any, tokenizer: Any, pad_token: str | None) -> None:
    """TRL's pad token: ``args.pad_token``, else the tokenizer's, else its eos token; mirrored onto the model."""
    pad = pad_token or tokenizer.pad_token or tokenizer.eos_token
    if pad not in tokenizer.get_vocab():
        raise ConfigError(
            f"pad_token {pad!r} is not in the vocabulary of {type(tokenizer).__name__}: set a token it has"
        )
    tokenizer.pad_token = pad
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id


def set_eos_token(model: Any, tokenizer: Any, eos_token: str | None) -> None:
    """``args.eos_token`` on the tokenizer and the model's configs (generation keeps its other eos ids first)."""
    if eos_token is None:
        return
    if eos_token not in tokenizer.get_vocab():
        raise ConfigError(f"eos_token {eos_token!r} is not in the vocabulary of {type(tokenizer).__name__}")
    tokenizer.eos_token = eos_token
    model.config.get_text_config().eos_token_id = tokenizer.eos_token_id
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id not in ids:
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *ids]


def with_peft(model: Any, peft_config: Any) -> Any:
    """The model with a new adapter from ``peft_config`` (none: the model as given)."""
    if peft_config is None:
        return model
    from peft import PeftConfig, get_peft_model

    if not isinstance(peft_config, PeftConfig):
        raise ConfigError(f"peft_config must be a peft PeftConfig (e.g. LoraConfig), got {type(peft_config).__name__}")
    if is_peft(model):
        raise ConfigError(
            "peft_config was given with a model that is already a PeftModel: merge and unload its adapter first, "
            "or pass the base model"
        )
    return get_peft_model(model, peft_config)


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and callable(getattr(model, "get_base_model", None))


def base_of(model: Any) -> Any:
    """The transformers model under a peft wrapper (TRL adds the fused LM head there)."""
    return model.get_base_model() if is_peft(model) else model


def check_lm_head_not_adapted(model: Any) -> None:
    """TRL's rule: the fused head multiplies by ``lm_head.weight`` itself, so an adapter on it would never train."""
    if not is_peft(model):
        return
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(model.get_output_embeddings(), BaseTunerLayer):
        raise ConfigError(
            "a peft adapter on lm_head is not supported (the log-probabilities use lm_head.weight directly, so the "
            "adapter would never train): remove 'lm_head' from target_modules"
        )


def refuse(args: Any, **given: Any) -> None:
    """Options TRL has that trainbus.trl does not implement: a clear error before anything is built."""
    for name, value in given.items():
        if value is not None:
            raise ConfigNotImplementedError(f"{name} is not supported by trainbus.trl (got {type(value).__name__})")
    if getattr(args, "activation_offloading", False):
        raise ConfigNotImplementedError("activation_offloading=True is not supported by trainbus.trl")
    if args.use_liger_kernel:
        raise ConfigNotImplementedError("use_liger_kernel=True is not supported by trainbus.trl (TRL deprecates it)")
    if getattr(args, "router_aux_loss_coef", None):
        raise ConfigNotImplementedError("router_aux_loss_coef (MoE load balancing) is not supported by trainbus.trl")


def model_card_at_saves(trainer: Any) -> None:
    """TRL writes the model card (README.md in output_dir) with every checkpoint: so does trainbus.trl."""
    from trainbus.engine import Event

    trainer.on(Event.SAVE, lambda ev: trainer.create_model_card(), name=f"{type(trainer).__name__}.model_card")


class ColumnsOf:
    """Stands for the model where the Trainer asks which dataset columns to keep (``remove_unused_columns``):
    a forward naming TRL's signature columns (the model's own would drop ``seq_lengths`` or ``prompt_ids``)."""

    def __init__(self, columns: list[str]) -> None:
        self.columns = list(columns)
        params = [inspect.Parameter(c, inspect.Parameter.KEYWORD_ONLY, default=None) for c in self.columns]

        def forward(**kwargs: Any) -> None:  # pragma: no cover - only its signature is read
            raise TypeError("ColumnsOf only names columns")

        forward.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        self.forward = forward
