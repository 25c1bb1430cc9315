"""Time to the first optimizer step: trainbus's ``Trainer`` against transformers' on the same job.

Usage: python -m benchmarks.startup [--rounds 5] [--runs raw,raw+dynamo,trainbus,trainbus+dynamo,transformers]
       python -m benchmarks.startup --profile trainbus      # one child under cProfile instead

Each run is a fresh interpreter (``python -m benchmarks.startup --child NAME``), the runs
alternating in order round after round. A child does what the top of a user's script does (import
torch and the framework, build the model, the dataset and the ``TrainingArguments``) before the
clock starts, then times ``Trainer(...)`` up to the end of the first optimizer step: an HF
``TrainerCallback.on_step_end`` for transformers, a handler on ``Event.STEP_END`` for trainbus;
both stop training there. The job: an MLP 256-512-512-10 on 4,096 random samples (dicts of ``x``
and ``labels``), batch 64, the frameworks' defaults otherwise (fused AdamW, linear schedule,
clipping at 1.0, a progress bar), ``report_to="none"``, ``save_strategy="no"``, on the CPU.

The runs:
  raw              a hand-written loop doing the same (DataLoader, fused AdamW, LambdaLR, clipping; no bar):
                   the floor, what torch alone costs from building the loop to its first step (its
                   "Trainer() alone" column is the set-up of loader, optimizer and schedule)
  trainbus         ``from trainbus.plugins import Trainer, TrainingArguments``
  transformers     ``from transformers import Trainer, TrainingArguments``
  NAME+dynamo      NAME with ``import torch._dynamo`` among the imports

Why the ``+dynamo`` rows: torch imports ``torch._dynamo`` (about 2 s) the first time any
``torch.optim.Optimizer`` is built (``Optimizer.add_param_group`` is wrapped by
``torch._compile._disable_dynamo``, which imports it on its first call). ``import transformers``
has imported it already, before the clock; trainbus does not import it, so torch does, inside the
window, when the optimizer is built, as it does in the raw loop. The ``+dynamo`` rows put trainbus
and the raw loop on the same footing as transformers: they show what each costs itself in the window.

Prints, per run, the medians over the rounds of: the imports, ``TrainingArguments(...)``,
``Trainer(...)`` to the first step (the headline), ``Trainer(...)`` alone, and the whole (first
import to first step), whether ``torch._dynamo`` was imported before the clock, and every round's
headline value.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

RUNS = ("raw", "raw+dynamo", "trainbus", "trainbus+dynamo", "transformers")
#: modules a training step does not need (torch's first optimizer imports the first two); a child reports
#: which of them it ended up with
HEAVY = (
    "torch._dynamo",
    "torch._inductor",
    "transformers",
    "accelerate",
    "ignite",
    "tensorboard",
    "torch.utils.tensorboard",
    "datasets",
    "peft",
    "sklearn",
    "pandas",
    "matplotlib",
    "lightning",
)
FEATURES, HIDDEN, CLASSES, BATCH, SAMPLES = 256, 512, 10, 64, 4096


def _child(name: str, profile: bool) -> dict[str, Any]:
    """One run in this (fresh) interpreter: returns the phases in seconds."""
    start = time.perf_counter()
    import torch

    framework = name.removesuffix("+dynamo")
    if name not in RUNS:
        raise SystemExit(f"unknown run {name!r}; known: {', '.join(RUNS)}")
    if framework == "trainbus":
        from trainbus.engine import Event, Plugin
        from trainbus.plugins import Trainer, TrainingArguments
    elif framework == "transformers":
        from transformers import Trainer, TrainerCallback, TrainingArguments
    if name.endswith("+dynamo"):
        import torch._dynamo  # what import transformers does on the way
    imported = time.perf_counter()

    from benchmarks.common import ClassifierWithLoss

    def mlp() -> torch.nn.Module:
        return ClassifierWithLoss(
            torch.nn.Sequential(
                torch.nn.Linear(FEATURES, HIDDEN),
                torch.nn.ReLU(),
                torch.nn.Linear(HIDDEN, HIDDEN),
                torch.nn.ReLU(),
                torch.nn.Linear(HIDDEN, CLASSES),
            )
        )

    torch.manual_seed(0)
    model = mlp()
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    dataset = [{"x": x, "labels": y} for x, y in zip(xs, ys)]
    before_args = time.perf_counter()
    if framework != "raw":
        output_dir = tempfile.mkdtemp(prefix=f"startup-{framework}-")  # nothing is saved there
        atexit.register(shutil.rmtree, output_dir, ignore_errors=True)
        args = TrainingArguments(
            output_dir=output_dir,
            per_device_train_batch_size=BATCH,
            num_train_epochs=1,
            learning_rate=1e-3,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
        )
    stamps: dict[str, float] = {}

    def first_step() -> None:
        stamps.setdefault("first_step", time.perf_counter())

    callbacks: list[Any] = []
    if framework == "trainbus":

        class FirstStep(Plugin):
            def attach(self, engine: Any) -> None:
                self.on(engine, Event.STEP_END, self.step_end)

            def step_end(self, event: Any) -> None:
                first_step()
                event.engine.control.should_training_stop = True

        callbacks = [FirstStep()]
    elif framework == "transformers":

        class FirstStepCallback(TrainerCallback):  # type: ignore[misc]
            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
                first_step()
                control.should_training_stop = True
                return control

        callbacks = [FirstStepCallback()]
    dynamo_before = "torch._dynamo" in sys.modules
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    clock = time.perf_counter()
    if framework == "raw":
        built = _raw_first_step(model, dataset, first_step)
        dynamo_at_init = None
    else:
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
        built = time.perf_counter()
        dynamo_at_init = "torch._dynamo" in sys.modules
        trainer.train()
    if profiler is not None:
        profiler.disable()
        import pstats

        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(40)
    return {
        "imports": imported - start,
        "arguments": clock - before_args,
        "to_first_step": stamps["first_step"] - clock,
        "trainer_init": built - clock,
        "total": stamps["first_step"] - start,
        "dynamo_before": dynamo_before,
        "dynamo_at_init": dynamo_at_init,
        "heavy": sorted(m for m in HEAVY if m in sys.modules),
    }


def _raw_first_step(model: Any, dataset: list[Any], first_step: Any) -> float:
    """The hand-written loop's set-up and first step (the trainers' defaults); returns when set-up ended."""
    import torch

    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    total = len(loader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / total))
    built = time.perf_counter()
    model.train()
    for batch in loader:
        model(**batch)["loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        first_step()
        break
    return built


def run_child(name: str, profile: bool = False) -> dict[str, Any]:
    """Run one child interpreter for ``name``; returns its phases."""
    cmd = [sys.executable, "-m", "benchmarks.startup", "--child", name] + (["--profile", name] if profile else [])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{name} child failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    if profile:
        print(proc.stderr)
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def measure(runs: list[str], rounds: int) -> dict[str, list[dict[str, Any]]]:
    """``rounds`` fresh children per run, the order reversed every other round."""
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for round_ in range(rounds):
        for name in runs if round_ % 2 == 0 else runs[::-1]:
            results[name].append(run_child(name))
    return results


def table(results: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    rows = []
    for name, runs in results.items():

        def med(key: str, runs: list[dict[str, Any]] = runs) -> str:
            return f"{statistics.median(r[key] for r in runs):.2f}"

        arguments = "-" if name.startswith("raw") else med("arguments")
        before = {bool(r["dynamo_before"]) for r in runs}
        dynamo = "yes" if before == {True} else "no" if before == {False} else "mixed"
        each = ", ".join(f"{r['to_first_step']:.2f}" for r in runs)
        rows.append(
            [name, med("imports"), arguments, med("to_first_step"), med("trainer_init"), med("total"), dynamo, each]
        )
    return rows


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="fresh processes per run")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from: {','.join(RUNS)}")
    parser.add_argument("--profile", metavar="NAME", help="profile one child of NAME with cProfile instead")
    parser.add_argument("--child", metavar="NAME", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, profile=args.profile is not None)), flush=True)
        return {}
    if args.profile:
        print(json.dumps(run_child(args.profile, profile=True)))
        return {}
    runs = [r for r in args.runs.split(",") if r]
    for name in runs:
        if name not in RUNS:
            parser.error(f"unknown run {name!r}; known: {', '.join(RUNS)}")
    results = measure(runs, args.rounds)
    from benchmarks.common import print_table

    print_table(
        f"Seconds to the first optimizer step: median of {args.rounds} fresh processes each, alternating "
        f"(MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}, batch {BATCH}, CPU)",
        [
            "run",
            "imports",
            "TrainingArguments",
            "Trainer() to 1st step",
            "Trainer() alone",
            "total",
            "torch._dynamo before clock",
            "each run (Trainer() to 1st step)",
        ],
        table(results),
    )
    return results


if __name__ == "__main__":
    main()
