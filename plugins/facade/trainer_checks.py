"""Checks and error messages of the Trainer facade, kept out of ``trainer.py``.

The engine's messages speak the engine's language (``Engine(..., loss_fn=...)``); a Trainer user has
no ``loss_fn`` to pass, so the Trainer's path re-words them in transformers' terms: make the model
return a loss, pass ``compute_loss_func``, or override ``compute_loss``.

A mistake raises the exception type transformers raises for it (a ported ``except RuntimeError`` still
catches it), as a ``ConfigError`` subclass (``trainbus.engine.errors``), so it is also a ``ValueError``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch

from trainbus.engine import ConfigError
from trainbus.engine.errors import ConfigRuntimeError, ConfigTypeError
from trainbus.hooks import loss_from_outputs as engine_loss_from_outputs


def check_model(model: Any) -> None:
    """The Trainer's model must be a ``torch.nn.Module`` (``model='x'`` failed as ``'str' has no attribute 'to'``)."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"Trainer: model must be a torch.nn.Module (e.g. a transformers PreTrainedModel), got {model!r} "
            f"({type(model).__name__}); to load one by name use AutoModelFor...from_pretrained(name)"
        )


def check_trainer_arguments(
    model: Any,
    model_init: Any,
    optimizers: tuple[Any, Any],
    optimizer_cls_and_kwargs: Any,
    data_collator: Any,
) -> None:
    """The ``Trainer.__init__`` checks transformers 5 makes, each raising transformers' exception type.

    A model or a ``model_init`` (RuntimeError when neither, ValueError when both); ``optimizers`` not
    with ``optimizer_cls_and_kwargs`` nor with ``model_init`` (RuntimeError: a new model each train()
    would leave the given optimizer on the old one's parameters); a collator that is a callable
    (TypeError for an object with only the old ``collate_batch`` method).
    """
    if model is None and model_init is None:
        raise ConfigRuntimeError("Trainer requires either a `model` or `model_init` argument; got neither")
    if model is not None and model_init is not None:
        raise ConfigError(
            "Trainer requires either a `model` or `model_init` argument, but not both: model_init would replace "
            "the model at train(); pass one of them"
        )
    optimizer, scheduler = check_optimizers(optimizers)
    if optimizer_cls_and_kwargs is not None and optimizer is not None:
        raise ConfigRuntimeError(
            "Passing both `optimizers` and `optimizer_cls_and_kwargs` arguments is incompatible: pass "
            "optimizers=(optimizer, scheduler) or optimizer_cls_and_kwargs=(cls, kwargs), not both"
        )
    if model_init is not None and (optimizer is not None or scheduler is not None):
        raise ConfigRuntimeError(
            "Passing a `model_init` is incompatible with providing the `optimizers` argument (each train() builds "
            "a new model): subclass Trainer and override create_optimizer_and_scheduler"
        )
    if data_collator is not None and not callable(data_collator):
        raise ConfigTypeError(
            f"data_collator must be a callable (a function, or an object with __call__), got "
            f"{type(data_collator).__name__}"
            + (" (its collate_batch method is the old interface: pass it as the callable)"
               if callable(getattr(data_collator, "collate_batch", None)) else "")
        )  # fmt: skip


def check_optimizers(optimizers: Any) -> tuple[Any, Any]:
    """``optimizers=(optimizer, scheduler)``: a pair, each None or the object itself, not its name.

    An optimizer is what training calls: ``step()``, ``zero_grad()`` and ``param_groups`` (a torch
    optimizer or a wrapper of one); a scheduler has ``step()``. HF takes any pair and fails at the first
    step (``'str' object has no attribute 'zero_grad'``); names belong in ``TrainingArguments(optim=...,
    lr_scheduler_type=...)``.
    """
    if not isinstance(optimizers, tuple | list) or len(optimizers) != 2:
        raise ConfigTypeError(
            f"optimizers must be a pair (optimizer, scheduler), each None to build it from the arguments, got "
            f"{optimizers!r}"
        )
    optimizer, scheduler = optimizers
    is_optimizer = all(callable(getattr(optimizer, m, None)) for m in ("step", "zero_grad")) and hasattr(
        optimizer, "param_groups"
    )
    if optimizer is not None and not is_optimizer:
        raise ConfigTypeError(
            f"optimizers[0] must be a torch.optim.Optimizer (or None: built from args.optim), got {optimizer!r} "
            f"({type(optimizer).__name__})"
            + ("; to choose one by name set TrainingArguments(optim=...)" if isinstance(optimizer, str) else "")
        )
    if scheduler is not None and not isinstance(scheduler, str) and not callable(getattr(scheduler, "step", None)):
        raise ConfigTypeError(
            f"optimizers[1] must be a learning-rate scheduler with a step() method (e.g. torch.optim.lr_scheduler."
            f"LambdaLR), a scheduler name, or None; got {scheduler!r} ({type(scheduler).__name__})"
        )
    return optimizer, scheduler


def check_eval_set(eval_dataset: Any) -> None:
    """An eval set, or each of a dict of them, with at least one sample when its length is known.

    An empty one failed only at the first evaluation, mid-training ("evaluation needs at least one batch").
    """
    named = eval_dataset.items() if isinstance(eval_dataset, Mapping) else [(None, eval_dataset)]
    for name, dataset in named:
        if dataset is None or not hasattr(dataset, "__len__"):
            continue
        if len(dataset) == 0:
            which = "eval_dataset" if name is None else f"eval_dataset[{name!r}]"
            raise ConfigError(f"{which} is empty (length 0): evaluation needs at least one sample")


def model_from_init(model_init: Callable[..., Any], trial: Any = None) -> Any:
    """HF's ``call_model_init``: ``model_init()`` or ``model_init(trial)`` by its number of parameters.

    A function of more parameters, or one that returns None, raises RuntimeError as in transformers; a
    class is called without the trial.
    """
    if isinstance(model_init, type):
        count = 0
    else:
        try:
            count = len(inspect.signature(model_init).parameters)
        except (TypeError, ValueError) as exc:  # not a function at all
            raise ConfigTypeError(f"model_init must be a function, got {model_init!r}") from exc
    if count > 1:
        raise ConfigRuntimeError(
            f"model_init should have 0 or 1 argument (the hyperparameter-search trial), got {count}: {model_init!r}"
        )
    model = model_init(trial) if count == 1 else model_init()
    if model is None:
        raise ConfigRuntimeError(f"model_init should not return None; {model_init!r} did")
    return model


def check_train_kwargs(kwargs: Mapping[str, Any], handled: Collection[str] = ()) -> None:
    """``train()``'s keyword arguments besides ``resume_from_checkpoint``.

    A name HF's ``train`` does not take is a TypeError, as Python raises for HF's signature (and 4.x's
    ``**kwargs`` check). HF's ``trial`` and ``ignore_keys_for_eval`` pass when the caller ``handled``
    them or when they are None; otherwise they are a ConfigError saying so.
    """
    unknown = sorted(set(kwargs) - set(HF_TRAIN_KWARGS))
    if unknown:
        raise ConfigTypeError(
            f"train() got unexpected keyword arguments {unknown}; it takes resume_from_checkpoint, "
            + ", ".join(HF_TRAIN_KWARGS)
        )
    unhandled = sorted(k for k, v in kwargs.items() if k not in handled and v is not None)
    if unhandled:
        raise ConfigError(f"train(): trainbus does not take {unhandled} here (leave them None)")


#: HF ``Trainer.train``'s keyword arguments after ``resume_from_checkpoint``
HF_TRAIN_KWARGS = ("trial", "ignore_keys_for_eval")


def loss_from_outputs(outputs: Any, batch: Any = None) -> torch.Tensor:
    """The engine's ``loss_from_outputs``, with an error that tells a Trainer user what to do."""
    try:
        loss: torch.Tensor = engine_loss_from_outputs(outputs)
    except ValueError:
        raise ConfigError(no_loss_message(outputs, batch)) from None
    return loss


def compute_loss(outputs: Any, batch: Any) -> torch.Tensor:
    """The Trainer's default ``compute_loss`` hook: the loss the model returned, as transformers' Trainer takes it.

    As deep as the engine's default (one frame above ``loss_from_outputs``): it runs every micro-batch.
    """
    try:
        return engine_loss_from_outputs(outputs)
    except ValueError:
        raise ConfigError(no_loss_message(outputs, batch)) from None


def no_loss_message(outputs: Any, batch: Any) -> str:
    """Why the model's outputs hold no loss, and the Trainer's three ways to get one."""
    loss = _named_loss(outputs)
    if isinstance(loss, torch.Tensor) and loss.dim() != 0:
        return (
            f"the model returned a loss of shape {tuple(loss.shape)}, not one number: training needs one number "
            "per batch to call backward() on. A loss per sample (reduction='none') must be reduced, e.g. "
            "loss.mean() in the model, or pass Trainer(..., compute_loss_func=fn) returning a scalar"
        )
    got = type(outputs).__name__
    if isinstance(outputs, Mapping):
        got += f" with keys {sorted(map(str, outputs))}"
    why = ""
    if isinstance(batch, list | tuple) and not hasattr(batch, "_fields"):
        why = (
            " The batches are tuples, so the model was called with the inputs only and could not compute a loss"
            " from labels; a dataset of dicts such as {'input_ids': ..., 'labels': ...} calls model(**batch)."
        )
    return (
        f"the model returned no loss (looked at .loss, ['loss'], [0] and a scalar tensor; got {got}).{why} "
        "The Trainer takes the loss from the model's outputs, as transformers' does: make the model return a loss "
        "when it gets labels, pass Trainer(..., compute_loss_func=fn) with fn(outputs, labels, num_items_in_batch) "
        "-> loss, or subclass Trainer and override compute_loss"
    )


def _named_loss(outputs: Any) -> Any:
    """What the model put under ``loss`` (attribute or key), whatever its shape."""
    loss = getattr(outputs, "loss", None)
    if loss is None and isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    return loss
