"""Jobs the sharded-training tests launch: FSDP2 (and DeepSpeed) on 2 gloo CPU processes, and their 1-process twins.

``python tests/sharded_jobs.py JOB OUT`` runs JOB in one process with per-device batch 8;
``torchrun --nproc_per_node 2 tests/sharded_jobs.py JOB OUT`` on two processes with per-device batch 4
(the same global batch). Every rank writes what it saw to ``OUT/JOB-rank{r}.json``. The model and data
are ``dist_jobs.py``'s float64 token model with uneven -100 padding, so results compare to 1e-10.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from dist_helpers import run_job_main
from dist_jobs import TokenModel, eval_set, forward_counter, per_device_batch, train_set, trainer_for

#: (name, optimizer, learning rate, accumulation steps, fsdp_config): the head is its own FSDP unit;
#: the second run also checkpoints it (activation checkpointing) and keeps it gathered after forward
CONFIGS = [
    ("adamw-k1", "adamw_torch", 0.05, 1, {"transformer_layer_cls_to_wrap": ["Linear"]}),
    ("sgd-k2", "sgd", 0.5, 2, {"fsdp_transformer_layer_cls_to_wrap": "Linear", "activation_checkpointing": "true",
                                "reshard_after_forward": False}),
]  # fmt: skip
RESUMED = "adamw-k1"  # resumed from its checkpoint-2 (the middle of epoch 1) in a fresh launch
MODEL_ONLY = "sgd-k2"  # saves its checkpoints with save_only_model=True
#: ZeRO stages run through accelerate's DeepSpeed plugin
ZERO_STAGES = (2, 3)


def full_params(model: torch.nn.Module) -> dict[str, list[float]]:
    """Every parameter as the one-process model holds it (a sharded one gathered: test-only)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        tensor = p.full_tensor() if isinstance(p, DTensor) else p
        out[name.replace("_checkpoint_wrapped_module.", "")] = tensor.detach().reshape(-1).tolist()
    return out


def local_numels(model: torch.nn.Module) -> dict[str, int]:
    from torch.distributed.tensor import DTensor

    return {n: (p.to_local() if isinstance(p, DTensor) else p).numel() for n, p in model.named_parameters()}


def fsdp(out: Path) -> dict[str, Any]:
    """Every config trained with fsdp=True (FSDP2 across processes; one process trains unsharded)."""
    results: dict[str, Any] = {"configs": {}}
    for name, optim, lr, steps, config in CONFIGS:
        only = {"save_only_model": True} if name == MODEL_ONLY else {}
        trainer = trainer_for(out / "runs" / name, optim, lr, steps, fsdp=True, fsdp_config=config, **only)
        output = trainer.train()
        trainer.save_model()
        results["configs"][name] = {
            "params": full_params(trainer.model),
            "local_numels": local_numels(trainer.model),
            "log_history": list(trainer.state.log_history),
            "training_loss": output.training_loss,
            "model_class": type(trainer.model).__name__,
            "head_class": type(trainer.model.head).__name__,
        }
    results["evaluate"] = trainer.evaluate(eval_set())
    results["world_size"] = trainer.args.world_size
    # bf16: FSDP's policy computes in bf16 and reduces in float32; the sharded weights stay float32
    mixed = trainer_for(out / "bf16", optim, lr, steps, fsdp=True, bf16=True, save_strategy="no", max_steps=2)
    policy = getattr(mixed.distributed, "fsdp", None)
    results["bf16"] = {
        "training_loss": mixed.train().training_loss,
        "param_dtypes": sorted({str(p.dtype) for p in mixed.model.parameters()}),
        "policy": None if policy is None else [str(policy.mixed_precision_policy.param_dtype),
                                               str(policy.mixed_precision_policy.reduce_dtype)],
        "plugins": [type(plugin).__name__ for plugin in mixed.plugins],
    }  # fmt: skip
    results["engine"] = engine_run()
    if results["world_size"] > 1:  # a layer class the model lacks fails when the Trainer is made
        from trainbus.engine import ConfigError

        try:
            trainer_for(
                out / "bad", optim, lr, steps, fsdp=True, fsdp_config={"transformer_layer_cls_to_wrap": "DecoderLayer"}
            )
        except ConfigError as exc:
            results["bad_wrap_error"] = str(exc)
    return results


def engine_run() -> dict[str, list[float]]:
    """A hand-composed Engine whose optimizer exists before FSDP shards the model (it is re-pointed)."""
    from torch.utils.data import DataLoader

    from trainbus.engine import Engine
    from trainbus.plugins import Distributed, EpochSampler, GradientAccumulation, default_data_collator
    from trainbus.plugins.distributed.fsdp import fsdp_plugin

    model, data = TokenModel(), train_set()
    loader = DataLoader(data, batch_size=per_device_batch(), sampler=EpochSampler(len(data), seed=0),
                        collate_fn=default_data_collator)  # fmt: skip
    plugins: list[Any] = [GradientAccumulation(1)]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        plugins.insert(0, Distributed(fsdp=fsdp_plugin()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    Engine(model, optimizer, train_data=loader, max_epochs=2, plugins=plugins).fit()
    return full_params(model)


def resume(out: Path) -> dict[str, Any]:
    """RESUMED's checkpoint-2 (copied from the full run) resumed in a fresh launch.

    Launched with ``accelerate launch --config_file`` and no fsdp argument: the accelerate config
    asks for FSDP2.
    """
    name, optim, lr, steps, _ = next(c for c in CONFIGS if c[0] == RESUMED)
    run = out / "resumed"
    if int(os.environ.get("RANK", "0")) == 0:
        shutil.rmtree(run, ignore_errors=True)
        shutil.copytree(out / "runs" / name / "checkpoint-2", run / "checkpoint-2")
    torch.distributed.barrier() if torch.distributed.is_initialized() else None
    counter = forward_counter()
    trainer = trainer_for(run, optim, lr, steps, callbacks=[counter])
    output = trainer.train(resume_from_checkpoint=True)
    return {
        "params": full_params(trainer.model),
        "log_history": trainer.state.log_history,
        "training_loss": output.training_loss,
        "forwards": counter.forwards,
        "sharded": type(trainer.model).__name__,
    }


def deepspeed(out: Path) -> dict[str, Any]:
    """adamw-k1 under ZeRO-2 and ZeRO-3 through accelerate (DS_ACCELERATOR=cpu); each resumed from its checkpoint-2."""
    results: dict[str, Any] = {}
    _, optim, lr, steps, _ = CONFIGS[0]
    for stage in ZERO_STAGES:
        config = {"zero_optimization": {"stage": stage}, "train_micro_batch_size_per_gpu": "auto",
                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}  # fmt: skip
        run = out / f"zero{stage}"
        # float32: DeepSpeed >= 0.19.8 refuses float64 parameters under ZeRO-3 (its master weights are float32 anyway)
        trainer = trainer_for(run / "full", optim, lr, steps, model=TokenModel().float(), deepspeed=config)
        output = trainer.train()
        trainer.save_model()
        results[f"zero{stage}"] = {
            "params": _gathered(trainer),
            "log_history": list(trainer.state.log_history),
            "training_loss": output.training_loss,
            "engine": type(trainer.distributed.zero.ds_engine).__name__,
            "files": sorted(p.name for p in (run / "full" / "checkpoint-2").iterdir()),
        }
        if int(os.environ.get("RANK", "0")) == 0:
            shutil.copytree(run / "full" / "checkpoint-2", run / "resumed" / "checkpoint-2")
        torch.distributed.barrier()
        resumed = trainer_for(run / "resumed", optim, lr, steps, model=TokenModel().float(), deepspeed=config)
        resumed.train(resume_from_checkpoint=True)
        results[f"zero{stage}"]["resumed"] = {
            "params": _gathered(resumed),
            "log_history": list(resumed.state.log_history),
        }
    return results


def _gathered(trainer: Any) -> dict[str, list[float]]:
    engine = trainer.distributed.zero.ds_engine
    if engine.zero_optimization_stage() == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(trainer.model.parameters())):
            return {n: p.detach().reshape(-1).tolist() for n, p in trainer.model.named_parameters()}
    return {n: p.detach().reshape(-1).tolist() for n, p in trainer.model.named_parameters()}


JOBS = {"fsdp": fsdp, "resume": resume, "deepspeed": deepspeed}


if __name__ == "__main__":
    run_job_main(JOBS, sys.argv[1:])
