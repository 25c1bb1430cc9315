"""What CI never runs, on a GPU: each precision and model-side feature trains, resumes and counts its host syncs.

    python -m benchmarks.gpu_smoke               # on the CUDA device (about 2 minutes on an H100)
    python -m benchmarks.gpu_smoke --cpu         # the same code path on the CPU in seconds (no syncs to count)

Each case trains a tiny Llama (built from a config: nothing is downloaded) through trainbus's Trainer
for 12 optimizer steps with a checkpoint at step 6, then a fresh Trainer (a fresh model, as a new process
would build) resumes from checkpoint-6 to step 12. The table: the last logged loss, host syncs per step
counted with ``torch.cuda.set_sync_debug_mode("warn")`` over steps 2 to 5 (no logging or saving falls
there), ms per step over the same steps, and the largest weight difference between the resumed and the
uninterrupted run (0 is bit for bit). ``predict`` also runs ``Trainer.predict`` on the causal LM.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import warnings
from typing import Any

import torch

STEPS, SAVE_AT, SEQ, VOCAB, BATCH = 12, 6, 128, 512, 8
COUNT_FROM, COUNT_TO = 1, 5  # syncs counted between these optimizer steps' ends


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def dataset(n: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class SyncMeter:
    """An HF-style callback: times steps COUNT_FROM..COUNT_TO and counts the host syncs between them."""

    def __init__(self, cuda: bool) -> None:
        self.cuda, self.syncs, self.ms = cuda, 0, float("nan")
        self._t0 = 0.0
        self._show: Any = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == COUNT_FROM:
            if self.cuda:
                torch.cuda.synchronize()
                self._start_counting()
            self._t0 = time.perf_counter()
        elif state.global_step == COUNT_TO:
            if self.cuda:
                self._stop_counting()
                torch.cuda.synchronize()
            self.ms = 1000 * (time.perf_counter() - self._t0) / (COUNT_TO - COUNT_FROM)

    def _start_counting(self) -> None:
        warnings.simplefilter("always")
        self._show = original = warnings.showwarning

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if "synchroniz" in str(message):
                self.syncs += 1
            else:
                original(message, category, *args, **kwargs)

        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")

    def _stop_counting(self) -> None:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self._show


def cases() -> dict[str, tuple[dict[str, Any], Any]]:
    """name -> (TrainingArguments fields, a factory of extra callbacks/plugins)."""
    from trainbus.plugins import EMA, SkipNonFinite

    return {
        "fp32": ({}, list),
        "fp16 (GradScaler)": ({"fp16": True}, list),
        "bf16": ({"bf16": True}, list),
        "gradient_checkpointing": ({"bf16": True, "gradient_checkpointing": True}, list),
        "EMA": ({"bf16": True}, lambda: [EMA(decay=0.99)]),
        "SkipNonFinite": ({"bf16": True}, lambda: [SkipNonFinite()]),
        "predict": ({"bf16": True}, list),
        "torch_compile": ({"bf16": True, "torch_compile": True}, list),
    }


def run_case(name: str, fields: dict[str, Any], extra: Any, cpu: bool) -> dict[str, Any]:
    from trainbus.plugins import Trainer, TrainingArguments

    cuda = not cpu
    with tempfile.TemporaryDirectory() as out:
        def trainer(meter: SyncMeter | None) -> Any:
            args = TrainingArguments(output_dir=out, max_steps=STEPS, save_steps=SAVE_AT, logging_steps=SAVE_AT,
                                     per_device_train_batch_size=BATCH, learning_rate=1e-3, report_to=[],
                                     disable_tqdm=True, use_cpu=cpu, seed=0, **fields)
            callbacks = list(extra()) + ([meter] if meter else [])
            return Trainer(model=tiny_llama(), args=args, train_dataset=dataset(STEPS * BATCH), callbacks=callbacks)

        meter = SyncMeter(cuda)
        first = trainer(meter)
        first.train()
        final = {k: v.detach().float().cpu() for k, v in first.model.state_dict().items()}
        loss = [r["loss"] for r in first.state.log_history if "loss" in r][-1]
        predicted = ""
        if name == "predict":
            output = first.predict(dataset(4))
            predicted = f" predictions {tuple(output.predictions.shape)}"
        second = trainer(None)
        second.train(resume_from_checkpoint=f"{out}/checkpoint-{SAVE_AT}")
        resumed = {k: v.detach().float().cpu() for k, v in second.model.state_dict().items()}
        diff = max((final[k] - resumed[k]).abs().max().item() for k in final)
    return {"case": name, "loss": loss, "syncs/step": meter.syncs / (COUNT_TO - COUNT_FROM), "ms/step": meter.ms,
            "resume max |diff|": diff, "note": predicted.strip()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (checks the code path)")
    parser.add_argument("--only", help="comma-separated case names")
    cli = parser.parse_args()
    if not cli.cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu to check the code path")
    device = "CPU" if cli.cpu else torch.cuda.get_device_name(0)
    print(f"device: {device}; torch {torch.__version__}", flush=True)
    print("| case | last loss | syncs/step | ms/step | resume max abs diff | note |\n|---|---|---|---|---|---|")
    chosen = set(cli.only.split(",")) if cli.only else None
    for name, (fields, extra) in cases().items():
        if chosen and name not in chosen:
            continue
        if cli.cpu and ("fp16" in name or name == "torch_compile"):
            continue  # fp16 autocast and compile need the GPU to mean anything
        try:
            row = run_case(name, fields, extra, cli.cpu)
        except Exception as error:  # one broken case must not hide the others' rows
            print(f"| {name} | FAILED: {type(error).__name__}: {str(error)[:200]} |||||", flush=True)
            continue
        print(f"| {row['case']} | {row['loss']:.4f} | {row['syncs/step']:.2f} | {row['ms/step']:.1f} "
              f"| {row['resume max |diff|']:.3g} | {row['note']} |", flush=True)


if __name__ == "__main__":
    main()
