"""Peers on one job, one table: a raw PyTorch loop, trainbus's Trainer, transformers' Trainer, Lightning, ignite.

Usage:
  python -m benchmarks.peers [--job mlp|gpt2] [--device cpu|cuda] [--rounds 3] [--steps N] [--warmup N]
                             [--loops raw,trainbus,hf,lightning,ignite] [--threads N] [--concurrent N] [--tiny]

On a GPU machine (one CUDA device; ``pip install -e .`` from the repository root, plus
``pip install transformers lightning pytorch-ignite``), from the repository root, both jobs in one
command (about 10 minutes: 3 rounds of 5 processes per job)::

  python -m benchmarks.peers --device cuda --job mlp && python -m benchmarks.peers --device cuda --job gpt2

Each (loop, round) runs in a fresh process (``--child LOOP``); the loops run in order in even rounds
and in reverse order in odd ones. A child builds the same model (same seed), data and training
set-up, trains ``warmup + steps`` optimizer steps (plus, on CUDA, ``counted`` steps with host-sync
counting and 5 profiled steps) and times the ``steps`` after the warm-up between two readings of
the clock (after ``torch.cuda.synchronize()`` on CUDA). Every loop calls one meter at the end of
each optimizer step: the raw loop directly, trainbus from a handler on ``Event.STEP_END``,
transformers from ``TrainerCallback.on_step_end``, Lightning from ``Callback.on_train_batch_end``
(when ``trainer.global_step`` moved), ignite from an ``ITERATION_COMPLETED`` handler.

The jobs (the same work in every loop: fused AdamW, weight decay 0, in HF's two parameter groups,
biases and LayerNorms apart; gradient clipping at 1.0; the schedule as a per-optimizer-step LambdaLR
of HF's closed form; accumulation; one epoch of exactly the steps run):
  mlp   MLP 256-512-512-10, batch 64, fp32, lr 1e-3, linear schedule, DataLoader (shuffled, no
        workers): launch-bound on a GPU, so the table shows each loop's per-step overhead
        (on a CPU the step's arithmetic dominates)
  gpt2  GPT-2 (GPT2Config defaults, 124M), seq 512, batch 16, accumulation 2, bf16 autocast, lr 3e-4,
        cosine schedule with 10% warmup, DataLoader with 2 workers (pinned on CUDA); CUDA only (``--tiny``
        shrinks it to check the code path on a CPU in seconds; its timings mean nothing)

Per loop: ms per optimizer step (median over rounds of each run's mean), the ratio to the raw loop,
the same in the process's CPU time (steadier than the clock on a shared machine, where neighbours
stretch wall time; on CUDA it is the host's time per step, what a launch-bound step is made of),
samples/s (mlp) or tokens/s (gpt2), peak memory (the process's peak RSS on CPU,
``torch.cuda.max_memory_allocated`` on CUDA) and, on CUDA, host syncs per step (counted with
``torch.cuda.set_sync_debug_mode("warn")``) and CUDA kernels per step (``torch.profiler``), with the
kernels whose count per step differs from the raw loop's listed under the table.

How each framework is driven: trainbus and transformers through their ``Trainer`` with
``TrainingArguments`` saying the job (no progress bar, no saving, no evaluation, logging only at
the last step so no logging falls in the timed window); Lightning through ``Trainer.fit`` with
``accumulate_grad_batches``, ``gradient_clip_val=1.0`` and the scheduler at ``interval="step"``
(under bf16-mixed Lightning refuses to clip for a fused optimizer, so ``configure_gradient_clipping``
clips with torch directly there); ignite through an ``Engine`` with the update function of its docs
(``create_supervised_trainer`` has no clipping), which returns the detached loss, not ``loss.item()``,
so it reads no value per step, as the raw loop. A loop whose library is missing reads "not
installed". ``--concurrent N`` runs N children at a time: a quick check that everything runs; its
timings are not comparable.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

LOOPS = ("raw", "trainbus", "hf", "lightning", "ignite")
LABELS = {
    "raw": "raw PyTorch loop",
    "trainbus": "trainbus Trainer",
    "hf": "transformers Trainer",
    "lightning": "Lightning",
    "ignite": "ignite",
}
MARKER = "PEERS-RESULT "
PROFILED = 5  # CUDA: optimizer steps under torch.profiler, after the sync-counting window


@dataclass(frozen=True)
class Job:
    name: str
    batch: int
    accumulation: int
    bf16: bool
    schedule: str  # "linear" or "cosine" (HF's closed forms)
    warmup: float  # warmup as a ratio of the optimizer steps (HF's warmup_steps < 1)
    workers: int
    lr: float
    seq: int  # tokens per sample; 0 for a job counted in samples

    @property
    def unit(self) -> str:
        return "tokens" if self.seq else "samples"

    def per_step(self) -> int:
        return self.batch * self.accumulation * (self.seq or 1)


JOBS = {
    "mlp": Job("mlp", batch=64, accumulation=1, bf16=False, schedule="linear", warmup=0.0, workers=0, lr=1e-3, seq=0),
    "gpt2": Job(
        "gpt2", batch=16, accumulation=2, bf16=True, schedule="cosine", warmup=0.1, workers=2, lr=3e-4, seq=512
    ),
}
TINY_GPT2 = replace(JOBS["gpt2"], batch=2, seq=32)

#: (warm-up, timed, host-sync counted) optimizer steps by (job, device)
PLANS = {
    ("mlp", "cpu"): (20, 300, 0),
    ("mlp", "cuda"): (30, 1000, 100),
    ("gpt2", "cuda"): (10, 60, 20),
    ("gpt2", "cpu"): (2, 4, 0),  # --tiny only
}


def installed(loop: str) -> bool:
    module = {"raw": "torch", "trainbus": "trainbus", "hf": "transformers", "ignite": "ignite"}.get(loop)
    if module is not None:
        return importlib.util.find_spec(module) is not None
    return any(importlib.util.find_spec(m) is not None for m in ("lightning", "pytorch_lightning"))


# ------------------------------------------------------------------------------------------ the meter
class Meter:
    """Called at the end of every optimizer step (1-based count): times, counts syncs, profiles kernels."""

    def __init__(self, warm: int, timed: int, counted: int, cuda: bool) -> None:
        import torch

        self.torch = torch
        self.cuda = cuda
        self.warm, self.timed, self.counted = warm, timed, counted
        self.profiled = PROFILED if cuda else 0
        self.total = warm + timed + counted + self.profiled
        self.last = 0
        self.t0 = self.t1 = self.c0 = self.c1 = 0.0
        self.syncs = 0
        self.kernels: dict[str, float] = {}
        self._profiler: Any = None
        self._showwarning: Any = None

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def step_end(self, step: int) -> None:
        if step == self.last:  # Lightning's batch end fires on every micro-batch
            return
        self.last = step
        if step == self.warm:
            self._sync()
            self.t0, self.c0 = time.perf_counter(), time.process_time()
        if step == self.warm + self.timed:
            self._sync()
            self.t1, self.c1 = time.perf_counter(), time.process_time()
            if self.counted:
                self._count_syncs(True)
        if self.cuda and step == self.warm + self.timed + self.counted:
            if self.counted:
                self._count_syncs(False)
            from torch.profiler import ProfilerActivity, profile

            self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._profiler.start()
        if step == self.total and self._profiler is not None:
            self._sync()
            self._profiler.stop()
            self._count_kernels(self._profiler)
            self._profiler = None

    def _count_syncs(self, on: bool) -> None:
        torch = self.torch
        if on:
            warnings.simplefilter("always")
            self._showwarning = original = warnings.showwarning

            def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
                if "synchroniz" in str(message):
                    self.syncs += 1
                else:
                    original(message, category, *args, **kwargs)

            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
        else:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = self._showwarning

    def _count_kernels(self, profiler: Any) -> None:
        from torch.autograd import DeviceType

        counts: dict[str, int] = {}
        for event in profiler.events():
            if event.device_type == DeviceType.CUDA:
                counts[event.name[:80]] = counts.get(event.name[:80], 0) + 1
        self.kernels = {name: n / self.profiled for name, n in sorted(counts.items())}

    def result(self, job: Job) -> dict[str, Any]:
        torch = self.torch
        if self.last < self.total:
            raise RuntimeError(f"the loop stopped after {self.last} optimizer steps; the plan needs {self.total}")
        ms = 1000 * (self.t1 - self.t0) / self.timed
        if self.cuda:
            peak_mib = torch.cuda.max_memory_allocated() / 2**20
        else:
            import resource

            peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        return {
            "ms_per_step": ms,
            "cpu_ms_per_step": 1000 * (self.c1 - self.c0) / self.timed,
            "throughput": job.per_step() / (ms / 1000),
            "peak_mib": peak_mib,
            "syncs_per_step": self.syncs / self.counted if self.counted else None,
            "kernels_per_step": sum(self.kernels.values()) if self.kernels else None,
            "kernels": self.kernels,
        }


# ------------------------------------------------------------------------------------ the job's parts
class RepeatDataset:
    """``n`` samples drawn in turn from a small fixed base, so building the dataset costs nothing."""

    def __init__(self, n: int, base: list[dict[str, Any]]) -> None:
        self.n, self.base = n, base

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.base[i % len(self.base)]


@dataclass
class Setup:
    """What every loop gets: the same model (same seed), data, schedule and meter."""

    job: Job
    device: Any
    model: Any
    dataset: RepeatDataset
    steps: int  # optimizer steps in all (warm-up, timed, counted, profiled)
    meter: Meter
    tiny: bool

    @property
    def cuda(self) -> bool:
        return bool(self.device.type == "cuda")

    def optimizer(self, model: Any) -> Any:
        import torch

        no_decay = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()}
        no_decay |= {id(p) for name, p in model.named_parameters() if name.endswith("bias")}
        decay = [p for p in model.parameters() if id(p) not in no_decay]
        rest = [p for p in model.parameters() if id(p) in no_decay]
        groups = [{"params": g, "weight_decay": 0.0} for g in (decay, rest) if g]
        return torch.optim.AdamW(groups, lr=self.job.lr, fused=True)

    def factor(self, step: int) -> float:
        """HF's linear / cosine schedule (no cycles) as a multiplier of the initial lr."""
        warmup = math.ceil(self.steps * self.job.warmup)
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, self.steps - warmup)
        if self.job.schedule == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    def scheduler(self, optimizer: Any) -> Any:
        import torch

        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)

    def loader(self) -> Any:
        import torch

        return torch.utils.data.DataLoader(
            self.dataset,
            batch_size=self.job.batch,
            shuffle=True,
            generator=torch.Generator().manual_seed(0),
            num_workers=self.job.workers,
            pin_memory=self.cuda,
        )

    def autocast(self) -> Any:
        import torch

        if not self.job.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def to_device(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}


def _loss(outputs: Any) -> Any:
    return outputs["loss"] if isinstance(outputs, dict) else outputs.loss


def _make_setup(job: Job, device_name: str, warm: int, timed: int, counted: int, tiny: bool) -> Setup:
    import torch

    device = torch.device(device_name)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if job.name == "mlp":
        from benchmarks.common import ClassifierWithLoss

        model: Any = ClassifierWithLoss(
            torch.nn.Sequential(
                torch.nn.Linear(256, 512),
                torch.nn.ReLU(),
                torch.nn.Linear(512, 512),
                torch.nn.ReLU(),
                torch.nn.Linear(512, 10),
            )
        )
        base = [
            {"x": torch.randn(256, generator=g), "labels": torch.randint(0, 10, (), generator=g)} for _ in range(4096)
        ]
    else:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=64) if tiny else GPT2Config()
        # as transformers 5's Trainer does (TrainingArguments.use_cache=False) in every loop, so each does the
        # same work: no KV cache built in training; the model then checks position_ids for packed sequences,
        # one host read per forward (transformers' masking_utils), in every loop alike
        config.use_cache = False
        model = GPT2LMHeadModel(config)
        base = []
        for _ in range(512):
            ids = torch.randint(0, config.vocab_size, (job.seq,), generator=g)
            base.append({"input_ids": ids, "labels": ids.clone()})
    meter = Meter(warm, timed, counted, cuda=device.type == "cuda")
    samples = meter.total * job.accumulation * job.batch
    return Setup(job, device, model, RepeatDataset(samples, base), meter.total, meter, tiny)


# ------------------------------------------------------------------------------------------ the loops
def run_raw(s: Setup) -> None:
    import torch

    model = s.model.to(s.device).train()
    optimizer = s.optimizer(model)
    scheduler = s.scheduler(optimizer)
    params = list(model.parameters())
    k = s.job.accumulation
    batches = iter(s.loader())
    for step in range(1, s.steps + 1):
        for _ in range(k):
            batch = s.to_device(next(batches))
            with s.autocast():
                loss = _loss(model(**batch))
            (loss / k if k > 1 else loss).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        s.meter.step_end(step)


def _training_arguments(cls: Any, s: Setup) -> Any:
    job = s.job
    output_dir = tempfile.mkdtemp(prefix="peers-")  # nothing is saved there; removed at exit
    atexit.register(shutil.rmtree, output_dir, ignore_errors=True)
    return cls(
        output_dir=output_dir,
        per_device_train_batch_size=job.batch,
        gradient_accumulation_steps=job.accumulation,
        max_steps=s.steps,
        learning_rate=job.lr,
        weight_decay=0.0,
        lr_scheduler_type=job.schedule,
        warmup_steps=job.warmup,
        max_grad_norm=1.0,
        optim="adamw_torch_fused",
        bf16=job.bf16,
        logging_steps=s.steps,  # one log, after the measured steps
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=job.workers,
        dataloader_pin_memory=s.cuda,
        use_cpu=not s.cuda,
        seed=0,
    )


def run_trainbus(s: Setup) -> None:
    from trainbus.engine import Event, Plugin
    from trainbus.plugins import Trainer, TrainingArguments

    meter = s.meter

    class StepMeter(Plugin):
        def attach(self, engine: Any) -> None:
            self.on(engine, Event.STEP_END, lambda ev: meter.step_end(ev.engine.state.global_step))

    args = _training_arguments(TrainingArguments, s)
    Trainer(model=s.model, args=args, train_dataset=s.dataset, callbacks=[StepMeter()]).train()


def run_hf(s: Setup) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    meter = s.meter

    class StepMeter(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            meter.step_end(state.global_step)

    args = _training_arguments(TrainingArguments, s)
    Trainer(model=s.model, args=args, train_dataset=s.dataset, callbacks=[StepMeter()]).train()


def _lightning() -> Any:
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    return pl


def run_lightning(s: Setup) -> None:
    import torch

    pl = _lightning()
    meter = s.meter
    # Lightning refuses to clip for an optimizer that unscales its own gradients (fused AdamW) under
    # mixed precision; with bf16 there is no scaler, so clipping with torch is the same work
    clip_with_torch = s.job.bf16

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = s.model

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return _loss(self.model(**batch))

        def configure_optimizers(self) -> Any:
            optimizer = s.optimizer(self.model)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": s.scheduler(optimizer), "interval": "step"}}

        def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: Any = None, **kwargs: Any) -> None:
            if clip_with_torch:
                torch.nn.utils.clip_grad_norm_(self.parameters(), gradient_clip_val)
            else:
                super().configure_gradient_clipping(optimizer, gradient_clip_val, **kwargs)

    class StepMeter(pl.Callback):  # type: ignore[misc]
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            meter.step_end(trainer.global_step)

    trainer = pl.Trainer(
        accelerator="gpu" if s.cuda else "cpu",
        devices=1,
        max_steps=s.steps,
        max_epochs=1,
        precision="bf16-mixed" if s.job.bf16 else "32-true",
        accumulate_grad_batches=s.job.accumulation,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[StepMeter()],
    )
    trainer.fit(Module(), train_dataloaders=s.loader())


def run_ignite(s: Setup) -> None:
    import torch
    from ignite.engine import Engine, Events

    model = s.model.to(s.device)
    optimizer = s.optimizer(model)
    scheduler = s.scheduler(optimizer)
    params = list(model.parameters())
    k = s.job.accumulation

    def update(engine: Any, batch: Any) -> Any:
        model.train()
        batch = s.to_device(batch)
        with s.autocast():
            loss = _loss(model(**batch))
        (loss / k if k > 1 else loss).backward()
        if engine.state.iteration % k == 0:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    trainer = Engine(update)
    meter = s.meter
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=k), lambda e: meter.step_end(e.state.iteration // k))
    trainer.run(s.loader(), max_epochs=1)


RUNNERS: dict[str, Callable[[Setup], None]] = {
    "raw": run_raw,
    "trainbus": run_trainbus,
    "hf": run_hf,
    "lightning": run_lightning,
    "ignite": run_ignite,
}


def child(loop: str, job: Job, device: str, warm: int, timed: int, counted: int, threads: int, tiny: bool) -> dict:
    """One loop in this (fresh) process; returns its measurements."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", module="pytorch_lightning")
    import torch

    if threads:
        torch.set_num_threads(threads)
    setup = _make_setup(job, device, warm, timed, counted, tiny)
    RUNNERS[loop](setup)
    return setup.meter.result(job)


# ------------------------------------------------------------------------------------------ the driver
def _run_one(loop: str, child_args: list[str]) -> tuple[str, dict[str, Any] | str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "-m", "benchmarks.peers", "--child", loop, *child_args]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=3600)
    lines = [line[len(MARKER) :] for line in proc.stdout.splitlines() if line.startswith(MARKER)]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        print(f"{LABELS[loop]} failed (rc={proc.returncode}):\n" + "\n".join(tail[-30:]), file=sys.stderr)
        return loop, f"failed: {tail[-1][:80] if tail else 'no output'}"
    return loop, json.loads(lines[-1])


def drive(loops: list[str], rounds: int, child_args: list[str], concurrent_runs: int) -> dict[str, Any]:
    """Every installed loop ``rounds`` times, each in its own process, the order alternating by round."""
    results: dict[str, Any] = {loop: [] if installed(loop) else "not installed" for loop in loops}
    ready = [loop for loop in loops if installed(loop)]
    order = [(r, loop) for r in range(rounds) for loop in (ready if r % 2 == 0 else ready[::-1])]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrent_runs)) as pool:
        futures = [pool.submit(_run_one, loop, child_args) for _, loop in order]
        for (round_, _), future in zip(order, futures):
            loop, result = future.result()
            if isinstance(results[loop], str):
                continue  # failed before
            if isinstance(result, str):
                results[loop] = result
                continue
            results[loop].append(result)
            print(f"round {round_ + 1}/{rounds} {LABELS[loop]}: {result['ms_per_step']:.3f} ms/step", file=sys.stderr)
    return results


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def table(results: dict[str, Any], unit: str, cuda: bool) -> tuple[list[str], list[list[str]]]:
    """The header and one row per loop: medians over the loop's runs, ratios to the raw loop's medians."""
    memory = "peak CUDA MiB (max_memory_allocated)" if cuda else "peak RSS MiB"
    header = ["loop", "ms/step (median)", "vs raw", "CPU ms/step (median)", "vs raw (CPU)", f"{unit}/s", memory]
    header += ["host syncs/step", "CUDA kernels/step"] if cuda else []
    header.append("each run's ms/step")
    raw = results.get("raw")
    raw_ms = _median(raw, "ms_per_step") if isinstance(raw, list) and raw else None
    raw_cpu = _median(raw, "cpu_ms_per_step") if isinstance(raw, list) and raw else None
    rows = []
    for loop, runs in results.items():
        if isinstance(runs, str) or not runs:
            rows.append([LABELS[loop], runs or "no runs", *["-"] * (len(header) - 2)])
            continue
        ms, cpu = _median(runs, "ms_per_step"), _median(runs, "cpu_ms_per_step")
        assert ms is not None and cpu is not None
        row = [
            LABELS[loop],
            f"{ms:.3f}",
            f"{ms / raw_ms:.3f}" if raw_ms else "-",
            f"{cpu:.3f}",
            f"{cpu / raw_cpu:.3f}" if raw_cpu else "-",
            f"{_median(runs, 'throughput'):,.0f}",
            f"{_median(runs, 'peak_mib'):,.0f}",
        ]
        if cuda:
            syncs, kernels = _median(runs, "syncs_per_step"), _median(runs, "kernels_per_step")
            row += ["-" if syncs is None else f"{syncs:.2f}", "-" if kernels is None else f"{kernels:.1f}"]
        row.append(", ".join(f"{r['ms_per_step']:.3f}" for r in runs))
        rows.append(row)
    return header, rows


def kernel_differences(results: dict[str, Any]) -> list[str]:
    """Kernels whose count per step differs from the raw loop's (last run of each loop)."""
    raw = results.get("raw")
    if not isinstance(raw, list) or not raw or not raw[-1]["kernels"]:
        return []
    base = raw[-1]["kernels"]
    lines = []
    for loop, runs in results.items():
        if loop == "raw" or isinstance(runs, str) or not runs:
            continue
        mine = runs[-1]["kernels"]
        for name in sorted(set(base) | set(mine)):
            a, b = base.get(name, 0.0), mine.get(name, 0.0)
            if a != b:
                lines.append(f"  {LABELS[loop]}: {name}: {a:g} -> {b:g}")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", choices=sorted(JOBS), default="mlp")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=3, help="processes per loop (default 3)")
    parser.add_argument("--steps", type=int, help="timed optimizer steps per process (default by job and device)")
    parser.add_argument("--warmup", type=int, help="optimizer steps before the clock starts (>= 1)")
    parser.add_argument("--counted", type=int, help="CUDA: steps with host-sync counting (default by job)")
    parser.add_argument("--loops", default=",".join(LOOPS), help=f"comma-separated, from: {','.join(LOOPS)}")
    parser.add_argument("--threads", type=int, help="torch threads per process (default: 1 on CPU, torch's on CUDA)")
    parser.add_argument("--concurrent", type=int, default=1, help="processes at a time (>1: timings not comparable)")
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT-2 that runs on a CPU: checks the code path")
    parser.add_argument("--child", metavar="LOOP", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    job = JOBS[args.job]
    if args.job == "gpt2" and args.device == "cpu" and not args.tiny:
        parser.error("--job gpt2 is a CUDA job: use --device cuda (or --tiny to check the code path on a CPU)")
    if args.job == "gpt2" and args.tiny:
        job = TINY_GPT2
    warm, timed, counted = PLANS[(args.job, args.device)]
    warm = args.warmup if args.warmup is not None else warm
    timed = args.steps if args.steps is not None else timed
    counted = (args.counted if args.counted is not None else min(counted, timed)) if args.device == "cuda" else 0
    threads = args.threads if args.threads is not None else (1 if args.device == "cpu" else 0)
    if warm < 1 or timed < 1 or counted < 0:
        parser.error("--warmup and --steps must be >= 1, --counted >= 0")
    if args.child:
        result = child(args.child, job, args.device, warm, timed, counted, threads, args.tiny)
        print(MARKER + json.dumps(result), flush=True)
        return result
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    loops = [loop for loop in args.loops.split(",") if loop]
    unknown = [loop for loop in loops if loop not in LOOPS]
    if unknown:
        parser.error(f"unknown loops {unknown}; known: {', '.join(LOOPS)}")
    if args.job == "gpt2" and not installed("hf"):
        parser.error("--job gpt2 needs transformers (the model) in every loop")
    child_args = ["--job", args.job, "--device", args.device, "--warmup", str(warm), "--steps", str(timed)]
    child_args += ["--counted", str(counted), "--threads", str(threads)] + (["--tiny"] if args.tiny else [])
    results = drive(loops, args.rounds, child_args, args.concurrent)
    from benchmarks.common import print_table

    cuda = args.device == "cuda"
    header, rows = table(results, job.unit, cuda)
    what = f"{job.batch} x {job.accumulation}" + (f" x {job.seq} tokens" if job.seq else " samples")
    note = f"; {args.concurrent} processes at a time: timings NOT comparable" if args.concurrent > 1 else ""
    print_table(
        f"Peers, {args.job}{' (tiny)' if args.tiny else ''} on {args.device}: median of {args.rounds} processes per "
        f"loop, order alternating; {timed} timed optimizer steps of {what} after {warm} warm-up"
        + (f", then {counted} sync-counted and {PROFILED} profiled" if cuda else "")
        + (f", {threads} torch thread(s)" if threads else "")
        + note,
        header,
        rows,
    )
    differences = kernel_differences(results)
    if differences:
        print("\nCUDA kernels per step that differ from the raw loop's (loop: kernel: raw -> loop)")
        print("\n".join(differences))
    return results


if __name__ == "__main__":
    main()
