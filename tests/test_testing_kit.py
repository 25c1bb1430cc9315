"""The testing kit users get: the trace grammar checker and the loop-config strategy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine.testing import (
    LoopConfig,
    TraceError,
    check_trace,
    count_syncs,
    everything_but,
    loop_configs,
    trace_is_valid,
)  # fmt: skip

STEP = ["STEP_START", "BATCH_START", "LOSS", "BACKWARD_END", "BEFORE_OPTIMIZER_STEP", "OPTIMIZER_STEP", "STEP_END"]
GOOD = [
    "TRAIN_START",
    "EPOCH_START",
    *STEP,
    "LOG",
    "EVAL_START",
    "EVAL_BATCH_END",
    "EVAL_END",
    "SAVE",
    "EPOCH_END",
    "TRAIN_END",
]


def test_good_traces_pass() -> None:
    check_trace(GOOD)
    check_trace(["EVAL_START", "EVAL_END", "PREDICT_START", "PREDICT_BATCH_END", "PREDICT_END"])
    check_trace(["TRAIN_START", "EVAL_START", "EVAL_END", "TRAIN_END"])  # eval on start
    check_trace([])


@pytest.mark.parametrize(
    ("trace", "position", "got"),
    [
        (["EPOCH_START"], 0, "EPOCH_START"),
        (["TRAIN_START", "EPOCH_START", "LOG"], 2, "LOG"),  # no side effect before the first step
        (["TRAIN_START", "EPOCH_START", "STEP_START", "LOSS"], 3, "LOSS"),
        (
            ["TRAIN_START", "EPOCH_START", "STEP_START", "BATCH_START", "LOSS", "BACKWARD_END", "STEP_END"],
            6,
            "STEP_END",
        ),
        (GOOD[:-1], len(GOOD) - 1, "<end>"),
        (["EVAL_START", "EVAL_BATCH_END", "SAVE"], 2, "SAVE"),
    ],
)
def test_bad_traces_report_the_first_offending_position(trace: list[str], position: int, got: str) -> None:
    with pytest.raises(TraceError) as info:
        check_trace(trace)
    assert (info.value.position, info.value.got) == (position, got)


@given(st.data())
def test_removing_any_structural_event_breaks_the_trace(data: st.DataObject) -> None:
    index = data.draw(
        st.sampled_from(
            [i for i, name in enumerate(GOOD) if name not in {"OPTIMIZER_STEP", "LOG", "SAVE", "EVAL_BATCH_END"}]
        )
    )
    broken = GOOD[:index] + GOOD[index + 1 :]
    assert not trace_is_valid(broken)


@given(loop_configs())
def test_configs_are_consistent(config: LoopConfig) -> None:
    assert (config.max_epochs is None) != (config.max_steps is None)
    assert config.batches_per_epoch >= 1
    assert config.expected_steps <= config.planned_steps


def test_sync_counter_counts_reads_of_device_tensors_only() -> None:
    host = torch.ones(3)
    with count_syncs() as counter:  # reading a CPU tensor is no sync
        float(host.sum()), host.tolist(), host.numpy(), bool(host[0])
    assert counter.count == 0
    device = torch.ones(3, device="meta")
    with count_syncs() as counter:
        with pytest.raises((RuntimeError, NotImplementedError)):
            device.sum().item()  # meta has no values: counted, then refused
        with pytest.raises((RuntimeError, NotImplementedError)):
            device.cpu()  # a device-to-host copy
        device.new_zeros(3) + host.to("meta")  # a host-to-device copy from pageable memory
    assert counter.count == 3


def test_the_cpu_proxy_counts_all_but_the_data() -> None:
    batch = (torch.ones(2, 3), torch.tensor([1, 2]))
    with count_syncs(on_device=everything_but([batch])) as counter:
        batch[1].tolist(), batch[1].numpy()  # the loader's host batch: free
        float(batch[0].sum())  # a value computed from it stands for a device value
    assert counter.count == 1
    with count_syncs(on_device=lambda t: True) as counter:
        batch[1].tolist()
    assert counter.count == 1
