"""Asynchronous checkpoints: the stall a save adds to its step, and the steps while it is written, against a
synchronous save and no save.

Usage: python -m benchmarks.checkpoint_async [--model mlp51m|gpt2] [--device cpu|cuda] [--steps N]
           [--saves S] [--rounds R] [--batch B] [--threads T] [--niceness 10,0] [--dir DIR] [--quick]

Models:
  mlp51m  checkpoint_speed's "large" MLP 256-4096-4096-4096-4096-10 (51M parameters, 617 MB with AdamW state)
  gpt2    transformers' GPT2LMHeadModel from GPT-2 small's config (124M parameters, random init, no download;
          1.5 GB with AdamW state), fused AdamW, sequences of 1024 tokens: for a GPU (--device cuda)
--quick shrinks either to a few thousand parameters and runs in seconds: it checks the code path only.

One run is a bare trainbus Engine with ``Checkpointing(save_strategy="steps", save_steps=N,
save_total_limit=2)`` for N * (S + 2) steps. The save at step N allocates the host buffers (warm-up, reported
apart), the saves at 2N .. (S+1)N are measured, each followed by N-1 steps during which an asynchronous
save's write runs in the background; the save at the last step is not timed. Runs, in an order rotated from
round to round, on the same model and optimizer:
  no save       save_steps past the end: the same plugin, one save at the last step (untimed, synchronous)
  sync save     save_async=False: the step writes, hashes, fsyncs, renames and rotates
  async save    save_async=True, with the writer thread's niceness (background.WRITER_NICENESS) of each --niceness

A step's time is the wall time from its STEP_START to the next one's (on a GPU after torch.cuda.synchronize(),
so every kernel and copy it launched is in it), its save and the handlers after it included.
Printed: the stall (a saving step's time minus the median step of the round's no-save run; and minus the
median of the same run's steps outside any write, which no drift between runs reaches) per save, pooled over
rounds (median, IQR); the async stall as a ratio of the sync stall (per round, median and IQR over rounds);
the steps that ran while the write was in flight against the no-save median (per round) and against the same
run's steps after the write ended (no drift between runs); the write's seconds in the background;
what the save costs training in all (the saving step and the N-1 after it, minus N no-save medians); the host
memory a saving run holds over the no-save run of its round (anonymous resident memory at step starts: the
median, and the most; file pages that hashing maps are not counted) and the buffers' bytes. Where the saving
step's time goes: the SAVE handler, take_checkpoint and its host copies; and what the training thread did during
the steps while the write ran: on a CPU, runnable but waiting for one (other threads and processes), asleep (the
GIL, page faults, I/O) (Linux schedstat). On a GPU the host copies are only enqueued in take_checkpoint (pinned
buffers, non_blocking): the device-to-host copy's time shows in the stall, after the step's synchronize.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

import torch

import trainbus.plugins.checkpoints.background as background
import trainbus.plugins.checkpoints.checkpoint as ck
from benchmarks.checkpoint_speed import JOBS, _trim_heap, make_engine
from benchmarks.common import print_table
from trainbus.engine import Engine, Event, Priority
from trainbus.plugins.checkpoints.checkpoint import Checkpointing
from trainbus.plugins.checkpoints.directory import PREFIX
from trainbus.plugins.checkpoints.snapshot import HostBuffers
from trainbus.plugins.checkpoints.writing import PendingCheckpoint

NO_SAVE, SYNC = "no save", "sync save"


@dataclass
class Job:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    batch: Any
    loss_fn: Callable[..., torch.Tensor] | None
    title: str


@dataclass
class Trace:
    """What one run recorded: step marks, and per save its handler / take / copy times and its write."""

    marks: list[float] = field(default_factory=list)  # perf_counter at each STEP_START (after a device sync)
    sched: list[tuple[float, float]] = field(default_factory=list)  # the training thread's (on CPU, runnable) s
    handler: dict[int, float] = field(default_factory=dict)  # step -> seconds in the SAVE handler
    take: dict[int, float] = field(default_factory=dict)  # step -> seconds in take_checkpoint
    copy: dict[int, float] = field(default_factory=dict)  # step -> seconds copying into the host buffers
    writes: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> write (start, end)
    buffer_bytes: int = 0
    waited: dict[int, float] = field(default_factory=dict)  # step -> seconds its save waited for the write before
    anon: list[int] = field(default_factory=list)  # anonymous resident bytes at each STEP_START (no gradients then)
    off_main: int = 0  # writes that ran on another thread than the training thread


_trace = Trace()


@contextlib.contextmanager
def probes() -> Iterator[None]:
    """Time take_checkpoint, the host copies and the writes (wrapped here, restored after)."""
    take, copy, write = ck.take_checkpoint, HostBuffers.take, PendingCheckpoint.write

    def timed_take(engine: Engine, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return take(engine, *args, **kwargs)
        finally:
            _trace.take[engine.state.global_step] = time.perf_counter() - start

    def timed_copy(self: HostBuffers, prefix: str, tensors: Any) -> Any:
        start = time.perf_counter()
        try:
            return copy(self, prefix, tensors)
        finally:
            step = len(_trace.marks)  # the step whose save this is
            _trace.copy[step] = _trace.copy.get(step, 0.0) + time.perf_counter() - start
            _trace.buffer_bytes = max(_trace.buffer_bytes, self.nbytes)

    def timed_write(self: PendingCheckpoint) -> Path:
        start = time.perf_counter()
        try:
            return write(self)
        finally:
            _trace.writes[int(self.final.name.removeprefix(PREFIX))] = (start, time.perf_counter())
            _trace.off_main += threading.current_thread() is not threading.main_thread()

    ck.take_checkpoint, HostBuffers.take, PendingCheckpoint.write = timed_take, timed_copy, timed_write  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        ck.take_checkpoint, HostBuffers.take, PendingCheckpoint.write = take, copy, write  # type: ignore[method-assign]


def mlp_job(device: torch.device, batch: int, quick: bool) -> Job:
    widths = JOBS["tiny" if quick else "large"][0]
    model = make_engine(widths).model.to(device)  # checkpoint_speed's model; a fresh optimizer on its device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(batch, widths[0], generator=g), torch.randint(0, widths[-1], (batch,), generator=g))
    parameters = sum(p.numel() for p in model.parameters())
    title = f"MLP {'-'.join(map(str, widths))} ({parameters / 1e6:.2f}M parameters), batch {batch}"
    return Job(model, optimizer, tuple(t.to(device) for t in data), torch.nn.CrossEntropyLoss(), title)


def gpt2_job(device: torch.device, batch: int, quick: bool) -> Job:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    small = {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 64, "vocab_size": 128} if quick else {}
    config = GPT2Config(**small)  # GPT-2 small (124M) without --quick
    model = GPT2LMHeadModel(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, config.n_positions), generator=g).to(device)
    parameters = sum(p.numel() for p in model.parameters())
    title = f"GPT2LMHeadModel ({parameters / 1e6:.1f}M parameters), batch {batch} x {config.n_positions} tokens"
    return Job(model, optimizer, {"input_ids": ids, "labels": ids}, None, title)


def warm_up(job: Job) -> None:
    """Two steps untimed before the rounds: the optimizer's state allocated, the allocator's caches filled."""
    Engine(job.model, job.optimizer, train_data=[job.batch] * 2, max_steps=2, loss_fn=job.loss_fn).fit()


def _anon_rss() -> int:
    """This process's anonymous resident bytes (Linux; 0 elsewhere): heap and pinned memory, not mapped files."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _sched() -> tuple[float, float]:
    """This thread's seconds on a CPU and runnable waiting for one (Linux schedstat; else CPU time and 0)."""
    try:
        on_cpu, waiting, _ = Path("/proc/thread-self/schedstat").read_text().split()
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), 0.0


def run(job: Job, variant: str, every: int, saves: int, root: Path, device: torch.device) -> Trace:
    """One run of ``variant`` (see the module doc); its folder is deleted after, untimed."""
    global _trace
    _trace = trace = Trace()
    max_steps = every * (saves + 2)
    out = Path(tempfile.mkdtemp(dir=root, prefix="run-"))
    plugin = Checkpointing(
        out, save_total_limit=2, save_strategy="steps", save_steps=every if variant != NO_SAVE else max_steps,
        save_async=variant not in (SYNC, NO_SAVE),  # no save's last save: no buffers held, untimed
    )  # fmt: skip
    save = plugin.save

    def timed_save(ev: Any) -> None:
        start = time.perf_counter()
        waited = plugin.writer.waited_seconds if plugin.writer is not None else 0.0
        save(ev)
        step = ev.engine.state.global_step
        trace.handler[step] = time.perf_counter() - start
        trace.waited[step] = (plugin.writer.waited_seconds if plugin.writer is not None else 0.0) - waited

    plugin.save = timed_save  # type: ignore[method-assign]  # before the Engine attaches the plugin
    engine = Engine(job.model, job.optimizer, train_data=[job.batch] * max_steps, max_steps=max_steps,
                    loss_fn=job.loss_fn, plugins=[plugin])  # fmt: skip
    cuda = device.type == "cuda"

    def mark(ev: Any) -> None:
        if cuda:
            torch.cuda.synchronize(device)
        trace.marks.append(time.perf_counter())
        trace.sched.append(_sched())
        trace.anon.append(_anon_rss())

    engine.on(Event.STEP_START, mark, priority=Priority.FIRST, before="*")
    gc.collect()  # the run before's engine (cycles) and its memory gone, the heap trimmed: the same start
    _trim_heap()
    if cuda and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # the pinned buffers torch's host allocator kept from the run before
    engine.fit()
    shutil.rmtree(out)
    os.sync()
    return trace


# -- analysis ---------------------------------------------------------------------------------------
def _times(marks: list[float]) -> dict[int, float]:
    """Step s (1-based) -> seconds from its STEP_START to the next one's (the last step has none)."""
    return {s: marks[s] - marks[s - 1] for s in range(1, len(marks))}


def _spread(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    quartiles = statistics.quantiles(values, n=4)
    return quartiles[2] - quartiles[0]


def _cell(values: list[float], scale: float = 1.0, digits: int = 1, suffix: str = "") -> str:
    if not values:
        return "-"
    scaled = [v * scale for v in values]
    return f"{statistics.median(scaled):.{digits}f}{suffix} (IQR {_spread(scaled):.{digits}f})"


@dataclass
class Figures:
    """One run variant's figures pooled over rounds: per-save lists, and per-round medians or ratios."""

    stalls: list[float] = field(default_factory=list)  # saving step - the round's no-save median
    own_stalls: list[float] = field(default_factory=list)  # saving step - this run's quiet median (no drift)
    ratio: list[float] = field(default_factory=list)  # per round: median stall / the sync run's
    own_ratio: list[float] = field(default_factory=list)  # per round: the same with own_stalls
    writing: list[float] = field(default_factory=list)  # per round: steps while the write ran / no-save median
    writing_quiet: list[float] = field(default_factory=list)  # per round: the same / this run's quiet steps
    writing_steps: int = 0
    step_s: list[float] = field(default_factory=list)  # per round: median step between saves
    shares: list[tuple[float, float]] = field(default_factory=list)  # per round, of the training thread's wall
    # time (while writing; no save: all steps): on a CPU, and runnable but waiting for one; the rest it slept
    write_s: list[float] = field(default_factory=list)
    handler: list[float] = field(default_factory=list)
    take: list[float] = field(default_factory=list)
    copy: list[float] = field(default_factory=list)
    first_stall: list[float] = field(default_factory=list)  # the save that allocated the buffers
    waited: float = 0.0
    writes: int = 0  # writes that ran (every save of every round, the untimed ones included)
    off_main: int = 0  # of those, the ones a background thread ran
    held: list[float] = field(default_factory=list)  # per round: median anonymous RSS at step starts - no save's
    held_most: list[float] = field(default_factory=list)  # per round: the same with the most at a step start
    cost: list[float] = field(default_factory=list)  # per save: saving step + N-1 after - N no-save medians
    cost_ratio: list[float] = field(default_factory=list)  # per round: median cost / the sync run's
    buffer_bytes: int = 0


def _steps(trace: Trace, times: dict[int, float], saving: range, every: int, f: Figures) -> tuple[list, list]:
    """The steps between saves, split into those that ran while the write was in flight and the quiet ones."""
    writing: list[float] = []
    quiet: list[float] = []
    spent = [0.0, 0.0, 0.0]  # wall, on CPU, waiting for a CPU
    for k in saving:
        end = trace.writes[k][1]
        for s in range(k + 1, k + every):
            if trace.marks[s - 1] < end:  # the step started before the write ended (never for a sync save)
                writing.append(times[s])
                _add(spent, times[s], trace.sched[s], trace.sched[s - 1])
            else:
                quiet.append(times[s])
        f.write_s.append(end - trace.writes[k][0])
        f.handler.append(trace.handler[k])
        f.take.append(trace.take[k])
        f.copy.append(trace.copy.get(k, 0.0))
    if spent[0]:
        f.shares.append((spent[1] / spent[0], spent[2] / spent[0]))
    return writing, quiet


def _round(traces: dict[str, Trace], every: int, saves: int, figures: dict[str, Figures]) -> None:
    """Add one round's runs to ``figures`` (see the module doc for what is measured against what)."""
    none, base_times = traces[NO_SAVE], _times(traces[NO_SAVE].marks)
    region = range(every + 1, every * (saves + 2))
    base = statistics.median(base_times[s] for s in region)
    figures[NO_SAVE].step_s.append(base)
    spent = [0.0, 0.0, 0.0]
    for s in region:
        _add(spent, base_times[s], none.sched[s], none.sched[s - 1])
    figures[NO_SAVE].shares.append((spent[1] / spent[0], spent[2] / spent[0]))
    sync: tuple[float, ...] | None = None
    saving = range(2 * every, (saves + 2) * every, every)
    for variant, trace in traces.items():
        f, times = figures[variant], _times(trace.marks)
        f.held.append(statistics.median(trace.anon[s] - none.anon[s] for s in region))
        f.held_most.append(max(trace.anon[s] for s in region) - max(none.anon[s] for s in region))
        f.buffer_bytes = max(f.buffer_bytes, trace.buffer_bytes)
        if variant == NO_SAVE:
            continue
        writing, quiet = _steps(trace, times, saving, every, f)
        own = statistics.median(quiet or writing)
        stalls, own_stalls = [times[k] - base for k in saving], [times[k] - own for k in saving]
        f.stalls += stalls
        f.own_stalls += own_stalls
        costs = [sum(times[s] for s in range(k, k + every)) - every * base for k in saving]
        f.cost += costs
        f.first_stall.append(times[every] - base)
        medians = statistics.median(stalls), statistics.median(own_stalls), statistics.median(costs)
        if variant == SYNC:
            sync = medians
        elif sync is not None and min(sync) > 0:
            f.ratio.append(medians[0] / sync[0])
            f.own_ratio.append(medians[1] / sync[1])
            f.cost_ratio.append(medians[2] / sync[2])
        f.step_s.append(statistics.median(writing + quiet))
        if writing:
            f.writing.append(statistics.median(writing) / base)
            f.writing_steps += len(writing)
            if quiet:
                f.writing_quiet.append(statistics.median(writing) / statistics.median(quiet))
        f.waited += sum(trace.waited[k] for k in saving)
        f.writes, f.off_main = f.writes + len(trace.writes), f.off_main + trace.off_main


def _add(spent: list[float], wall: float, now: tuple[float, float], before: tuple[float, float]) -> None:
    spent[0] += wall
    spent[1] += now[0] - before[0]
    spent[2] += now[1] - before[1]


def _shares(shares: list[tuple[float, float]]) -> str:
    if not shares:
        return "-"
    on, runnable = (statistics.median(s[i] for s in shares) for i in (0, 1))
    return f"{on:.0%} / {runnable:.0%} / {max(0.0, 1 - on - runnable):.0%}"


def _pct(ratios: list[float]) -> str:
    return _cell([r - 1 for r in ratios], 100, 1, "%") if ratios else "-"


def _main_row(variant: str, f: Figures) -> list[str]:
    saving, is_async = variant != NO_SAVE, variant not in (NO_SAVE, SYNC)
    return [
        variant,
        _cell(f.step_s, 1e3),
        _cell(f.stalls, 1e3) if saving else "-",
        _cell(f.own_stalls, 1e3) if saving else "-",
        f"{_cell(f.ratio, 100, 1, '%')}; {_cell(f.own_ratio, 100, 1, '%')}" if is_async else "-",
        f"{_pct(f.writing)} ({f.writing_steps} steps)" if f.writing else "-",
        _pct(f.writing_quiet),
        (_cell(f.cost, 1e3) + (f"; {_cell(f.cost_ratio, 100, 0, '%')} of sync" if is_async else "")) if saving else "-",
        _cell(f.write_s, 1, 2) if saving else "-",
        f"{_cell(f.held, 1e-6, 0)}; most {_cell(f.held_most, 1e-6, 0)}" if saving else "-",
    ]


def tables(figures: dict[str, Figures], enqueued: bool = False) -> tuple[list[list[str]], list[list[str]]]:
    """The main table (one row per run) and the breakdown of the saving step (one row per saving run)."""
    main, breakdown = [], []
    for variant, f in figures.items():
        main.append(_main_row(variant, f))
        if variant == NO_SAVE:
            continue
        copy = statistics.median(f.copy)
        rate = f", {f.buffer_bytes / copy / 1e9:.1f} GB/s" if f.buffer_bytes and copy and not enqueued else ""
        rate += " (enqueued: the copy's time is in the stall)" if enqueued and f.buffer_bytes else ""
        breakdown.append([
            variant,
            _cell(f.handler, 1e3),
            _cell(f.take, 1e3),
            _cell(f.copy, 1e3) + rate,
            _cell([s - h for s, h in zip(f.stalls, f.handler)], 1e3),
            _cell(f.first_stall, 1e3),
            f"{f.waited:.2f}",
            f"{f.buffer_bytes / 1e6:.0f}",
            f"{_shares(f.shares)} (no save: {_shares(figures[NO_SAVE].shares)})",
        ])  # fmt: skip
    return main, breakdown


MAIN_HEADER = [
    "run", "step ms (between saves)", "stall ms (saving step - no-save median)",
    "stall ms (saving step - same run's quiet steps)", "async stall / sync stall (by the two stalls)",
    "steps while writing vs no save", "vs same run's steps after the write",
    "cost per save ms (saving step + the N-1 after, over no save)", "write s (in the background for async)",
    "host MB held over the no-save run (step starts: median; most)",
]  # fmt: skip
BREAKDOWN_HEADER = [
    "run", "SAVE handler ms", "take_checkpoint ms", "host copies ms", "stall outside the handler ms",
    "first save's stall ms (buffers allocated)", "s the measured saves waited for a write", "buffers MB",
    "training thread while writing: on a CPU / waiting for one / asleep (GIL, I/O)",
]  # fmt: skip


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]  # fmt: skip
    except OSError:
        names = []
    return f"{names[0] if names else 'CPU'} ({os.cpu_count()} cores)"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("mlp51m", "gpt2"), default="mlp51m")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=int, default=None, help="save every N steps (default: 10 mlp51m, 40 gpt2)")
    parser.add_argument("--saves", type=int, default=3, help="measured saves per run (default 3)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every run (default: 5 cpu, 2 cuda)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: 64 mlp51m, 8 gpt2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1)")
    parser.add_argument("--niceness", default=str(background.WRITER_NICENESS),
                        help="comma-separated writer niceness values, one async run each (e.g. 10,0)")  # fmt: skip
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps: checks the code path only")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here")
    if args.model == "gpt2" and args.device == "cpu" and not args.quick:
        parser.error("--model gpt2 is sized for a GPU: use --device cuda (or --quick to check the code path)")
    for name in ("steps", "saves", "rounds", "batch", "threads"):
        value = getattr(args, name)
        if value is not None and value < (2 if name == "steps" else 1):
            parser.error(f"--{name} must be at least {2 if name == 'steps' else 1}, got {value}")
    try:
        args.niceness = [int(n) for n in args.niceness.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--niceness takes comma-separated integers, got {args.niceness!r}")
    if not args.niceness or not all(0 <= n <= 19 for n in args.niceness):
        parser.error(f"--niceness values must be in 0..19, got {args.niceness}")
    gpt2 = args.model == "gpt2"
    args.steps = args.steps or (3 if args.quick else 40 if gpt2 else 10)
    args.rounds = args.rounds or (2 if args.quick else 2 if args.device == "cuda" else 5)
    args.batch = args.batch or (2 if args.quick else 8 if gpt2 else 64)
    return args


def main(argv: list[str] | None = None) -> dict[str, Figures]:
    args = parse(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    job = (gpt2_job if args.model == "gpt2" else mlp_job)(device, args.batch, args.quick)
    asyncs = {f"async save (writer nice {n})": n for n in args.niceness}
    variants = [NO_SAVE, SYNC, *asyncs]
    figures = {variant: Figures() for variant in variants}
    warm_up(job)
    loads = [os.getloadavg()[0]]  # 1-minute load average: before, then after each round
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-async-") as root, probes():
        for round_ in range(args.rounds):
            order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
            traces = {}
            for variant in order:
                niceness = asyncs.get(variant, background.WRITER_NICENESS)
                with _writer_niceness(niceness):
                    traces[variant] = run(job, variant, args.steps, args.saves, Path(root), device)
            _round({v: traces[v] for v in variants}, args.steps, args.saves, figures)
            loads.append(os.getloadavg()[0])
    main_rows, breakdown = tables(figures, enqueued=device.type == "cuda")
    title = (
        f"{job.title} on {_machine(device)}, {date.today()}; save every {args.steps} steps, {args.saves} measured "
        f"saves x {args.rounds} rounds, torch threads {args.threads}; 1-minute load average before and after "
        f"each round {', '.join(f'{load:.1f}' for load in loads)} ({time.perf_counter() - started:.0f} s)"
    )
    print_table(title, MAIN_HEADER, main_rows)
    print_table("The saving step's time, by part (medians over saves)", BREAKDOWN_HEADER, breakdown)
    if any(f.waited > 0.005 for f in figures.values()):  # a join of a thread that has ended takes microseconds
        print(f"\nA save waited for the write before it: writes outlast {args.steps - 1} steps here; raise --steps.")
    return figures


@contextlib.contextmanager
def _writer_niceness(value: int) -> Iterator[None]:
    saved = background.WRITER_NICENESS
    background.WRITER_NICENESS = value
    try:
        yield
    finally:
        background.WRITER_NICENESS = saved


if __name__ == "__main__":
    main()
