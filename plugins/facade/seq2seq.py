"""Seq2SeqTrainer and Seq2SeqTrainingArguments: transformers' sequence-to-sequence facade, one import away.

A script written for ``transformers.Seq2SeqTrainer`` ports by changing the import::

    from trainbus.plugins import Seq2SeqTrainer, Seq2SeqTrainingArguments

With ``predict_with_generate=True`` evaluation and prediction run ``model.generate`` and hand the
generated token ids to ``compute_metrics`` (BLEU, ROUGE, exact match), as transformers does. The
rules follow transformers 5 literally, so that both give the same numbers: ``evaluate`` / ``predict``
take ``generate``'s keyword arguments (``max_length``, ``num_beams``, ...) and fall back to
``generation_max_length`` / ``generation_num_beams``; each batch's generated ids (and labels) are
padded with the pad token to the model's ``generation_config.max_length`` (``max_new_tokens + 1``
when only that is set), and the collector pads what still differs across batches with -100.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Mapping
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainbus.engine import ConfigError
from trainbus.engine.errors import suggest

from ..distributed.deepspeed import deepspeed_engine_of
from ..distributed.fsdp import is_sharded
from ..evaluation.collector import PredictionOutput
from . import arguments as _arguments
from .arguments import TrainingArguments
from .trainer import Trainer

try:  # the annotation below must resolve for HfArgumentParser; generation itself needs transformers
    from transformers import GenerationConfig
except ImportError:  # pragma: no cover - without transformers only the arguments are usable
    GenerationConfig = object  # type: ignore[misc,assignment]

#: the fields Seq2SeqTrainingArguments adds to TrainingArguments (transformers' names and defaults)
SEQ2SEQ_FIELDS = (
    "sortish_sampler",
    "predict_with_generate",
    "generation_max_length",
    "generation_num_beams",
    "generation_config",
)


@dataclass(init=False)
class Seq2SeqTrainingArguments(TrainingArguments):
    """TrainingArguments plus transformers' generation settings for evaluation and prediction.

    ``init=False`` keeps the constructor below: the new fields are keyword arguments taken before
    TrainingArguments' own checking constructor sees the rest, so a misspelt name still fails with
    the closest names (these fields included) and an unsupported HF field still raises.

    Args (beyond TrainingArguments):
        sortish_sampler: only False. transformers 5 accepts True and ignores it (no sampler reads it);
            trainbus refuses it rather than ignore it silently: ``train_sampling_strategy="group_by_length"``
            is the length-grouped sampler that sortish sampling was.
        predict_with_generate: evaluate / predict with ``model.generate``; predictions are token ids.
        generation_max_length: ``max_length`` for generate when evaluate / predict are given none.
        generation_num_beams: ``num_beams`` for generate when evaluate / predict are given none.
        generation_config: a ``GenerationConfig``, or a path (directory or json file) to load one from;
            it replaces ``model.generation_config`` when the trainer is made.

    Example:
        >>> args = Seq2SeqTrainingArguments("/tmp/tb_s2s", predict_with_generate=True, generation_max_length=16)
        >>> args.predict_with_generate, args.generation_max_length, args.generation_num_beams
        (True, 16, None)
        >>> Seq2SeqTrainingArguments("/tmp/tb_s2s", predict_with_generat=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        trainbus.engine.errors.ConfigError: ... 'predict_with_generat'; did you mean 'predict_with_generate'?
    """

    sortish_sampler: bool = False
    predict_with_generate: bool = False
    generation_max_length: int | None = None
    generation_num_beams: int | None = None
    generation_config: str | Path | GenerationConfig | None = field(default=None)

    def __init__(
        self,
        *args: Any,
        sortish_sampler: bool = False,
        predict_with_generate: bool = False,
        generation_max_length: int | None = None,
        generation_num_beams: int | None = None,
        generation_config: str | Path | GenerationConfig | None = None,
        **kwargs: Any,
    ) -> None:
        self.sortish_sampler = sortish_sampler
        self.predict_with_generate = predict_with_generate
        self.generation_max_length = generation_max_length
        self.generation_num_beams = generation_num_beams
        self.generation_config = generation_config
        known = {f.name for f in dataclasses.fields(self)}
        unsupported = getattr(_arguments, "UNSUPPORTED", {})
        for name in kwargs:  # the base would suggest only its own names: suggest these too
            if name not in known and name not in unsupported:
                raise ConfigError(
                    f"Seq2SeqTrainingArguments got an unknown argument {name!r}{suggest(name, sorted(known))}"
                )
        super().__init__(*args, **kwargs)  # TrainingArguments' checking constructor, then __post_init__

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sortish_sampler:
            raise ConfigError(
                "sortish_sampler=True is not supported (transformers 5 accepts it but no sampler uses it): "
                "use train_sampling_strategy='group_by_length' to batch examples of similar length"
            )
        for name in ("generation_max_length", "generation_num_beams"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"{name} must be a positive int or None, got {value!r}")
        config = self.generation_config
        if config is not None and not isinstance(config, str | Path) and type(config).__name__ != "GenerationConfig":
            raise ConfigError(
                f"generation_config must be a path or a transformers GenerationConfig, got {type(config).__name__}"
            )

    def to_dict(self) -> dict[str, Any]:
        """As TrainingArguments', with a GenerationConfig as its dict, so the arguments serialise to JSON (HF)."""
        data = super().to_dict()
        config = data.get("generation_config")
        if config is not None and callable(getattr(config, "to_dict", None)):
            data["generation_config"] = config.to_dict()
        elif isinstance(config, Path):
            data["generation_config"] = str(config)
        return data


class Seq2SeqTrainer(Trainer):
    """transformers' ``Seq2SeqTrainer``: a Trainer whose evaluation can generate.

    Takes the Trainer's arguments; ``args`` must be ``Seq2SeqTrainingArguments``. With
    ``args.predict_with_generate`` (and metrics to compute), ``prediction_step`` returns the loss,
    the generated token ids and the labels, each padded to the model's generation length;
    otherwise it is the Trainer's.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        args: Seq2SeqTrainingArguments | None = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable[[], torch.nn.Module] | None = None,
        compute_loss_func: Callable[..., torch.Tensor] | None = None,
        compute_metrics: Callable[[Any], dict[str, float]] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[torch.optim.Optimizer | None, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
    ) -> None:
        args = Seq2SeqTrainingArguments() if args is None else args
        if not isinstance(args, Seq2SeqTrainingArguments):
            raise ConfigError(
                f"Seq2SeqTrainer needs Seq2SeqTrainingArguments (it reads predict_with_generate and the "
                f"generation settings), got {type(args).__name__}"
            )
        #: generate's keyword arguments of the latest evaluate / predict (HF keeps them between calls)
        self._gen_kwargs: dict[str, Any] | None = None
        super().__init__(
            model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
            eval_dataset=eval_dataset, processing_class=processing_class, model_init=model_init,
            compute_loss_func=compute_loss_func, compute_metrics=compute_metrics, callbacks=callbacks,
            optimizers=optimizers, optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )  # fmt: skip
        # HF's priority: args.generation_config, else the model's own, else generate's defaults
        if args.generation_config is not None:
            self.model.generation_config = self.load_generation_config(args.generation_config)  # type: ignore[assignment]

    @staticmethod
    def load_generation_config(gen_config_arg: str | Path | GenerationConfig) -> GenerationConfig:
        """A copy of a GenerationConfig, or one loaded from a directory or a json file, strictly validated.

        Validated now (as HF) because ``save_pretrained`` refuses a config with warnings at the end of training.
        """
        from transformers import GenerationConfig as _GenerationConfig

        if isinstance(gen_config_arg, _GenerationConfig):
            config = deepcopy(gen_config_arg)
        else:
            path = Path(gen_config_arg)
            if path.is_file():
                config = _GenerationConfig.from_pretrained(path.parent, path.name)
            elif path.is_dir():
                config = _GenerationConfig.from_pretrained(path)
            else:
                raise ConfigError(
                    f"generation_config {str(gen_config_arg)!r} is neither a GenerationConfig json file nor a "
                    "directory holding one (trainbus reads no model ids from the Hub)"
                )
        try:
            _validate_strictly(config)
        except ValueError as exc:
            raise ConfigError(f"{exc}\n\nFix these issues to train your model.") from exc
        return config

    def _generation_kwargs(self, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        """HF's legacy rule: generation_max_length / generation_num_beams fill what the call did not pass."""
        gen_kwargs = dict(gen_kwargs)
        args: Seq2SeqTrainingArguments = self.args  # type: ignore[assignment]
        if (
            gen_kwargs.get("max_length") is None
            and gen_kwargs.get("max_new_tokens") is None
            and args.generation_max_length is not None
        ):
            gen_kwargs["max_length"] = args.generation_max_length
        if gen_kwargs.get("num_beams") is None and args.generation_num_beams is not None:
            gen_kwargs["num_beams"] = args.generation_num_beams
        return gen_kwargs

    def evaluate(  # type: ignore[override]
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs: Any,
    ) -> dict[str, Any]:
        """The Trainer's evaluate; ``gen_kwargs`` (max_length, num_beams, ...) go to ``generate``.

        They stay in force for later evaluations that pass none, as in HF (the evaluations during
        train() call this method without any, so they use the arguments' generation settings).
        """
        self._gen_kwargs = self._generation_kwargs(gen_kwargs)
        return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(  # type: ignore[override]
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        **gen_kwargs: Any,
    ) -> PredictionOutput:
        """The Trainer's predict; ``gen_kwargs`` (max_length, num_beams, ...) go to ``generate``."""
        self._gen_kwargs = self._generation_kwargs(gen_kwargs)
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def prediction_step(  # type: ignore[override]
        self,
        model: torch.nn.Module,
        inputs: Any,
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs: Any,
    ) -> tuple[Any, Any, Any]:
        """(loss, generated ids, labels) with predict_with_generate; the Trainer's step otherwise.

        The loss is the Trainer's (a forward with the labels, label smoothing included); the ids
        and labels are padded with the pad token to the generation length so every batch has the
        same width, exactly as HF pads them.
        """
        args: Seq2SeqTrainingArguments = self.args  # type: ignore[assignment]
        if not args.predict_with_generate or prediction_loss_only:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if not isinstance(inputs, Mapping):
            raise ConfigError(f"predict_with_generate needs dict batches (generate's inputs), got {type(inputs)}")
        has_labels = "labels" in inputs
        if not gen_kwargs and self._gen_kwargs is not None:
            gen_kwargs = dict(self._gen_kwargs)
        for name in ("num_beams", "max_length"):
            if name in gen_kwargs and gen_kwargs[name] is None:
                del gen_kwargs[name]
        gen_kwargs.setdefault("synced_gpus", _sharded_generation(self.model))
        generation_inputs = dict(inputs)
        labels = inputs.get("labels")
        decoder_ids = inputs.get("decoder_input_ids")
        if labels is not None and decoder_ids is not None and labels.shape == decoder_ids.shape:
            # decoder_input_ids made from the labels: generate starts afresh instead of continuing them
            generation_inputs = {
                k: v for k, v in inputs.items() if k not in ("decoder_input_ids", "decoder_attention_mask")
            }
        generator: Any = self.model
        generated = generator.generate(**generation_inputs, **gen_kwargs)
        gen_config = generator.generation_config
        if getattr(gen_config, "_from_model_config", False):  # HF: made once, not per batch
            gen_config._from_model_config = False
        defaults = getattr(gen_config, "_get_default_generation_params", None)
        if callable(defaults):  # transformers 5 keeps unset fields None until generate: fill them as HF does
            gen_config.update(**defaults(), defaults_only=True)
        generated = self._pad_to_generation_length(generated, gen_config)
        loss = super().prediction_step(model, inputs, True, ignore_keys)[0] if has_labels else None
        if args.prediction_loss_only:
            return loss, None, None
        if labels is not None:
            labels = self._pad_to_generation_length(labels, gen_config)
        return loss, generated, labels

    def _pad_to_generation_length(self, tensor: torch.Tensor, gen_config: Any) -> torch.Tensor:
        """HF's rule: up to ``max_length``, or ``max_new_tokens + 1`` when only that is longer."""
        max_length = gen_config.max_length
        max_new_tokens = getattr(gen_config, "max_new_tokens", None)
        if tensor.shape[-1] < max_length:
            return self._pad_tensors_to_max_len(tensor, max_length)
        if max_new_tokens is not None and tensor.shape[-1] < max_new_tokens + 1:
            return self._pad_tensors_to_max_len(tensor, max_new_tokens + 1)
        return tensor

    def _pad_tensors_to_max_len(self, tensor: torch.Tensor, max_length: int) -> torch.Tensor:
        """Right-pad ``tensor`` to ``max_length`` with the tokenizer's pad id (else its eos, else the model's pad)."""
        tokenizer = self.processing_class
        pad_token_id: int | None
        if tokenizer is not None and hasattr(tokenizer, "pad_token_id"):
            pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        else:
            pad_token_id = getattr(getattr(self.model, "config", None), "pad_token_id", None)
            if pad_token_id is None:
                raise ConfigError("pad_token_id must be set in the model's config to pad the generated tokens")
        padded = torch.full((tensor.shape[0], max_length), int(pad_token_id), dtype=tensor.dtype, device=tensor.device)
        padded[:, : tensor.shape[-1]] = tensor
        return padded


def _validate_strictly(config: Any) -> None:
    """``GenerationConfig.validate(strict=True)`` (transformers 5); before it, a warning is the failure (4.x's rule)."""
    if "strict" in inspect.signature(config.validate).parameters:
        config.validate(strict=True)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config.validate()
    if caught:
        raise ValueError("GenerationConfig is invalid: " + "; ".join(str(w.message) for w in caught))


def _sharded_generation(model: torch.nn.Module) -> bool:
    """HF's ``synced_gpus`` default: every rank must run each forward when the weights are sharded
    (FSDP, DeepSpeed ZeRO-3), or a rank that finished generating early would leave the others waiting."""
    engine = deepspeed_engine_of(model)
    stage = getattr(engine, "zero_optimization_stage", None)
    return (callable(stage) and stage() == 3) or is_sharded(model)
