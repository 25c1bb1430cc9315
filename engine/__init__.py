"""trainbus.engine: the event bus, the loop, State and Control. Knows no feature.

Public API::

    from trainbus.engine import Engine, Event, Plugin, Priority, State, Control
"""

from .assembly import UnknownPluginError
from .bus import EventBus, Handle, Priority
from .errors import HANDLER_ERROR_GONE, ConfigError, TrainbusError, _HandlerError
from .events import (
    BackwardEndEvent,
    BatchStartEvent,
    BeforeOptimizerStepEvent,
    EpochEndEvent,
    EpochStartEvent,
    EvalBatchEndEvent,
    EvalEndEvent,
    EvalStartEvent,
    Event,
    EventType,
    ExceptionEvent,
    FilteredEvent,
    LogEvent,
    LossEvent,
    OptimizerStepEvent,
    Payload,
    PredictBatchEndEvent,
    PredictEndEvent,
    PredictStartEvent,
    SaveEvent,
    StepEndEvent,
    StepStartEvent,
    TrainEndEvent,
    TrainStartEvent,
)
from .filters import EventFilter
from .loop import Engine, data_length
from .plugin import Composition, CompositionWarning, Plugin
from .state import Control, State

__all__ = [
    "BackwardEndEvent",
    "BatchStartEvent",
    "BeforeOptimizerStepEvent",
    "Composition",
    "CompositionWarning",
    "ConfigError",
    "Control",
    "Engine",
    "EpochEndEvent",
    "EpochStartEvent",
    "EvalBatchEndEvent",
    "EvalEndEvent",
    "EvalStartEvent",
    "Event",
    "EventBus",
    "EventFilter",
    "EventType",
    "ExceptionEvent",
    "FilteredEvent",
    "Handle",
    "LogEvent",
    "LossEvent",
    "OptimizerStepEvent",
    "Payload",
    "Plugin",
    "PredictBatchEndEvent",
    "PredictEndEvent",
    "PredictStartEvent",
    "Priority",
    "SaveEvent",
    "State",
    "StepEndEvent",
    "StepStartEvent",
    "TrainEndEvent",
    "TrainStartEvent",
    "TrainbusError",
    "UnknownPluginError",
    "data_length",
]


def __getattr__(name: str) -> object:  # PEP 562: the deprecated HandlerError warns when used
    if name == "HandlerError":
        import warnings

        warnings.warn(HANDLER_ERROR_GONE, DeprecationWarning, stacklevel=2)
        return _HandlerError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
