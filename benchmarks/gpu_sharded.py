"""Sharded training on GPUs: FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 through trainbus's Trainer, each resumed.

    python benchmarks/gpu_sharded.py OUT           # every CUDA GPU of this machine, bf16 (FSDP needs 2 or more)
    python benchmarks/gpu_sharded.py OUT --cpu 2   # the same runs on 2 gloo CPU processes, float32 (a smoke run)

Each run trains a tiny Llama (built from a config: nothing is downloaded) for 8 steps with a checkpoint
at step 4 and ``save_model`` at the end, then a fresh launch resumes from checkpoint-4 and trains to
step 8. ``OUT/summary.md`` gets the device, the date, the versions and per run: the losses, the
checkpoint's files, whether the resumed weights equal the uninterrupted run's, whether the saved model
loads in one process and equals the trained weights, and the peak GPU memory.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

#: run name -> the sharding arguments of TrainingArguments
RUNS: dict[str, dict[str, Any]] = {
    "deepspeed-zero2": {"deepspeed": {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"},
                                      "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"}},
    "deepspeed-zero3": {"deepspeed": {"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"},
                                      "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto"}},
    "fsdp2": {"fsdp": True, "fsdp_config": {"reshard_after_forward": True}},
}  # fmt: skip
STEPS, SAVE_AT, SEQ, VOCAB = 8, 4, 32, 256


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(config)


def token_data(n: int = 128) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def gathered_params(trainer: Any) -> dict[str, list[float]]:
    """Every parameter whole (test-only: a sharded model is gathered one parameter at a time)."""
    from torch.distributed.tensor import DTensor

    zero = getattr(getattr(trainer, "distributed", None), "zero", None)
    stage3 = zero is not None and zero.stage == 3
    out = {}
    for name, param in trainer.model.named_parameters():
        if isinstance(param, DTensor):
            tensor = param.full_tensor()
        elif stage3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([param]):
                tensor = param.detach().clone()
        else:
            tensor = param.detach()
        out[name.replace("_checkpoint_wrapped_module.", "")] = tensor.float().reshape(-1).cpu().tolist()
    return out


def job(run: str, phase: str, out: Path, cpu: bool) -> None:
    """One launch: ``full`` trains 8 steps and saves the model; ``resume`` resumes from checkpoint-4."""
    from trainbus.plugins import Trainer, TrainingArguments

    rank = int(os.environ.get("RANK", "0"))
    run_dir = out / run / phase
    if phase == "resume":
        if rank == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.copytree(out / run / "full" / f"checkpoint-{SAVE_AT}", run_dir / f"checkpoint-{SAVE_AT}")
        torch.distributed.barrier() if torch.distributed.is_initialized() else None
    args = TrainingArguments(**RUNS[run],
        output_dir=str(run_dir), per_device_train_batch_size=4, max_steps=STEPS, learning_rate=1e-3,
        optim="adamw_torch", logging_steps=1, save_strategy="steps", save_steps=SAVE_AT, report_to="none",
        disable_tqdm=True, seed=0, bf16=not cpu, use_cpu=cpu,
    )  # fmt: skip
    if torch.cuda.is_available() and not cpu:
        torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(tiny_llama(), args, train_dataset=token_data())
    started = datetime.datetime.now()
    trainer.train(resume_from_checkpoint=True if phase == "resume" else None)
    result: dict[str, Any] = {
        "seconds": (datetime.datetime.now() - started).total_seconds(),
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "params": gathered_params(trainer),
        "model": type(trainer.model).__name__,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() and not cpu else None,
    }
    if phase == "full":
        trainer.save_model()
        result["files"] = sorted(p.name for p in (run_dir / f"checkpoint-{SAVE_AT}").iterdir())
    (out / run / f"{phase}-rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def launch(run: str, phase: str, out: Path, processes: int, cpu: bool) -> tuple[bool, str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
               __file__, str(out), "--job", run, phase] + (["--cpu", str(processes)] if cpu else [])  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **({"DS_ACCELERATOR": "cpu"} if cpu else {})}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    return done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def max_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    return max(abs(x - y) for name in a for x, y in zip(a[name], b[name], strict=True))


def check(run: str, out: Path, processes: int, cpu: bool) -> dict[str, Any]:
    """Train, resume in a fresh launch, compare; load the saved model in this (one) process."""
    from trainbus.plugins import load_model_weights

    row: dict[str, Any] = {"run": run, "processes": processes}
    if run.startswith("fsdp") and processes < 2:
        return {**row, "status": "skipped: FSDP shards across 2 or more processes (this machine has 1 GPU)"}
    for phase in ("full", "resume"):
        ok, tail = launch(run, phase, out, processes, cpu)
        if not ok:
            return {**row, "status": f"{phase} failed", "log": tail}
    full = json.loads((out / run / "full-rank0.json").read_text())
    resumed = json.loads((out / run / "resume-rank0.json").read_text())
    saved = tiny_llama()
    load_model_weights(saved, out / run / "full")
    saved_params = {n: p.detach().float().reshape(-1).tolist() for n, p in saved.named_parameters()}
    return {
        **row,
        "status": "ran",
        "model": full["model"],
        "losses": [round(x, 4) for x in full["losses"]],
        "checkpoint files": full["files"],
        "resumed losses equal": resumed["losses"] == full["losses"],  # steps 1-4 come from the checkpoint's log
        "resumed weights max |diff|": max_diff(full["params"], resumed["params"]),
        "saved model max |diff|": max_diff(full["params"], saved_params),
        "peak GiB (rank 0)": full["peak_gib"],
        "seconds": round(full["seconds"], 1),
    }


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    cpu = "--cpu" in argv
    if "--job" in argv:
        at = argv.index("--job")
        job(argv[at + 1], argv[at + 2], out, cpu)
        return
    processes = int(argv[argv.index("--cpu") + 1]) if cpu else torch.cuda.device_count()
    if processes < 1:
        raise SystemExit("no CUDA GPU here: run with --cpu N for a smoke run on N CPU processes")
    out.mkdir(parents=True, exist_ok=True)
    rows = [check(run, out, processes, cpu) for run in RUNS]
    import accelerate
    import transformers

    try:
        import deepspeed

        ds_version = deepspeed.__version__
    except ImportError:
        ds_version = "not installed"
    device = f"{processes} CPU processes (gloo)" if cpu else f"{processes} x {torch.cuda.get_device_name(0)}"
    lines = [
        f"# Sharded training run ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        f"device: {device}; host: {platform.node()}; torch {torch.__version__}, accelerate {accelerate.__version__}, "
        f"transformers {transformers.__version__}, deepspeed {ds_version}; precision: {'float32' if cpu else 'bf16'}",
        "",
    ]
    for row in rows:
        lines += [f"## {row['run']}", "", "```", json.dumps(row, indent=1), "```", ""]
    (out / "summary.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
