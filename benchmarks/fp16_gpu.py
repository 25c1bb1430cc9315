"""fp16 on a GPU: host syncs, CUDA kernels and ms per optimizer step, raw AMP loop vs trainbus's Trainer (#36 item 4).

From the repository root on a CUDA machine (GPT-2 124M, seq 512, batch 16, accumulation 2, fused AdamW, clipping 1.0,
cosine schedule with 10% warmup, fp16 with GradScaler; about 3 minutes)::

    python -m benchmarks.fp16_gpu --device cuda

``--tiny --device cpu`` checks the code path on a CPU in seconds (no kernels, no syncs counted there).
Each loop runs in its own process: ``raw`` (torch's AMP recipe written by hand, as transformers' Trainer steps:
loss / k, scaler.scale(loss).backward(), scaler.unscale_, clip_grad_norm_, scaler.step, scaler.update,
scheduler.step every step), ``host`` (trainbus Trainer, ``MixedPrecision("fp16", sync=True)``: the host read per
step, the path before), ``device`` (``MixedPrecision("fp16", keep_schedule=True)``: the skip on the device; the
Trainer's default with a constant schedule is the same path, the schedule aside).
Acceptance: ``device`` 0 syncs per step from the skip (``host`` has one more than ``device``), kernels per step
<= raw + 2 (one per micro-batch).
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
from typing import Any

sys.path.insert(0, ".")


def setup(device: str, tiny: bool) -> Any:
    from dataclasses import replace

    from benchmarks.peers import JOBS, PLANS, TINY_GPT2, _make_setup

    job = replace(TINY_GPT2 if tiny else JOBS["gpt2"], bf16=False)
    warm, timed, counted = PLANS[("gpt2", device)]
    return _make_setup(job, device, warm, timed, counted, tiny)


def run_raw(s: Any) -> None:
    import torch

    model = s.model.to(s.device).train()
    optimizer = s.optimizer(model)
    scheduler = s.scheduler(optimizer)
    scaler = torch.amp.GradScaler(s.device.type)
    params = list(model.parameters())
    k = s.job.accumulation
    batches = iter(s.loader())
    for step in range(1, s.steps + 1):
        for _ in range(k):
            batch = s.to_device(next(batches))
            with torch.autocast(s.device.type, dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss / k).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        s.meter.step_end(step)


def run_trainbus(s: Any, mode: str) -> None:
    import trainbus.plugins.facade.composition as composition
    from benchmarks.peers import _training_arguments
    from trainbus.engine import Event, Plugin
    from trainbus.plugins import Trainer, TrainingArguments
    from trainbus.plugins.optimization.precision import MixedPrecision

    options = {"host": {"sync": True}, "device": {"keep_schedule": True}}[mode]
    composition.MixedPrecision = functools.partial(MixedPrecision, **options)  # type: ignore[misc]
    meter = s.meter

    class StepMeter(Plugin):
        def attach(self, engine: Any) -> None:
            self.on(engine, Event.STEP_END, lambda ev: meter.step_end(ev.engine.state.global_step))

    args = _training_arguments(TrainingArguments, s)
    args.fp16 = True
    trainer = Trainer(model=s.model, args=args, train_dataset=s.dataset, callbacks=[StepMeter()])
    trainer.train()
    amp = trainer.get_plugin(MixedPrecision)
    print("# device_skip", amp.device_skip, "skipped_steps", amp.skipped_steps, file=sys.stderr)


def child(loop: str, device: str, tiny: bool) -> None:
    import torch

    torch.manual_seed(0)
    s = setup(device, tiny)
    run_raw(s) if loop == "raw" else run_trainbus(s, loop)
    print("RESULT " + json.dumps(s.meter.result(s.job)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--child")
    a = parser.parse_args()
    if a.child:
        return child(a.child, a.device, a.tiny)
    results = {}
    for loop in ("raw", "host", "device"):
        cmd = [sys.executable, __file__, "--child", loop, "--device", a.device] + (["--tiny"] if a.tiny else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if not lines:
            sys.exit(f"{loop} failed:\n{out.stderr[-3000:]}")
        results[loop] = json.loads(lines[-1][7:])
        print(out.stderr.strip().splitlines()[-1] if "# device_skip" in out.stderr else "", file=sys.stderr)
    raw = results["raw"]
    print("| loop | ms/step | syncs/step | kernels/step | kernels - raw |\n|---|---|---|---|---|")
    for loop, r in results.items():
        kernels = r["kernels_per_step"]
        more = None if kernels is None or raw["kernels_per_step"] is None else kernels - raw["kernels_per_step"]
        print(f"| {loop} | {r['ms_per_step']:.2f} | {r['syncs_per_step']} | {kernels} | {more} |")
    for loop in ("host", "device"):
        diff = {k: round(results[loop]["kernels"].get(k, 0) - raw["kernels"].get(k, 0), 2)
                for k in set(results[loop]["kernels"]) | set(raw["kernels"])}
        print(loop, "kernels differing from raw:", {k: v for k, v in sorted(diff.items()) if v})


if __name__ == "__main__":
    main()
