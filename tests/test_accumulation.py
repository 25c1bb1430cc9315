"""Gradient accumulation: k micro-batches give the gradients of one batch of the same items."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from dist_helpers import free_port, run_processes
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from trainbus.engine import ConfigError, Engine, Event, Priority
from trainbus.engine.testing import count_syncs, everything_but
from trainbus.plugins.distributed.processes import close_group
from trainbus.plugins.optimization.accumulation import GradientAccumulation, count_items, window_factors

V, D = 4, 3  # vocabulary (classes) and feature width of the token model


def token_loss(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(pred.reshape(-1, V), labels.reshape(-1), ignore_index=-100)


@st.composite
def token_batches(draw: st.DrawFn) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Micro-batches of (B_i, L_i, D) token features with -100-padded labels, and a window size."""
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    n_batches = draw(st.integers(1, 7))
    k = draw(st.integers(1, 4))
    batches = []
    for _ in range(n_batches):
        b, length = draw(st.integers(1, 4)), draw(st.integers(1, 5))
        pad = draw(st.floats(0.0, 1.0))
        x = torch.randn(b, length, D, generator=generator, dtype=torch.float64)
        labels = torch.randint(0, V, (b, length), generator=generator)
        labels[torch.rand(b, length, generator=generator) < pad] = -100
        batches.append((x, labels))
    return batches, k


class GradCapture:
    """Copies of the gradients at every BEFORE_OPTIMIZER_STEP, and the windows of raw batches."""

    def __init__(self, engine: Engine) -> None:
        self.grads: list[list[torch.Tensor]] = []
        self.windows: list[list[Any]] = []
        self.losses: list[list[torch.Tensor]] = []
        engine.on(Event.STEP_START, lambda ev: (self.windows.append(list(ev.batches)), self.losses.append([])))
        engine.on(Event.LOSS, lambda ev: self.losses[-1].append(ev.loss.detach()), priority=Priority.CONSUMER)
        engine.on(
            Event.BEFORE_OPTIMIZER_STEP,
            lambda ev: self.grads.append([p.grad.clone() for p in ev.engine.model.parameters()]),
        )


def reference_grads(model: torch.nn.Module, window: list[Any]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Gradients of the mean loss over all non -100 tokens of the window, as one batch."""
    model.zero_grad()
    logits = torch.cat([model(x).reshape(-1, V) for x, _ in window])
    labels = torch.cat([y.reshape(-1) for _, y in window])
    loss = F.cross_entropy(logits, labels, ignore_index=-100)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return grads, loss.detach()


@given(token_batches(), st.integers(1, 2))
def test_accumulated_gradients_equal_single_batch_gradients(case: Any, epochs: int) -> None:
    batches, k = case
    torch.manual_seed(0)
    model = torch.nn.Linear(D, V).double()
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),  # parameters stay put: every window sees the same model
        train_data=batches,
        max_epochs=epochs,
        loss_fn=token_loss,
        plugins=[GradientAccumulation(k)],
    )
    capture = GradCapture(engine)
    engine.fit()
    windows_per_epoch = -(-len(batches) // k)
    assert len(capture.windows) == epochs * windows_per_epoch
    for window, grads, losses in zip(capture.windows, capture.grads, capture.losses):
        expected, loss = reference_grads(model, window)
        if sum(int((y != -100).sum()) for _, y in window) == 0:
            expected = [torch.zeros_like(g) for g in grads]  # no item in the window: no gradient
            loss = torch.zeros((), dtype=torch.float64)
        for got, want in zip(grads, expected):
            torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
        # loggers (CONSUMER) see normalised losses: their sum is the window's mean loss
        torch.testing.assert_close(torch.stack(losses).sum(), loss, atol=1e-10, rtol=0)


class OwnLossModel(torch.nn.Module):
    """A model that computes its own per-sample mean loss from a dict batch without "labels"."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(D, 1).double()

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.linear(x) - target) ** 2).mean()}


@given(st.lists(st.integers(1, 5), min_size=1, max_size=7), st.integers(1, 4), st.integers(0, 1000))
def test_without_labels_the_window_is_normalised_by_samples(sizes: list[int], k: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    batches = [
        {
            "x": torch.randn(n, D, generator=generator, dtype=torch.float64),
            "target": torch.randn(n, 1, generator=generator, dtype=torch.float64),
        }
        for n in sizes
    ]
    model = OwnLossModel()
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        train_data=batches,
        max_epochs=1,
        plugins=[GradientAccumulation(k)],
    )
    capture = GradCapture(engine)
    engine.fit()
    for window, grads in zip(capture.windows, capture.grads):
        model.zero_grad()
        x = torch.cat([b["x"] for b in window])
        target = torch.cat([b["target"] for b in window])
        model(x, target)["loss"].backward()
        for got, p in zip(grads, model.parameters()):
            torch.testing.assert_close(got, p.grad, atol=1e-10, rtol=0)


def test_a_user_hook_supplies_the_item_count() -> None:
    # a loss that averages over a count the batch carries (e.g. the real words of a sentence)
    def loss_fn(pred: torch.Tensor, batch_target: torch.Tensor) -> torch.Tensor:
        return pred.sum() / batch_target[0]

    batches = [
        (torch.randn(2, D, dtype=torch.float64), torch.tensor([n], dtype=torch.float64)) for n in (1.0, 5.0, 2.0)
    ]
    model = torch.nn.Linear(D, 1).double()
    seen: list[Any] = []

    def count(batch: Any) -> int:
        seen.append(batch)
        return int(batch[1][0])

    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        train_data=batches,
        max_epochs=1,
        loss_fn=loss_fn,
        plugins=[GradientAccumulation(3, count_items=count)],
    )
    capture = GradCapture(engine)
    engine.fit()
    assert len(seen) == 3
    model.zero_grad()
    (sum(model(x).sum() for x, _ in batches) / 8.0).backward()
    for got, p in zip(capture.grads[0], model.parameters()):
        torch.testing.assert_close(got, p.grad, atol=1e-10, rtol=0)


def test_count_items_rules() -> None:
    assert count_items((torch.zeros(3, 2), torch.tensor([1, -100, 2]))) == 2
    assert count_items({"input_ids": torch.zeros(4, 5), "labels": torch.full((4, 5), -100)}) == 0
    assert count_items((torch.zeros(3, 2), torch.zeros(3, 2))) == 6  # float labels: elements (MSE averages them)
    assert count_items({"x": torch.zeros(7, 2)}) == 7  # no labels: samples
    assert window_factors([1, 3]) == [0.25, 0.75]
    assert window_factors([0, 0]) == [0.0, 0.0]
    weights = window_factors([torch.tensor(1), 3, torch.tensor(0)])
    assert isinstance(weights, torch.Tensor)
    torch.testing.assert_close(weights, torch.tensor([0.25, 0.75, 0.0], dtype=torch.float64))
    weights = window_factors([3, torch.tensor(1)])  # an int first: same result
    torch.testing.assert_close(weights, torch.tensor([0.75, 0.25], dtype=torch.float64))
    torch.testing.assert_close(window_factors([torch.tensor(0)] * 2), torch.zeros(2, dtype=torch.float64))


class OpRecorder(TorchDispatchMode):
    """The names of the aten ops run while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_host_labels_are_counted_on_the_host_with_no_tensor_op() -> None:
    """The DataLoader case on a GPU: the window is counted before its batches move, in Python numbers."""
    batches = [(torch.zeros(3, 2), torch.tensor([1, -100, 2])), (torch.zeros(2, 2), torch.tensor([-100, -100]))]
    with OpRecorder() as recorder:
        counts = [count_items(b) for b in batches]
        weights = window_factors(counts)
    # numpy reads the labels' host memory in place (the detach is the alias .numpy() takes): no new
    # storage, no kernel, nothing to copy to a device later
    assert set(recorder.ops) <= {"aten.detach.default"}
    assert counts == [2, 0] and all(isinstance(c, int) for c in counts)
    assert weights == [1.0, 0.0]


def test_device_labels_are_counted_on_the_device_and_never_read() -> None:
    """Batches that already live on an accelerator (here the meta device) keep their counts there."""
    labels = torch.tensor([1, -100, 2]).to("meta")
    with count_syncs(on_device=lambda t: True) as counter:  # any read at all would count
        count = count_items((torch.zeros(3, 2, device="meta"), labels))
        weights = window_factors([count, count])
    assert isinstance(count, torch.Tensor) and count.device.type == "meta"
    assert isinstance(weights, torch.Tensor) and weights.device.type == "meta" and weights.shape == (2,)
    assert counter.count == 0


def test_a_window_of_host_batches_reads_nothing_and_copies_no_weight() -> None:
    """The CPU proxy of a GPU run: all but the data's batches stand for device tensors."""
    torch.manual_seed(0)
    batches = [(torch.randn(4, 3), torch.tensor([0, 1, -100, 2])) for _ in range(6)]
    model = torch.nn.Linear(3, 3)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=batches, max_epochs=1,
                    loss_fn=torch.nn.CrossEntropyLoss(), plugins=[GradientAccumulation(3)])  # fmt: skip
    with count_syncs(on_device=everything_but(batches)) as counter, OpRecorder() as recorder:
        engine.fit()
    assert counter.count == 0
    # the weights are Python floats: no stack, no division of tensors, no copy to the loss's device;
    # applying one is the single multiply a loop dividing by k does
    assert not [op for op in recorder.ops if op.startswith(("aten.stack", "aten._to_copy", "aten.copy_", "aten.where"))]
    assert sum(op.startswith("aten.mul.Tensor") for op in recorder.ops) >= len(batches)


def test_bad_accumulation_fails_at_construction() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="accumulation"):
            GradientAccumulation(bad)  # type: ignore[arg-type]


def test_attach_sets_window_and_state_round_trips() -> None:
    model = torch.nn.Linear(D, 1)
    data = [(torch.randn(2, D), torch.randn(2, 1)) for _ in range(5)]
    plugin = GradientAccumulation(2)
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=data,
        max_epochs=1,
        loss_fn=torch.nn.MSELoss(),
        plugins=[plugin],
    )
    assert engine.accumulation_steps == 2
    assert engine.fit().global_step == 3
    state = json.loads(json.dumps(plugin.state_dict()))
    assert state == {"steps": 2, "micro_batches_seen": 5}
    other = GradientAccumulation(2)
    other.load_state_dict(state)
    assert other.state_dict() == state
    engine.pop_plugin(plugin)
    assert engine.accumulation_steps == 1


# -- DDP: gradients are all-reduced only at the last micro-batch of a window ------------------------
WINDOW, WINDOWS, MICRO = 3, 2, 2  # window size, windows, samples per micro-batch per rank


def _ddp_data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    return [
        (
            torch.randn(MICRO, D, generator=generator, dtype=torch.float64),
            torch.randn(MICRO, 1, generator=generator, dtype=torch.float64),
        )
        for _ in range(WINDOW * WINDOWS)
    ]


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        result = _ddp_train(rank)  # returns after the DDP model and its engine are freed
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        close_group()  # every rank waits, and gloo's threads cannot abort the exit (processes.py)
    finally:
        if dist.is_initialized():  # failed before close_group: the other rank may never reach a barrier
            dist.destroy_process_group()


def _ddp_train(rank: int) -> dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(D, 1).double())
    calls: list[int] = []

    def counting_allreduce(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects non-GradBucket annotations
        calls.append(1)
        return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

    ddp.register_comm_hook(None, counting_allreduce)
    engine = Engine(
        ddp,
        torch.optim.SGD(ddp.parameters(), lr=0.1),
        train_data=_ddp_data(rank),
        max_epochs=1,
        loss_fn=torch.nn.MSELoss(),
        plugins=[GradientAccumulation(WINDOW)],
    )
    synced_at: list[int] = []
    engine.on(Event.BACKWARD_END, lambda ev: synced_at.append(len(calls)))
    engine.fit()
    params = [p.detach().reshape(-1).tolist() for p in ddp.module.parameters()]
    return {"calls": len(calls), "synced_at": synced_at, "params": params}


def test_ddp_syncs_once_per_window_and_equals_one_process() -> None:
    with tempfile.TemporaryDirectory() as out:
        run_processes(_ddp_worker, (free_port(), out))
        results = []
        for rank in range(2):
            with open(os.path.join(out, f"rank{rank}.json")) as f:
                results.append(json.load(f))
    for result in results:
        assert result["calls"] == WINDOWS  # one all-reduce per window (the model is one bucket)
        # the counter after each micro-batch's backward: it moves only at a window's last micro-batch
        assert result["synced_at"] == [w + (i == WINDOW - 1) for w in range(WINDOWS) for i in range(WINDOW)]
    assert results[0]["params"] == results[1]["params"]
    # one process, each micro-batch holding both ranks' samples, gives the same parameters
    torch.manual_seed(0)
    model = torch.nn.Linear(D, 1).double()
    data = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(_ddp_data(0), _ddp_data(1))]
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=data,
        max_epochs=1,
        loss_fn=torch.nn.MSELoss(),
        plugins=[GradientAccumulation(WINDOW)],
    )
    engine.fit()
    for got, p in zip(results[0]["params"], model.parameters()):
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float64), p.detach().reshape(-1), atol=1e-10, rtol=0)
