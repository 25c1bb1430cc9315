"""HF's ``debug="underflow_overflow"``: transformers' ``DebugUnderflowOverflow`` traces every module's activations.

``DebugUnderflowOverflow`` (``transformers.debug_utils``) puts a forward hook on every module; each hook records the
abs min / max of the module's weights, inputs and outputs, and at the first inf / nan prints the last frames (where
the values started to blow up) and raises ``ValueError``. It reads every traced tensor on the host: a debugging tool,
not for production runs. HF's Trainer attaches it to the model at the start of ``train()``; so does this plugin (once
per model; its hooks then see evaluation forwards too, as in HF), and detaching the plugin removes the hooks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import suggest

if TYPE_CHECKING:
    from trainbus.engine import Engine
    from trainbus.engine.events import TrainStartEvent


@functools.cache
def _tracer_type() -> type[Any]:
    try:
        from transformers.debug_utils import DebugUnderflowOverflow
    except ImportError as err:
        raise ConfigError(
            "debug='underflow_overflow' uses transformers' DebugUnderflowOverflow; install transformers"
        ) from err

    class Tracer(DebugUnderflowOverflow):  # type: ignore[misc]
        """HF's tracer, keeping the handles of the hooks it registers so they can be removed."""

        def register_forward_hook(self) -> None:
            self.handles: list[Any] = []
            self.model.apply(lambda module: self.handles.append(module.register_forward_hook(self.forward_hook)))

    return Tracer


class UnderflowOverflowDebug(Plugin):
    """Attach ``transformers.debug_utils.DebugUnderflowOverflow`` to the model at TRAIN_START.

    Args (passed to ``DebugUnderflowOverflow``):
        max_frames_to_save: how many module frames to print before the one that overflowed.
        trace_batch_nums: batch numbers whose every frame is printed (detection is off for them).
        abort_after_batch_num: raise after this batch number has finished.

    Attributes:
        tracer: the ``DebugUnderflowOverflow`` in use (None before the first TRAIN_START).

    Example:
        >>> plugin = UnderflowOverflowDebug(max_frames_to_save=5)
    """

    priority = Priority.FIRST  # hooks in place before any forward of the run

    def __init__(
        self,
        max_frames_to_save: int = 21,
        trace_batch_nums: list[int] | None = None,
        abort_after_batch_num: int | None = None,
    ) -> None:
        if isinstance(max_frames_to_save, bool) or not isinstance(max_frames_to_save, int) or max_frames_to_save < 1:
            raise ConfigError(f"max_frames_to_save must be an integer >= 1, got {max_frames_to_save!r}")
        if abort_after_batch_num is not None and (
            isinstance(abort_after_batch_num, bool)
            or not isinstance(abort_after_batch_num, int)
            or abort_after_batch_num < 0
        ):
            raise ConfigError(f"abort_after_batch_num must be an integer >= 0 or None, got {abort_after_batch_num!r}")
        self._type = _tracer_type()  # fails here, at construction, when transformers is missing
        self.max_frames_to_save = max_frames_to_save
        if trace_batch_nums is not None and (
            isinstance(trace_batch_nums, str | int) or not isinstance(trace_batch_nums, Iterable)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in trace_batch_nums)
        ):  # fmt: skip
            raise ConfigError(
                f"trace_batch_nums must be a list of batch numbers (ints >= 0) or None, got {trace_batch_nums!r}"
            )
        self.trace_batch_nums = list(trace_batch_nums or [])
        self.abort_after_batch_num = abort_after_batch_num
        self.tracer: Any = None

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_START, self.train_start)

    def train_start(self, ev: TrainStartEvent) -> None:
        model = ev.engine.model
        if self.tracer is not None and self.tracer.model is model:
            return
        self._remove_hooks()
        self.tracer = self._type(model, self.max_frames_to_save, self.trace_batch_nums, self.abort_after_batch_num)

    def detach(self, engine: Engine) -> None:
        super().detach(engine)
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        for handle in getattr(self.tracer, "handles", []):
            handle.remove()
        self.tracer = None


#: HF's ``DebugOption`` values
DEBUG_OPTIONS = ("underflow_overflow", "tpu_metrics_debug")


def parse_debug_options(value: Any) -> list[str]:
    """HF's ``TrainingArguments.debug`` as HF parses it: a space-separated string or a list -> a list of options.

    The values are plain strings; HF's ``DebugOption`` is a ``str`` enum, so ``DebugOption.X in args.debug`` holds.
    """
    if value is None:
        return []
    items = value.split() if isinstance(value, str) else list(value)
    options = [str(getattr(item, "value", item)) for item in items]
    for option in options:
        if option == "tpu_metrics_debug":
            raise ConfigError("debug='tpu_metrics_debug' prints TPU (torch_xla) metrics; trainbus does not run on TPUs")
        if option not in DEBUG_OPTIONS:
            raise ConfigError(
                f"debug: unknown option {option!r}{suggest(option, DEBUG_OPTIONS)}; allowed: 'underflow_overflow' "
                "(a space-separated string or a list)"
            )
    return options
