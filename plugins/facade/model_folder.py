"""The files that make a directory a model folder: what ``AutoModelFor...from_pretrained`` and scripts read.

transformers' Trainer makes every checkpoint and save_model's output a model folder: the weights,
``config.json``, ``generation_config.json`` for a model that generates, the processing class's
files (tokenizer, image processor) and the training arguments. trainbus writes the same folder,
without pickle: the training arguments are ``training_args.json``, not ``training_args.bin``.
The checkpoint's own weights file keeps the module's parameter names, which ``from_pretrained``
loads as they are.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..checkpoints.frozen import adapter_model
from .loss_protocol import unwrap_model

TRAINING_ARGS = "training_args.json"


def write_config_files(model: Any, directory: Path) -> None:
    """``config.json`` (and ``generation_config.json`` when the model generates) of a transformers model."""
    model = unwrap_model(model)
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    # as save_pretrained records them: the class, and the weights' dtype as a string
    config.architectures = [type(model).__name__]
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", str(dtype).split(".")[1])
    config.save_pretrained(directory)
    can_generate = getattr(model, "can_generate", None)
    generation_config = getattr(model, "generation_config", None)
    if callable(can_generate) and can_generate() and generation_config is not None:
        generation_config.save_pretrained(directory)


def write_processing_files(processing_class: Any, directory: Path) -> None:
    """The tokenizer's / image processor's files (its ``save_pretrained``), when there is one."""
    if processing_class is not None and callable(getattr(processing_class, "save_pretrained", None)):
        processing_class.save_pretrained(str(directory))


def write_training_args(args: Any, directory: Path) -> None:
    """The run's TrainingArguments as JSON (transformers pickles them into ``training_args.bin``)."""
    (Path(directory) / TRAINING_ARGS).write_text(args.to_json_string() + "\n", encoding="utf-8")


def align_special_tokens(model: Any, processing_class: Any) -> None:
    """The installed transformers' own alignment of the config's pad / bos / eos ids with a tokenizer's, at train().

    A tokenizer may define new special tokens for fine-tuning; transformers' Trainer copies its ids into
    ``model.config`` and ``model.generation_config`` before training, so the saved config.json carries them.
    Each release does it its own way (4.57 - 5.0 in ``Trainer._align_special_tokens``, which reads only
    ``self.model`` and ``self.processing_class``; newer ones in ``trainer_utils.align_special_tokens``, on the
    text config): the installed one's code runs, so a port gets what its transformers gives, and nothing
    where its release has no alignment.
    """
    model = unwrap_model(model)
    if processing_class is None or getattr(model, "config", None) is None:
        return
    try:
        from transformers import trainer_utils
        from transformers.processing_utils import ProcessorMixin
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return
    if not isinstance(processing_class, PreTrainedTokenizerBase | ProcessorMixin):
        return  # an image processor / feature extractor: transformers aligns nothing either
    align = getattr(trainer_utils, "align_special_tokens", None)
    if align is not None:
        align(model, processing_class)
        return
    from transformers.trainer import Trainer as HFTrainer

    method = getattr(HFTrainer, "_align_special_tokens", None)
    if method is not None:  # the release's method, on a stand-in Trainer holding what it reads
        method(SimpleNamespace(model=model, processing_class=processing_class))


def applies_use_cache() -> bool:
    """Whether the installed transformers' Trainer sets ``model.config.use_cache`` from its arguments (5.x does).

    A port behaves as the transformers it runs beside: under 4.x the config (and config.json) keeps its value.
    """
    try:
        from transformers import TrainingArguments as HFArguments
    except ImportError:
        return True
    return "use_cache" in getattr(HFArguments, "__dataclass_fields__", {})


def checkpoint_extras(trainer: Any) -> Any:
    """``fn(directory)`` writing a checkpoint's model-folder files, for the Checkpointing plugin.

    When the Trainer's class overrides ``save_model`` or ``_save`` it writes the whole model part instead
    (``fn.saves_model``): ``save_model(directory, _internal_call=True)``, as transformers' checkpoint calls it.
    """

    def write(directory: Path) -> None:
        if saves_model:
            trainer.save_model(str(directory), _internal_call=True)
        else:
            write_folder_files(trainer, directory)

    saves_model = trainer.overrides("save_model") or trainer.overrides("_save")
    write.saves_model = saves_model  # type: ignore[attr-defined]
    return write


def write_folder_files(trainer: Any, directory: Path) -> None:
    """config.json (not an adapter model's: it would load a random base), the processing files, training_args.json."""
    if adapter_model(trainer.model) is None:
        write_config_files(trainer.model, directory)
    write_processing_files(processing_class_to_save(trainer), directory)
    write_training_args(trainer.args, directory)


def processing_class_to_save(trainer: Any) -> Any:
    """What saves the processing files: the processing class, else the collator's tokenizer (HF's ``_save``).

    A script that gives its tokenizer only to the collator (``DataCollatorForLanguageModeling(tokenizer)``)
    still gets a model folder with the tokenizer in it.
    """
    if trainer.processing_class is not None:
        return trainer.processing_class
    return getattr(getattr(trainer, "data_collator", None), "tokenizer", None)
