"""``Trainer.save_model``: the final model folder, with the weights the plugins say to save.

The save-model protocol: a plugin may offer ``weights_to_save(engine) -> context manager | None``;
``save_model`` enters every context offered (in attach order) around writing the weights, so a
plugin can put other weights in the model while it is saved (EMA swaps its averages in when
``save_averaged``) and take them out after. The facade knows no plugin by type.

The processing files come from the processing class, else from the collator's tokenizer, as
transformers' ``Trainer._save`` takes them (``processing_class_to_save``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from ..checkpoints import checkpoint as ckpt
from ..checkpoints.sharded import saved_by_every_rank
from ..checkpoints.sharded_save import save_full_model
from ..distributed.processes import barrier
from .model_card import write_model_card
from .model_folder import processing_class_to_save, write_processing_files, write_training_args


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
    """HF's ``save_model``: a loadable model (``save_pretrained`` for HF models), its processing files,
    training_args.json and model card in ``output_dir``; the main process writes, every rank returns
    once the model is on disk."""
    args = trainer.args
    directory = output_dir or args.output_dir
    try:
        if saved_by_every_rank(trainer.model):  # FSDP / ZeRO-3: every rank sends its part, the main one writes
            save_full_model(trainer.model, directory, write=args.should_save)
        elif args.should_save:
            with weights_to_save(trainer):
                ckpt.save_model(trainer.model, directory)
        if args.should_save:
            write_processing_files(processing_class_to_save(trainer), Path(directory))
            write_training_args(args, Path(directory))  # HF's training_args.bin, as JSON
            write_model_card(trainer, output_dir)  # README.md next to the model (peft's metadata kept)
    finally:
        barrier()
