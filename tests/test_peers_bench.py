"""The peers benchmark runs end to end on the CPU (no timing asserted: timing lives in benchmarks/)."""

from __future__ import annotations

import pytest

from benchmarks import peers


def _table(out: str) -> dict[str, list[str]]:
    """The markdown table's rows by their first cell."""
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert cells and cells[0][0] == "loop"
    return {row[0]: row[1:] for row in cells[1:]}


def test_every_installed_loop_gets_a_row_with_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    # tiny: one process per loop, two timed steps, several processes at a time (a smoke run, timings meaningless)
    results = peers.main(["--rounds", "1", "--warmup", "1", "--steps", "2", "--concurrent", "3"])
    table = _table(capsys.readouterr().out)
    assert set(table) == set(peers.LABELS.values())
    for loop, label in peers.LABELS.items():
        cells = table[label]
        if not peers.installed(loop):
            assert cells[0] == "not installed"
            continue
        assert isinstance(results[loop], list) and len(results[loop]) == 1, (label, results[loop])
        ms, ratio, cpu_ms, cpu_ratio, throughput, memory = cells[:6]
        assert float(ms) > 0 and float(ratio) > 0 and float(cpu_ms) > 0 and float(cpu_ratio) > 0
        assert float(throughput.replace(",", "")) > 0 and float(memory.replace(",", "")) > 0
        assert cells[-1] == ms  # one run: the median is that run
    assert table["raw PyTorch loop"][1] == table["raw PyTorch loop"][3] == "1.000"


def test_a_missing_library_reads_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(peers, "installed", lambda loop: loop != "lightning")
    results = peers.main(["--loops", "lightning", "--rounds", "1"])
    assert results == {"lightning": "not installed"}
    assert _table(capsys.readouterr().out)["Lightning"][0] == "not installed"


def test_gpt2_is_a_cuda_job_and_cuda_needs_a_device() -> None:
    with pytest.raises(SystemExit):
        peers.main(["--job", "gpt2"])  # without --tiny on a CPU
    with pytest.raises(SystemExit):
        peers.main(["--device", "cuda", "--loops", "bogus"])


def test_schedules_are_hf_closed_forms() -> None:
    meter = peers.Meter(1, 1, 0, cuda=False)
    linear = peers.Setup(peers.JOBS["mlp"], None, None, peers.RepeatDataset(0, []), 10, meter, False)
    assert [linear.factor(s) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    cosine = peers.Setup(peers.JOBS["gpt2"], None, None, peers.RepeatDataset(0, []), 10, meter, False)
    assert cosine.factor(0) == 0.0 and cosine.factor(1) == 1.0 and cosine.factor(10) == pytest.approx(0.0)


def test_the_cuda_meter_times_counts_syncs_and_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path without a GPU: torch.cuda and the profiler replaced by fakes that record what they see."""
    import warnings
    from types import SimpleNamespace

    import torch
    import torch.profiler
    from torch.autograd import DeviceType

    calls: list[str] = []
    mode = {"now": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.update(now=m))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 3 * 2**20)

    class FakeProfiler:
        def __init__(self, activities: object) -> None:
            self.events_seen = [SimpleNamespace(name="gemm", device_type=DeviceType.CUDA)] * 10
            self.events_seen += [SimpleNamespace(name="aten::mm", device_type=DeviceType.CPU)] * 10

        def start(self) -> None:
            calls.append("profile")

        def stop(self) -> None:
            calls.append("stop")

        def events(self) -> list[SimpleNamespace]:
            return self.events_seen

    monkeypatch.setattr(torch.profiler, "profile", FakeProfiler)
    meter = peers.Meter(warm=2, timed=3, counted=4, cuda=True)
    assert meter.total == 2 + 3 + 4 + peers.PROFILED
    with warnings.catch_warnings():
        for step in range(1, meter.total + 1):
            meter.step_end(step)
            meter.step_end(step)  # a repeated step (Lightning's micro-batches) changes nothing
            if mode["now"] == "warn":  # a step reading a value: one sync per step while counting
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
    result = meter.result(peers.JOBS["mlp"])
    assert calls == ["sync", "sync", "profile", "sync", "stop"] and mode["now"] == 0
    assert result["syncs_per_step"] == 1.0 and result["peak_mib"] == 3.0
    assert result["kernels"] == {"gemm": 10 / peers.PROFILED} and result["kernels_per_step"] == 2.0
    assert result["ms_per_step"] > 0 and result["throughput"] > 0
