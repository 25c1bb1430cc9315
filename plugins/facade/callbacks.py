"""HF ``TrainerCallback`` compatibility: callbacks written for transformers run unchanged.

``CallbackAdapter`` is a plugin that calls HF-style callbacks at the HF-equivalent events, with
HF's arguments ``(args, state, control, **kwargs)`` and kwargs (model, processing_class, optimizer,
lr_scheduler, train_dataloader, eval_dataloader, plus metrics / logs). ``state`` and ``control`` are
the engine's own State and Control, which carry HF's attribute names; a control object a callback
returns is honoured. Where the events fire::

    on_init_end            end of Trainer.__init__
    on_train_begin         TRAIN_START               on_epoch_begin      EPOCH_START
    on_step_begin          STEP_START                on_substep_end      BACKWARD_END (not the last micro-batch)
    on_pre_optimizer_step  BEFORE_OPTIMIZER_STEP (after clipping)
    on_optimizer_step      OPTIMIZER_STEP (or STEP_END when the step was skipped, as HF calls it anyway)
    on_step_end            STEP_END (after FlowControl set the flags)
    on_log                 LOG (after state.log_history got the record)
    on_prediction_step     EVAL_BATCH_END / PREDICT_BATCH_END
    on_evaluate            EVAL_END (after the metrics were logged, before the best metric is updated)
    on_predict             PREDICT_END               on_save             SAVE (after the checkpoint is written)
    on_epoch_end           EPOCH_END                 on_train_end        TRAIN_END
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from trainbus.engine import Event, Plugin, Priority
from trainbus.engine.state import CONTROL_FLAGS

from .callback_handler import CallbackHandlerMethods, install_handler_methods, lr_scheduler_of
from .trainer_callback import CALLBACK_EVENTS as CALLBACK_EVENTS  # re-exported (trainer_callback.py)
from .trainer_callback import TrainerCallback as TrainerCallback

if TYPE_CHECKING:
    from trainbus.engine import Engine

logger = logging.getLogger("trainbus.plugins")
#: transformers' loggers: its warnings, where a ported script (or transformers' own tests) listens for them
hf_callback_logger = logging.getLogger("transformers.trainer_callback")
hf_trainer_logger = logging.getLogger("transformers.trainer")


class CallbackAdapter(CallbackHandlerMethods, Plugin):
    """Drives HF-style callbacks (``TrainerCallback`` subclasses, transformers' own, or duck-typed objects).

    Args:
        callbacks: callback instances or classes (classes are instantiated, as HF does).
        args: the ``TrainingArguments`` the callbacks see (a default one when None).
        processing_class: passed to callbacks as ``processing_class``.

    Example:
        >>> from trainbus.plugins.facade.callbacks import CallbackAdapter, TrainerCallback
        >>> adapter = CallbackAdapter([TrainerCallback()])
    """

    def __init__(self, callbacks: Iterable[Any] = (), args: Any = None, processing_class: Any = None) -> None:
        if args is None:
            from .arguments import TrainingArguments

            args = TrainingArguments()
        self.args = args
        self.processing_class = processing_class
        self.callbacks: list[Any] = []
        self.eval_dataloader: Any = None
        self._engine: Engine | None = None
        self._step_handles: dict[str, Any] = {}
        self._standin_types: set[Any] = set()
        for cb in callbacks:
            self.add_callback(cb)

    # -- the list (HF CallbackHandler's API) -------------------------------------------------------
    def add_callback(self, callback: Any) -> Any:
        cb = callback() if isinstance(callback, type) else callback
        if not any(callable(getattr(cb, name, None)) for name in CALLBACK_EVENTS):
            raise TypeError(
                f"{type(cb).__name__} has none of the TrainerCallback methods ({', '.join(CALLBACK_EVENTS)})"
            )
        if any(type(c) is type(cb) for c in self.callbacks):
            hf_callback_logger.warning(
                f"You are adding a {type(cb)} to the callbacks of this Trainer, but there is already one. The current "
                f"list of callbacks is:\n{self.callback_list}"
            )
        self.callbacks.append(cb)
        self.standing_in_for(cb, added=True)
        self._sync_step_handlers()
        return cb

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return the first callback of that class, or that instance; None when absent."""
        for cb in self.callbacks:
            if (isinstance(callback, type) and isinstance(cb, callback)) or cb is callback:
                self.callbacks.remove(cb)
                self.standing_in_for(cb, added=False)
                self._sync_step_handlers()
                return cb
        return None

    def remove_callback(self, callback: Any) -> None:
        self.pop_callback(callback)

    def standing_in_for(self, callback: Any, added: bool) -> None:
        """One of transformers' default callbacks added or removed: its trainbus plugin follows (``standin_plugin``)."""
        plugin_type, engine = standin_plugin(callback), self._engine
        if plugin_type is None or engine is None:
            return  # not a stand-in, or the Trainer is still composing (it builds the plugins from the arguments)
        present = engine.get_plugin(plugin_type) is not None
        if added and not present:
            from ..control.flow import FlowControl

            engine.add_plugin(FlowControl.from_args(self.args) if plugin_type is FlowControl else plugin_type())
        elif not added and present and not any(standin_plugin(cb) is plugin_type for cb in self.callbacks):
            engine.pop_plugin(plugin_type)

    @property
    def standin_types(self) -> set[Any]:
        """The plugin types transformers' default callbacks stand in for in this Trainer."""
        return set(self._standin_types)

    def removed_plugins(self) -> set[type]:
        """The plugin types whose stand-in was taken out of the list (composing again leaves them out)."""
        listed = {standin_plugin(cb) for cb in self.callbacks}
        return {t for t in self._standin_types if t not in listed}

    def insert_defaults(self, disable_tqdm: bool) -> None:
        """transformers' list: ``DefaultFlowCallback`` first, the script's callbacks, then the progress callback."""
        if "transformers" not in sys.modules:  # a script that never imported transformers lists no stand-ins
            return
        from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback, ProgressCallback

        self.callbacks.insert(0, DefaultFlowCallback())
        self.callbacks.append(PrinterCallback() if disable_tqdm else ProgressCallback())
        self._standin_types = {standin_plugin(cb) for cb in self.callbacks} - {None}

    @property
    def callback_list(self) -> str:
        return "\n".join(type(cb).__name__ for cb in self.callbacks)

    # -- calling -----------------------------------------------------------------------------------
    def call_event(self, event: str, engine: Engine, **extra: Any) -> None:
        """Call ``event`` on every callback with HF's arguments; a returned control is honoured."""
        control = engine.control
        if control.requested:  # transformers' handler clears these before the callbacks run
            for flag in _CLEARED_BY.get(event, ()):
                setattr(control, flag, False)
        kwargs = {
            "model": engine.model,
            "processing_class": self.processing_class,
            "optimizer": engine.optimizer,
            "lr_scheduler": lr_scheduler_of(engine),
            "train_dataloader": engine.train_data,
            "eval_dataloader": self.eval_dataloader,
            **extra,
        }
        for cb in list(self.callbacks):
            method = getattr(cb, event, None)
            if method is None or standin_plugin(cb) is not None:
                continue  # duck-typed callbacks may implement only some events; a stand-in's plugin does its work
            result = method(self.args, engine.state, control, **kwargs)
            if result is not None and result is not control:
                for flag in CONTROL_FLAGS:
                    if hasattr(result, flag):
                        setattr(control, flag, bool(getattr(result, flag)))

    def init_end(self, engine: Engine) -> None:
        """Fire ``on_init_end`` (the Trainer calls this at the end of its ``__init__``)."""
        self.call_event("on_init_end", engine)

    def attach(self, engine: Engine) -> None:
        self._engine = engine
        simple = (
            (Event.TRAIN_START, "on_train_begin", Priority.DEFAULT),
            (Event.EPOCH_START, "on_epoch_begin", Priority.DEFAULT),
            (Event.EPOCH_END, "on_epoch_end", Priority.DEFAULT),
            (Event.TRAIN_END, "on_train_end", Priority.DEFAULT),
            (Event.EVAL_BATCH_END, "on_prediction_step", Priority.CONSUMER),
            (Event.PREDICT_BATCH_END, "on_prediction_step", Priority.CONSUMER),
        )
        for event, name, priority in simple:
            self.on(engine, event, self._caller(name), priority=priority)
        on_save = lambda ev: self.save(ev)  # noqa: E731  # named as the other callers: CallbackAdapter.on_save
        on_save.__name__ = "on_save"
        self.on(engine, Event.SAVE, on_save, priority=Priority.CONSUMER.after("Checkpointing"))
        self.on(engine, Event.LOG, self.log, priority=Priority.CONSUMER)
        self.on(engine, Event.EVAL_START, self.eval_start)
        # after the eval metrics are logged (DEFAULT) and before a best-metric keeper updates the state
        self.on(engine, Event.EVAL_END, self.evaluate, priority=Priority.DEFAULT, after="*")
        self.on(engine, Event.PREDICT_END, self.predict, priority=Priority.CONSUMER)
        self._sync_step_handlers()

    def detach(self, engine: Engine) -> None:
        super().detach(engine)
        self._step_handles.clear()
        self._engine = None

    def _step_handlers(self) -> tuple[tuple[str, Any, Any, int, tuple[str, ...]], ...]:
        """The handlers inside a step: (key, event, handler, priority, the on_* methods they call)."""
        return (
            ("step_begin", Event.STEP_START, self._caller("on_step_begin"), Priority.DEFAULT, ("on_step_begin",)),
            ("substep_end", Event.BACKWARD_END, self.substep_end, Priority.DEFAULT, ("on_substep_end",)),
            (
                "pre_optimizer_step",
                Event.BEFORE_OPTIMIZER_STEP,
                self._caller("on_pre_optimizer_step"),
                Priority.CONSUMER,
                ("on_pre_optimizer_step",),
            ),
            # before the scheduler steps, as in HF
            (
                "optimizer_step",
                Event.OPTIMIZER_STEP,
                self._caller("on_optimizer_step"),
                Priority.PRODUCER,
                ("on_optimizer_step",),
            ),
            ("step_end", Event.STEP_END, self.step_end, Priority.DEFAULT, ("on_optimizer_step", "on_step_end")),
        )

    def _sync_step_handlers(self) -> None:
        """Register the per-step handlers only while some callback overrides what they call.

        The base TrainerCallback's methods do nothing, so a run whose callbacks only act on, say,
        on_evaluate builds no payload and makes no call inside its steps.
        """
        engine = self._engine
        if engine is None:
            return
        for key, event, handler, priority, methods in self._step_handlers():
            called = [cb for cb in self.callbacks if standin_plugin(cb) is None]
            wanted = any(_overrides(cb, name) for cb in called for name in methods)
            handle = self._step_handles.get(key)
            if wanted and handle is None:
                self._step_handles[key] = self.on(engine, event, handler, priority=priority)
            elif not wanted and handle is not None:
                handle.remove()
                del self._step_handles[key]

    def save(self, ev: Any) -> None:
        """``on_save``, with the checkpoint on disk: a callback's ``on_save`` may read, copy or upload checkpoint-N, so
        under ``save_async`` the write is waited for first when one overrides it (transformers calls it after the
        save)."""
        if any(_overrides(cb, "on_save") for cb in self.callbacks if standin_plugin(cb) is None):
            for plugin in ev.engine.plugins:
                wait = getattr(plugin, "wait_for_writes", None)
                if callable(wait):
                    wait(ev.engine, "a callback's on_save")
        self.call_event("on_save", ev.engine)

    def _caller(self, name: str) -> Any:
        def call(ev: Any) -> None:
            self.call_event(name, ev.engine)

        call.__name__ = name
        return call

    def substep_end(self, ev: Any) -> None:
        if ev.micro_index < ev.window_size - 1:
            self.call_event("on_substep_end", ev.engine)

    def step_end(self, ev: Any) -> None:
        if not ev.stepped:
            self.call_event("on_optimizer_step", ev.engine)  # HF calls it even when AMP skipped the step
        self.call_event("on_step_end", ev.engine)

    def log(self, ev: Any) -> None:
        if ev.logs:
            self.call_event("on_log", ev.engine, logs=ev.logs)

    def eval_start(self, ev: Any) -> None:
        self.eval_dataloader = ev.dataloader

    def evaluate(self, ev: Any) -> None:
        if not ev.reported:  # a subclass's own evaluate() called on_evaluate itself (HF's QA trainers)
            self.call_event("on_evaluate", ev.engine, metrics=ev.metrics)

    def predict(self, ev: Any) -> None:
        if not getattr(ev.engine, "_loop_only", False):  # HF's evaluation_loop / prediction_loop call no on_predict
            self.call_event("on_predict", ev.engine, metrics=ev.metrics)

    # -- state: HF ExportableState callbacks (e.g. early stopping) are checkpointed ---------------------
    def state_dict(self) -> dict[str, Any]:
        saved: dict[str, Any] = {}
        for cb in self.callbacks:
            exporter = getattr(cb, "state", None)
            if callable(exporter):
                saved.setdefault(type(cb).__name__, []).append(exporter())
        return {"callbacks": saved}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not getattr(self.args, "restore_callback_states_from_checkpoint", False):
            return  # HF restores callback states on resume only when asked to
        saved = state.get("callbacks", {})
        seen: dict[str, int] = {}
        replaced: list[Any] = []
        restored_list: list[Any] = []
        for cb in list(self.callbacks):
            name = type(cb).__name__
            if name in saved and callable(getattr(cb, "state", None)):
                index = seen.get(name, 0)
                seen[name] = index + 1
                if index < len(saved[name]):
                    # as HF: a new instance from the saved constructor args, then the saved attributes
                    entry = saved[name][index]
                    restored = type(cb)(**entry.get("args", {}))
                    for key, value in entry.get("attributes", {}).items():
                        setattr(restored, key, value)
                    replaced.append(cb)
                    restored_list.append(restored)
        # as HF: the old instance leaves the list and the restored one is added at the end
        self.callbacks = [cb for cb in self.callbacks if not any(cb is r for r in replaced)] + restored_list
        missing = [name for name in saved if name not in seen]
        if missing:
            hf_trainer_logger.warning(  # transformers' words, formatted in the message as transformers does
                f"Checkpoint included callbacks not included in current configuration. Ignoring. ({', '.join(missing)})"
            )
        self._sync_step_handlers()


def standin_plugin(callback: Any) -> type | None:
    """The trainbus plugin that does the work of one of transformers' default callbacks, for an instance of it.

    transformers' Trainer lists ``DefaultFlowCallback`` and ``ProgressCallback`` (``PrinterCallback`` with
    ``disable_tqdm``) among its callbacks; in trainbus ``FlowControl`` and ``ProgressBars`` / ``Printer`` do
    that work. The list holds transformers' own instances as stand-ins, which are never called: removing one
    removes its plugin, adding one adds it.
    """
    module = type(callback).__module__
    if module != "transformers.trainer_callback":
        return None
    from ..control.flow import FlowControl
    from ..observability.progress import Printer, ProgressBars

    plugins: dict[str, type] = {
        "DefaultFlowCallback": FlowControl,
        "ProgressCallback": ProgressBars,
        "PrinterCallback": Printer,
    }
    return plugins.get(type(callback).__name__)


#: the Control flags transformers' CallbackHandler clears when it calls an event (a callback may set them again);
#: the engine has cleared them already when it fires these, but a subclass's _maybe_log_save_evaluate relies on it
_CLEARED_BY = {
    "on_log": ("should_log",),
    "on_evaluate": ("should_evaluate",),
    "on_save": ("should_save",),
    "on_step_begin": ("should_log", "should_evaluate", "should_save"),
}


def _overrides(callback: Any, name: str) -> bool:
    """Whether ``callback`` has an ``on_*`` method of its own (not a TrainerCallback base's no-op)."""
    for klass in type(callback).__mro__:
        if name in vars(klass):
            return klass.__name__ != "TrainerCallback"
    return callable(getattr(callback, name, None))  # set on the instance


install_handler_methods(CallbackAdapter, (*CALLBACK_EVENTS, "on_push_begin"))
