"""What the installed transformers release does where releases differ: the port's tests compare trainbus with it.

CI runs the port's tests on the oldest supported transformers (4.57), on 5.0 and on the newest. Where the
reference itself changed between those releases, a test must know which value the installed one gives.
Each fact but the first is asked of the installed release's own code (a probe), not read from a version
table, so a release that changes it is seen as it is:

- ``ROUNDS_LOGGED_LOSS``: 4.x logs ``round(loss, 4)``, 5 logs the loss whole (trainbus: whole); the
  rounding sits inside the training loop, where no probe reaches, so the major version says it.
- ``evaluates_after_last_step()``: newer releases evaluate after the last step when ``eval_strategy="steps"``
  and it is no multiple of ``eval_steps``; 4.57 - 5.0 do not (trainbus does). ``newest_flow(trainer)`` adds
  that evaluation to a transformers Trainer of those releases, for comparing whole runs.
- ``save_best_records_its_checkpoint()``: under ``save_strategy="best"``, newer releases (and trainbus)
  record ``best_global_step`` / ``best_model_checkpoint``; 4.57 - 5.0 leave them None.
- ``epoch_before_training()``: a Trainer's ``state.epoch`` before ``train()`` (None in 4.57 - 5.0, so
  ``evaluate()`` before training has no ``epoch`` key; 0 in newer ones, as trainbus).
- ``hf_item_count(model, labels)``: the ``num_items_in_batch`` transformers' Trainer counts for ``model``:
  4.57 - 5.0 count a causal LM's labels unshifted (one item per sequence too many); newer ones shift
  them for models whose ``loss_type`` is the causal one (Llama; not GPT-2, whose ``loss_type`` is None).
- ``hf_accepts_loss_kwargs(model)``: whether its Trainer leaves the division by the accumulation steps to
  the model (which a ``**kwargs`` forward that ignores the count never does).
"""

from __future__ import annotations

import functools
import math
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch
import transformers

from trainbus.plugins.facade import release

VERSION = transformers.__version__
RELEASE = release(VERSION)
#: transformers 4.x rounds the logged step loss to 4 decimals: a logged value is within this of the true one
ROUNDS_LOGGED_LOSS = RELEASE < (5, 0, 0)
ROUNDING = 5e-5


def is_rounded(value: Any) -> bool:
    """Whether ``value`` is a loss as 4.x logs it (4 decimals): compare it within ``ROUNDING``."""
    return ROUNDS_LOGGED_LOSS and isinstance(value, float) and math.isfinite(value) and round(value, 4) == value


def loss_tolerance(expected: Any) -> float:
    """The absolute tolerance a logged ``loss`` needs beside the relative one: the rounding, where transformers
    rounded it (trainbus logs it whole)."""
    return ROUNDING if is_rounded(expected) else 0.0


def evaluates_after_last_step() -> bool:
    """Whether the installed release evaluates after the last step of a run evaluating every 5 steps."""
    return EVALUATES_AFTER_LAST_STEP


def _evaluates_after_last_step() -> bool:
    """The installed DefaultFlowCallback's decision at the last step (7) of a run evaluating every 5 steps.

    Asked once, at import: a TrainingArguments made between building a Trainer and its train() resets
    accelerate's state under 4.57, which that Trainer then lacks.
    """
    from transformers import TrainerControl, TrainerState
    from transformers.trainer_callback import DefaultFlowCallback

    with tempfile.TemporaryDirectory() as directory:
        args = _arguments(directory, eval_strategy="steps", eval_steps=5)
    state = TrainerState(global_step=7, max_steps=7, eval_steps=5, logging_steps=500, save_steps=500)
    control = DefaultFlowCallback().on_step_end(args, state, TrainerControl())
    return bool(control.should_evaluate)


class LastStepEvaluation(transformers.TrainerCallback):
    """The newest release's evaluation after the last step, for transformers 4.57 - 5.0 (which have none): a
    whole run compared with trainbus, which evaluates there, evaluates at the same steps."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if (
            state.global_step >= state.max_steps
            and args.eval_strategy == "steps"
            and state.global_step % state.eval_steps != 0
            and args.eval_delay <= state.global_step
        ):
            control.should_evaluate = True
        return control


def newest_flow(trainer: Any) -> Any:
    """``trainer`` (a transformers Trainer) evaluating after the last step where its release does not."""
    if not evaluates_after_last_step():
        trainer.add_callback(LastStepEvaluation())
    return trainer


@functools.cache
def save_best_records_its_checkpoint() -> bool:
    """Whether ``save_strategy="best"`` records ``state.best_global_step`` at a new best metric (and so
    ``best_model_checkpoint`` at the save), as newer releases do; 4.57 - 5.0 record neither.

    Asked of the installed ``Trainer._determine_best_metric``, on a stand-in holding what it reads.
    """
    from transformers import Trainer
    from transformers.trainer_utils import SaveStrategy

    args = SimpleNamespace(metric_for_best_model="accuracy", greater_is_better=True, save_strategy=SaveStrategy.BEST)
    state = SimpleNamespace(best_metric=None, global_step=3, best_global_step=None)
    Trainer._determine_best_metric(SimpleNamespace(args=args, state=state), {"eval_accuracy": 1.0}, None)
    return state.best_global_step == 3


def epoch_before_training() -> float | None:
    """``TrainerState().epoch``: what a Trainer's state says before any training."""
    from transformers import TrainerState

    return TrainerState().epoch


def hf_item_count(model: Any, labels: torch.Tensor) -> int:
    """The ``num_items_in_batch`` the installed Trainer counts for ``model`` in a window of one batch of ``labels``."""
    return int(_ask_hf_trainer(model, lambda t: t._get_num_items_in_batch([{"labels": labels}], torch.device("cpu"))))


def hf_accepts_loss_kwargs(model: Any) -> bool:
    """Whether the installed Trainer passes ``model`` the window's item count and so does not divide its loss
    by the accumulation steps (4.57's BERT heads take no ``**kwargs``: no; 5's do: yes)."""
    return bool(_ask_hf_trainer(model, lambda t: t.model_accepts_loss_kwargs))


def _ask_hf_trainer(model: Any, question: Any) -> Any:
    from transformers import Trainer

    with tempfile.TemporaryDirectory() as directory:
        return question(Trainer(model=model, args=_arguments(directory)))


def hf_counts_unshifted(model: Any) -> bool:
    """Whether transformers counts every label of ``model``'s sequences, the first one included."""
    labels = torch.tensor([[1, 2, 3, -100]])
    return hf_item_count(model, labels) == 3


@contextmanager
def hf_counting_shifted_labels() -> Iterator[None]:
    """transformers' Trainer counting ``labels[..., 1:]``, what a causal LM's loss averages over (the
    correction of its count, for comparing a whole run; the tests pin the true value independently)."""
    from transformers import Trainer

    count = Trainer._get_num_items_in_batch

    def shifted(self: Any, batch_samples: list, device: torch.device) -> Any:
        batches = [{**b, "labels": b["labels"][..., 1:]} if "labels" in b else b for b in batch_samples]
        return count(self, batches, device)

    Trainer._get_num_items_in_batch = shifted
    try:
        yield
    finally:
        Trainer._get_num_items_in_batch = count


def _arguments(output_dir: str, **kwargs: Any) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=output_dir, use_cpu=True, report_to="none", disable_tqdm=True, **kwargs)


#: the flow is asked once, at import (see _evaluates_after_last_step)
EVALUATES_AFTER_LAST_STEP = _evaluates_after_last_step()
