"""Property tests of the loop: the event grammar and the step arithmetic (invariants 1 and 2)."""

from __future__ import annotations

import math

import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import Engine, Event, Plugin
from trainbus.engine.testing import EventRecorder, LoopConfig, check_trace, loop_configs, toy_engine


class BatchIds(Plugin):
    """Records, per epoch, which sample indices the loop fed through forward."""

    def __init__(self) -> None:
        self.epochs: list[list[int]] = []
        self.window_sizes: list[int] = []

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.EPOCH_START, lambda ev: self.epochs.append([]))
        self.on(engine, Event.BATCH_START, self._batch)
        self.on(engine, Event.STEP_START, lambda ev: self.window_sizes.append(len(ev.batches)))

    def _batch(self, ev) -> None:  # type: ignore[no-untyped-def]
        x, _ = ev.batch
        self.epochs[-1].extend(int(i) for i in x[:, 0].tolist())


def indexed_engine(config: LoopConfig, plugins: list[Plugin]) -> Engine:
    """A toy engine whose first feature column is the sample index, so batches can be traced."""
    engine = toy_engine(config, plugins=plugins)
    x = torch.arange(config.dataset_size, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    y = torch.zeros(config.dataset_size, 1)
    engine.train_data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=config.batch_size, drop_last=config.drop_last
    )
    return engine


@given(loop_configs())
def test_any_loop_configuration_yields_a_trace_the_grammar_accepts(config: LoopConfig) -> None:
    recorder = EventRecorder()
    engine = toy_engine(config, plugins=[recorder])
    engine.fit()
    check_trace(recorder.names)
    assert recorder.names.count("STEP_END") == config.expected_steps


@given(loop_configs())
def test_step_arithmetic(config: LoopConfig) -> None:
    ids = BatchIds()
    engine = indexed_engine(config, [ids])
    state = engine.fit()
    assert state.global_step == config.expected_steps
    assert state.max_steps == config.planned_steps
    # windows: full windows of k, the last one of an epoch may be partial; none crosses an epoch
    k = config.accumulation_steps
    per_epoch_windows = [k] * (config.batches_per_epoch // k) + (
        [config.batches_per_epoch % k] if config.batches_per_epoch % k else []
    )
    assert len(per_epoch_windows) == config.steps_per_epoch == math.ceil(config.batches_per_epoch / k)
    expected_windows = (per_epoch_windows * (config.expected_steps // len(per_epoch_windows) + 1))[
        : config.expected_steps
    ]
    assert ids.window_sizes == expected_windows
    # every micro-batch used once per completed epoch, in order
    used = config.batches_per_epoch * config.batch_size if config.drop_last else config.dataset_size
    for epoch_ids in ids.epochs[: state.epochs_completed]:
        assert epoch_ids == list(range(used))
    full_epochs, rest = divmod(config.expected_steps, config.steps_per_epoch)
    assert state.epochs_completed == full_epochs
    if rest:  # HF's epoch: the share of the epoch's micro-batches done (full windows of k before the stop)
        assert state.epoch == full_epochs + rest * k / config.batches_per_epoch


@given(loop_configs(), st.integers(1, 30))
def test_stop_request_ends_after_the_current_step_with_train_end(config: LoopConfig, stop_at: int) -> None:
    recorder = EventRecorder()
    engine = toy_engine(config, plugins=[recorder])

    def stop(ev) -> None:  # type: ignore[no-untyped-def]
        if ev.engine.state.global_step == stop_at:
            ev.engine.control.should_training_stop = True

    engine.on(Event.LOSS, stop)  # requested mid-window: the window still completes
    state = engine.fit()
    check_trace(recorder.names)
    assert recorder.names[-1] == "TRAIN_END"
    # the request is made during the window that ends at step stop_at + 1
    assert state.global_step == min(config.expected_steps, stop_at + 1)


def test_fit_twice_after_max_steps_does_nothing_more() -> None:
    config = LoopConfig(10, 2, 1, None, 3, None)
    engine = toy_engine(config)
    engine.fit()
    before = [p.detach().clone() for p in engine.model.parameters()]
    engine.fit()
    assert engine.state.global_step == 3
    assert all(torch.equal(a, b) for a, b in zip(before, engine.model.parameters()))


def test_iterable_data_without_length_trains_for_max_steps() -> None:
    def stream():  # type: ignore[no-untyped-def]
        for _ in range(4):
            yield torch.randn(2, 3), torch.randn(2, 1)

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            return stream()

    model = torch.nn.Linear(3, 1)
    loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
    engine = Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=loader, max_steps=10, loss_fn=torch.nn.MSELoss()
    )
    recorder = engine.add_plugin(EventRecorder())
    assert engine.fit().global_step == 10
    assert isinstance(recorder, EventRecorder)
    check_trace(recorder.names)
    assert recorder.names.count("EPOCH_START") == 3  # 4 + 4 + 2 batches


@given(st.integers(1, 4), st.integers(1, 5), st.integers(1, 20))
def test_step_and_micro_batch_filters_count_steps_not_firings(k: int, every: int, stop: int) -> None:
    config = LoopConfig(24, 2, k, 2, None, None)
    engine = toy_engine(config)
    at_steps: list[int] = []
    at_micro: list[int] = []
    engine.on(Event.STEP_END(every=every), lambda ev: at_steps.append(ev.engine.state.global_step))
    engine.on(Event.LOSS(every=every), lambda ev: at_micro.append(ev.engine.state.micro_steps))

    def interrupt(ev) -> None:  # type: ignore[no-untyped-def]
        if ev.engine.state.global_step == stop:
            ev.engine.control.should_training_stop = True

    handle = engine.on(Event.STEP_END, interrupt)
    engine.fit()
    handle.remove()
    engine.fit()  # continue: the filters stay aligned with the run's step and micro-batch numbers
    total_steps = 2 * config.steps_per_epoch
    assert at_steps == [s for s in range(1, total_steps + 1) if s % every == 0]
    assert at_micro == [m for m in range(1, 2 * config.batches_per_epoch + 1) if m % every == 0]
