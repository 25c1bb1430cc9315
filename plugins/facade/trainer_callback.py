"""HF's ``TrainerCallback`` base class and the callback events it names (``callbacks.py`` re-exports both)."""

from __future__ import annotations

from typing import Any

CALLBACK_EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_substep_end",
    "on_step_end",
    "on_evaluate",
    "on_predict",
    "on_save",
    "on_log",
    "on_prediction_step",
)


class TrainerCallback:
    """Base class of HF-style callbacks: every ``on_*`` method does nothing; override the ones you need.

    Each method gets ``(args, state, control, **kwargs)`` and may change ``control`` (or return it).

    Example:
        >>> class StopAtStep3(TrainerCallback):
        ...     def on_step_end(self, args, state, control, **kwargs):
        ...         if state.global_step == 3:
        ...             control.should_training_stop = True
    """

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """At the end of the Trainer's ``__init__``."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """At the beginning of training."""

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """At the end of training."""

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """At the beginning of an epoch."""

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """At the end of an epoch."""

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """At the beginning of an optimizer step (a window of accumulated micro-batches)."""

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """After gradient clipping, before the optimizer steps."""

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """After the optimizer step, before the gradients are zeroed."""

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """After each micro-batch of a window but the last."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """At the end of an optimizer step."""

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """After an evaluation (kwargs: metrics)."""

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any, **kwargs: Any) -> Any:
        """After a successful prediction."""

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """After a checkpoint save."""

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """After logging (kwargs: logs)."""

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """After each evaluation / prediction batch."""

    def on_push_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Before a push to the Hub (trainbus never pushes; a script's handler.on_push_begin calls it)."""
