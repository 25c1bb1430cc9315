"""HF ``CallbackHandler``'s methods on the ``CallbackAdapter``, for subclasses that call them.

transformers' example trainers end their own ``evaluate()`` with
``self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)``;
every ``on_*`` of HF's handler is here with its signature, and returns the engine's control.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trainbus.engine.state import CONTROL_FLAGS


class CallbackHandlerMethods:
    """``fire`` and HF's handler attributes (a mixin of ``CallbackAdapter``, which gives ``call_event``)."""

    _engine: Any
    call_event: Any

    def fire(self, event: str, control: Any, **kwargs: Any) -> Any:
        """Call ``event`` on every callback and return the engine's control (HF's ``call_event``).

        A control object of the caller's that is not the engine's has its flags copied in first, so
        ``self.control = self.callback_handler.on_evaluate(...)`` keeps the control the engine reads.
        """
        engine = self._engine
        if engine is None:
            raise RuntimeError(f"callback_handler.{event}: the callbacks are not attached to a Trainer yet")
        if control is not None and control is not engine.control:
            for flag in CONTROL_FLAGS:
                if hasattr(control, flag):
                    setattr(engine.control, flag, bool(getattr(control, flag)))
        self.call_event(event, engine, **kwargs)
        return engine.control

    @property
    def model(self) -> Any:
        return None if self._engine is None else self._engine.model

    @property
    def optimizer(self) -> Any:
        return None if self._engine is None else self._engine.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return None if self._engine is None else lr_scheduler_of(self._engine)

    @property
    def train_dataloader(self) -> Any:
        return None if self._engine is None else self._engine.train_data



def lr_scheduler_of(engine: Any) -> Any:
    for plugin in engine.plugins:
        scheduler = getattr(plugin, "scheduler", None)
        if scheduler is not None and hasattr(scheduler, "step") and hasattr(scheduler, "state_dict"):
            return scheduler
    return None


def _handler_method(event: str, payload: str | None) -> Any:
    """HF's ``CallbackHandler.<event>(args, state, control[, metrics | logs])``, returning the control."""

    def method(self: Any, args: Any, state: Any, control: Any, *extra: Any, **kwargs: Any) -> Any:
        if extra and payload is not None:
            kwargs[payload] = extra[0]
        return self.fire(event, control, **kwargs)

    method.__name__ = event
    method.__doc__ = f"Call ``{event}`` on every callback (HF's CallbackHandler); returns the control."
    return method


_PAYLOAD_ARGUMENT_OF = {"on_evaluate": "metrics", "on_predict": "metrics", "on_log": "logs"}


def install_handler_methods(cls: type, events: Iterable[str]) -> None:
    """Give ``cls`` one HF handler method per callback event."""
    for event in events:
        setattr(cls, event, _handler_method(event, _PAYLOAD_ARGUMENT_OF.get(event)))
