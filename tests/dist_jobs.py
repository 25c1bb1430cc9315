"""Jobs the distributed tests launch the way users do (torchrun, accelerate launch) and run in one process.

``python tests/dist_jobs.py JOB OUT`` runs JOB in one process with per-device batch 8;
``torchrun --standalone --nproc_per_node 2 tests/dist_jobs.py JOB OUT`` runs it on two processes with
per-device batch 4: the same global batch. Every rank writes what it saw to ``OUT/JOB-rank{r}.json``;
the tests compare the files. Models and data are float64 so equality can be asserted to 1e-10.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from dist_helpers import run_job_main

VOCAB, SEQ, TRAIN_SIZE, EVAL_SIZE = 11, 6, 20, 101
GLOBAL_BATCH = 8
#: (name, optimizer, learning rate, accumulation steps)
CONFIGS = [("sgd-k1", "sgd", 0.5, 1), ("adamw-k1", "adamw_torch", 0.05, 1), ("sgd-k2", "sgd", 0.5, 2),
           ("adamw-k2", "adamw_torch", 0.05, 2)]  # fmt: skip
#: the resumed run: adamw-k1 (3 steps per epoch, checkpoints every 2) dies at step 3, so it resumes
#: from checkpoint-2, in the middle of the first epoch
RESUMED = "adamw-k1"
CRASH_AT_STEP = 3
DDP_OPTIONS = {"ddp_find_unused_parameters": True, "ddp_broadcast_buffers": False, "ddp_bucket_cap_mb": 10}


class TokenModel(torch.nn.Module):
    """A tiny language-model-shaped module: token ids in, logits per token, HF-style loss with -100."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)
        self.double()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.head(torch.tanh(self.embed(input_ids)))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(
                logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100
            )
        return out


def train_set() -> list[dict[str, torch.Tensor]]:
    """Sequences with 0 to 5 trailing -100 labels each: the ranks' item counts differ in every step."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(TRAIN_SIZE):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        labels = torch.roll(ids, -1).clone()
        padding = int(torch.randint(0, SEQ, (), generator=g))
        if padding:
            labels[-padding:] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def eval_set() -> list[dict[str, torch.Tensor]]:
    """101 unpadded sequences: an odd size, so the eval sampler repeats a sample to fill its shards."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (EVAL_SIZE, SEQ), generator=g)
    return [{"input_ids": row, "labels": torch.roll(row, -1)} for row in ids]


def token_metrics(prediction: Any) -> dict[str, float]:
    predictions, labels = prediction.predictions, prediction.label_ids
    return {
        "accuracy": float((predictions.argmax(-1) == labels).mean()),
        "mean_logit": float(np.mean(predictions)),
    }


def per_device_batch() -> int:
    return GLOBAL_BATCH // int(os.environ.get("WORLD_SIZE", "1"))


def params_of(model: torch.nn.Module) -> dict[str, list[float]]:
    return {name: p.detach().reshape(-1).tolist() for name, p in model.named_parameters()}


# -- writes ------------------------------------------------------------------------------------------
class WriteTrace:
    """Records every file-system change under ``root`` made by this process (audit hooks + safetensors)."""

    EVENTS = ("open", "os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree")

    def __init__(self, root: Path) -> None:
        self.root = str(root.resolve())
        self.writes: list[tuple[str, str]] = []
        sys.addaudithook(self._hook)
        import safetensors.torch as st

        save_file = st.save_file

        def traced_save_file(tensors: Any, filename: str, *args: Any, **kwargs: Any) -> Any:
            self._record("safetensors.save_file", filename)
            return save_file(tensors, filename, *args, **kwargs)

        st.save_file = traced_save_file

    def _record(self, event: str, path: Any) -> None:
        if isinstance(path, str | os.PathLike):
            full = os.path.abspath(os.fspath(path))
            if full.startswith(self.root):
                self.writes.append((event, os.path.relpath(full, self.root)))

    def _hook(self, event: str, args: tuple[Any, ...]) -> None:
        if event not in self.EVENTS:
            return
        if event == "open":
            path, mode = args[0], args[1]
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(mode, int) and mode & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            ):
                self._record(event, path)
            return
        for path in args[:2]:
            self._record(event, path)


# -- jobs --------------------------------------------------------------------------------------------
def trainer_for(
    run_dir: Path,
    optim: str,
    lr: float,
    steps: int,
    callbacks: list[Any] | None = None,
    model: torch.nn.Module | None = None,
    **more: Any,
) -> Any:
    from trainbus.plugins import Trainer, TrainingArguments

    options = dict(
        output_dir=str(run_dir), per_device_train_batch_size=per_device_batch(),
        per_device_eval_batch_size=per_device_batch(), num_train_epochs=2, learning_rate=lr, optim=optim,
        gradient_accumulation_steps=steps, logging_steps=1, save_strategy="steps", save_steps=2,
        report_to="none", disable_tqdm=True, use_cpu=True, seed=0, ddp_timeout=120,
    )  # fmt: skip
    args = TrainingArguments(**{**options, **more})  # ``more`` adds options or overrides these
    return Trainer(
        model or TokenModel(), args, train_dataset=train_set(), compute_metrics=token_metrics, callbacks=callbacks or []
    )


def facade(out: Path) -> dict[str, Any]:
    """Every config trained with the Trainer, then evaluate() and predict() on 101 samples."""
    trace = WriteTrace(out / "runs")
    results: dict[str, Any] = {"world_size": None, "configs": {}}
    for name, optim, lr, steps in CONFIGS:
        # DDP options change no number: the first run passes some through to check they reach DDP
        options = DDP_OPTIONS if name == CONFIGS[0][0] else {}
        trainer = trainer_for(out / "runs" / name, optim, lr, steps, **options)
        output = trainer.train()
        if options:
            wrapped = trainer.model_wrapped
            results["ddp"] = {
                "wrapper": type(wrapped).__name__,
                "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
                "broadcast_buffers": getattr(wrapped, "broadcast_buffers", None),
                "bucket_bytes_cap": getattr(wrapped, "bucket_bytes_cap", None),
            }
        trainer.save_model()
        results["world_size"] = trainer.args.world_size
        results["flags"] = [trainer.state.is_world_process_zero, trainer.state.is_local_process_zero]
        results["configs"][name] = {
            "params": params_of(trainer.model),
            "log_history": list(trainer.state.log_history),  # before evaluate() below adds to it
            "training_loss": output.training_loss,
            "global_step": output.global_step,
        }
    metrics = trainer.evaluate(eval_set())
    prediction = trainer.predict(eval_set())
    results["evaluate"] = metrics
    results["predict"] = {
        "predictions": prediction.predictions.tolist(),
        "label_ids": prediction.label_ids.tolist(),
        "metrics": prediction.metrics,
    }
    results["writes"] = trace.writes
    return results


class CrashAt:
    """An HF callback that raises at a step: the run dies after its last checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {self.step}")


def forward_counter() -> Any:
    from trainbus.engine import Event, Plugin

    class CountForwards(Plugin):
        def __init__(self) -> None:
            self.forwards = 0

        def attach(self, engine: Any) -> None:
            self.on(engine, Event.LOSS, self.count)

        def count(self, event: Any) -> None:
            self.forwards += 1

    return CountForwards()


def _resumed_config() -> tuple[str, float, int]:
    return next((optim, lr, steps) for name, optim, lr, steps in CONFIGS if name == RESUMED)


def crash(out: Path) -> dict[str, Any]:
    """The RESUMED run, dying at step CRASH_AT_STEP (after checkpoint-2)."""
    trainer = trainer_for(out / "resumed", *_resumed_config(), callbacks=[CrashAt(CRASH_AT_STEP)])
    trainer.train()
    raise AssertionError("the crash callback did not fire")


def resume(out: Path) -> dict[str, Any]:
    """The crashed run resumed from its newest checkpoint in a fresh launch."""
    counter = forward_counter()
    trainer = trainer_for(out / "resumed", *_resumed_config(), callbacks=[counter])
    output = trainer.train(resume_from_checkpoint=True)
    return {
        "params": params_of(trainer.model),
        "log_history": trainer.state.log_history,
        "training_loss": output.training_loss,
        "forwards": counter.forwards,
    }


def engine(out: Path) -> dict[str, Any]:
    """A hand-composed Engine: the same job, with the Distributed plugin on more than one process."""
    from torch.utils.data import DataLoader

    from trainbus.engine import Engine
    from trainbus.plugins import (
        Distributed,
        EpochSampler,
        FlowControl,
        GradientAccumulation,
        GradientClipping,
        LRScheduler,
        TrainLogger,
        default_data_collator,
    )  # fmt: skip

    results: dict[str, Any] = {}
    data = train_set()
    for steps in (1, 2):
        model = TokenModel()
        loader = DataLoader(data, batch_size=per_device_batch(), sampler=EpochSampler(len(data), seed=0),
                            collate_fn=default_data_collator)  # fmt: skip
        plugins: list[Any] = [
            GradientAccumulation(steps), GradientClipping(1.0), LRScheduler("linear"),
            FlowControl(logging_steps=1, save_strategy="no"), TrainLogger(),
        ]  # fmt: skip
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            plugins.insert(0, Distributed())
        run = Engine(model, torch.optim.SGD(model.parameters(), lr=0.5), train_data=loader, max_epochs=2,
                     plugins=plugins)  # fmt: skip
        state = run.fit()
        results[f"k{steps}"] = {"params": params_of(model), "log_history": state.log_history}
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a global batch these processes cannot make
        from trainbus.engine import ConfigError

        model = TokenModel()
        loader = DataLoader(data, batch_size=per_device_batch(), collate_fn=default_data_collator)
        run = Engine(model, torch.optim.SGD(model.parameters(), lr=0.5), train_data=loader, max_epochs=1,
                     plugins=[Distributed(global_batch_size=12)])  # fmt: skip
        try:
            run.fit()
        except ConfigError as exc:
            results["global_batch_error"] = str(exc)
    return results


#: the preempted run: rank 0 alone gets SIGTERM at step SIGNAL_AT; the ranks agree every PREEMPTION_EVERY steps
SIGNAL_AT, PREEMPTION_EVERY = 3, 2


def _preempted_trainer(run_dir: Path) -> Any:
    from trainbus.plugins.control.preemption import Preemption

    trainer = trainer_for(run_dir, "adamw_torch", 0.05, 1, num_train_epochs=3, save_steps=100, logging_steps=2)
    plugin = trainer.get_plugin(Preemption)
    assert plugin is not None, "the Trainer installs Preemption by default"
    plugin.check_every = PREEMPTION_EVERY
    return trainer


def preempt(out: Path) -> dict[str, Any]:
    """Rank 0 sends itself SIGTERM at step SIGNAL_AT; every rank must stop, save and raise at the same step."""
    import signal

    from trainbus.engine import Event
    from trainbus.plugins.control.preemption import TrainingInterrupted

    trainer = _preempted_trainer(out / "preempted")
    if int(os.environ.get("RANK", "0")) == 0:

        def terminate(event: Any) -> None:
            if event.engine.state.global_step == SIGNAL_AT:
                os.kill(os.getpid(), signal.SIGTERM)

        trainer.on(Event.STEP_END, terminate)
    before = signal.getsignal(signal.SIGTERM)
    try:
        trainer.train()
    except TrainingInterrupted as stop:
        restored = signal.getsignal(signal.SIGTERM) == before
        return {"step": stop.step, "code": stop.code, "signal": stop.signal, "checkpoint": stop.checkpoint,
                "global_step": trainer.state.global_step, "restored": restored}  # fmt: skip
    raise AssertionError("training was not interrupted")


def preempt_resume(out: Path) -> dict[str, Any]:
    """The preempted run resumed (a fresh launch) from the checkpoint it wrote when it stopped."""
    trainer = _preempted_trainer(out / "preempted")
    output = trainer.train(resume_from_checkpoint=True)
    return {"params": params_of(trainer.model), "log_history": trainer.state.log_history,
            "training_loss": output.training_loss}  # fmt: skip


def preempt_whole(out: Path) -> dict[str, Any]:
    """The same run, never interrupted."""
    trainer = _preempted_trainer(out / "whole")
    output = trainer.train()
    return {"params": params_of(trainer.model), "log_history": trainer.state.log_history,
            "training_loss": output.training_loss}  # fmt: skip


def unequal(out: Path) -> dict[str, Any]:
    """Rank 1 loads a shorter data set (16 samples, rank 0 has 20): every rank must fail with the same clear error."""
    from trainbus.engine import ConfigError
    from trainbus.plugins import Trainer, TrainingArguments

    rank = int(os.environ.get("RANK", "0"))
    args = TrainingArguments(str(out / "unequal"), per_device_train_batch_size=per_device_batch(), max_steps=4,
                             report_to="none", disable_tqdm=True, use_cpu=True, save_strategy="no")  # fmt: skip
    data = train_set()[: TRAIN_SIZE if rank == 0 else 16]
    try:
        Trainer(TokenModel(), args, train_dataset=data).train()
    except ConfigError as exc:
        return {"error": str(exc)}
    return {"error": None}


def main_first(out: Path) -> dict[str, Any]:
    """HF's ``main_process_first``: the main process runs the body (here slowly) before the others enter it."""
    import time

    from trainbus.plugins import TrainingArguments

    args = TrainingArguments(str(out / "unused"), use_cpu=True, report_to="none")
    seen = {}
    for local in (True, False):
        marker = out / f"made-by-main-{local}"
        with args.main_process_first(local=local, desc="tokenize"):
            seen[str(local)] = marker.exists()
            if args.process_index == 0:
                time.sleep(1.0)
                marker.write_text("rank 0")
    return {"existed_on_entry": seen, "parallel_mode": args.parallel_mode.value, "world_size": args.world_size}


JOBS = {"facade": facade, "crash": crash, "resume": resume, "engine": engine, "preempt": preempt,
        "preempt_resume": preempt_resume, "preempt_whole": preempt_whole, "unequal": unequal,
        "main_first": main_first}  # fmt: skip


if __name__ == "__main__":
    run_job_main(JOBS, sys.argv[1:])
