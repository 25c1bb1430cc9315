"""``Trainer.save_model`` and ``_save``: the final model folder, with the weights the plugins say to save, and a
checkpoint's model folder when a subclass overrides either (``checkpoint_methods.py``).

The save-model protocol: a plugin may offer ``weights_to_save(engine) -> context manager | None``;
``save_model`` enters every context offered (in attach order) around writing the weights, so a
plugin can put other weights in the model while it is saved (EMA swaps its averages in when
``save_averaged``) and take them out after. The facade knows no plugin by type.

The processing files come from the processing class, else from the collator's tokenizer, as
transformers' ``Trainer._save`` takes them (``processing_class_to_save``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..checkpoints import checkpoint as ckpt
from ..checkpoints import io as cio
from ..checkpoints.model_part import WEIGHTS, ModelPart, active_part
from ..checkpoints.sharded import saved_by_every_rank
from ..checkpoints.sharded_save import save_full_model
from ..distributed.processes import barrier
from .loss_protocol import unwrap_model
from .model_folder import processing_class_to_save, write_folder_files, write_processing_files, write_training_args


def weights_to_save(engine: Any) -> contextlib.ExitStack[Any]:
    """One context holding every plugin's ``weights_to_save(engine)`` offer (the save-model protocol)."""
    stack = contextlib.ExitStack()
    try:
        for plugin in engine.plugins:
            offer = getattr(plugin, "weights_to_save", None)
            context = offer(engine) if callable(offer) else None
            if context is not None:
                stack.enter_context(context)
    except BaseException:
        stack.close()
        raise
    return stack


def save_model(trainer: Any, output_dir: str | None = None) -> None:
    """HF's ``save_model``: ``trainer._save(output_dir)`` (a loadable model, its processing files and
    training_args.json; a sharded model gathered first); the main process writes, every rank returns once
    the model is on disk. Into a checkpoint being written (``_internal_call``): its model part, on the main
    process only. Like transformers', it writes no model card (``create_model_card`` does)."""
    args = trainer.args
    directory = output_dir or args.output_dir
    if active_part(directory) is not None:  # the checkpoint's model folder: the main process alone writes it
        trainer._save(directory)
        return
    try:
        if saved_by_every_rank(trainer.model):  # FSDP / ZeRO-3: every rank sends its part, the main one writes
            save_full_model(trainer.model, directory, write=args.should_save)
            if args.should_save:
                write_processing_files(processing_class_to_save(trainer), Path(directory))
                write_training_args(args, Path(directory))  # HF's training_args.bin, as JSON
        else:
            trainer._save(directory)
    finally:
        barrier()


def save_to_folder(trainer: Any, directory: str | Path, state_dict: Mapping[str, Any] | None) -> None:
    """HF's ``_save`` outside a checkpoint: the model (``state_dict`` where given; the plugins' weights to
    save otherwise), its processing files and the training arguments, from the main process."""
    args = trainer.args
    if not args.should_save:
        return
    with weights_to_save(trainer):
        ckpt.save_model(trainer.model, directory, state_dict=state_dict)
    write_processing_files(processing_class_to_save(trainer), Path(directory))
    write_training_args(args, Path(directory))  # HF's training_args.bin, as JSON


def save_into_checkpoint(trainer: Any, part: ModelPart, state_dict: Mapping[str, Any] | None) -> None:
    """HF's ``_save`` into a checkpoint being written: trainbus's weights (which the resume reads), or the
    ``state_dict`` an override gives (then the resume reads trainbus's own copy: ``model_part.py``), and the
    model folder's files."""
    if state_dict is None:
        part.write_weights()
    else:
        model = unwrap_model(trainer.model)
        if callable(getattr(model, "save_pretrained", None)):  # as transformers' _save: the model's own, those tensors
            ckpt.save_model(model, part.directory, state_dict=state_dict)
        else:
            cio.write_tensors(part.directory / WEIGHTS, state_dict)
    write_folder_files(trainer, part.directory)
