"""trainbus.engine.testing: a testing kit for loops built on trainbus (record events, check the grammar,
generate configs, check a plugin's resume, count host syncs; ``describe`` renders docs/events.md).

A subpackage above the engine's core: it imports the engine, the engine never imports it.

Installed with the ``testing`` extra (it imports hypothesis). Example property test::

    from hypothesis import given
    from trainbus.engine.testing import EventRecorder, check_trace, loop_configs, toy_engine

    @given(loop_configs())
    def test_any_loop_is_well_formed(config):
        recorder = EventRecorder()
        engine = toy_engine(config, plugins=[recorder])
        engine.fit()
        check_trace(recorder.names)

and a plugin's resume (save at a step hypothesis draws, load into a fresh engine, continue)::

    check_resume_equivalence(lambda: toy_engine(config, plugins=[MyPlugin()]))

The grammar every trace obeys (SIDE = LOG | EVAL_START EVAL_BATCH_END* EVAL_END | SAVE)::

    ( TRAIN_START SIDE* (EPOCH_START (STEP_START (BATCH_START LOSS BACKWARD_END)+
        BEFORE_OPTIMIZER_STEP OPTIMIZER_STEP? STEP_END SIDE*)* EPOCH_END SIDE*)* TRAIN_END
    | EVAL_START EVAL_BATCH_END* EVAL_END | LOG | SAVE
    | PREDICT_START PREDICT_BATCH_END* PREDICT_END )*

and the failure path: after any event of an open block (or right after the END that closed one,
when a handler of that END raised) may come EXCEPTION, then exactly the ENDs still open, innermost
first (EVAL_END / PREDICT_END, EPOCH_END, TRAIN_END), and then the trace ends or a new block starts.
"""

from .kit import (
    EventRecorder,
    LoopConfig,
    StopAtStep,
    TraceError,
    check_trace,
    loop_configs,
    toy_data,
    toy_engine,
    trace_is_valid,
)
from .resume_check import ResumeMismatch, check_resume_equivalence, first_difference
from .sync_counter import SyncCounter, count_syncs, everything_but, on_accelerator

__all__ = [
    "ResumeMismatch",
    "check_resume_equivalence",
    "first_difference",
    "SyncCounter",
    "count_syncs",
    "everything_but",
    "on_accelerator",
    "EventRecorder",
    "LoopConfig",
    "StopAtStep",
    "TraceError",
    "check_trace",
    "loop_configs",
    "toy_data",
    "toy_engine",
    "trace_is_valid",
]
