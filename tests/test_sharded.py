"""Sharded training on 2 gloo CPU processes: FSDP2 against one process, sharded checkpoints, DeepSpeed, batch finding.

The jobs live in ``sharded_jobs.py`` (``dist_jobs.py``'s float64 token model with uneven -100 padding);
one process runs per-device batch 8, two processes per-device batch 4. Launches are shared across the
tests through module fixtures: one process, two processes (torchrun), the resume (accelerate launch
with an FSDP config file), DeepSpeed (torchrun, ``DS_ACCELERATOR=cpu``).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
from dist_helpers import TOL, assert_close, free_port, launch_job, results, untimed

from trainbus.engine import ConfigError
from trainbus.plugins import Trainer, TrainingArguments
from trainbus.plugins.checkpoints.sharded import consolidate_checkpoint
from trainbus.plugins.distributed.batch_size import EVAL_OOM
from trainbus.plugins.distributed.fsdp import fsdp_plugin, fsdp_plugin_kwargs

JOBS = Path(__file__).with_name("sharded_jobs.py")


def launch(job: str, out: Path, processes: int, launcher: str = "torchrun", **env: str) -> None:
    """Run ``sharded_jobs.py JOB OUT``; ``env`` adds to its environment.

    accelerate launch reads a config file asking for FSDP2: the job's own arguments say nothing of FSDP.
    """
    accelerate_args = None
    if launcher == "accelerate":
        out.mkdir(parents=True, exist_ok=True)
        config = out / "accelerate_fsdp.yaml"
        config.write_text(ACCELERATE_FSDP_CONFIG.format(processes=processes, port=free_port()))
        accelerate_args = ["--config_file", str(config)]
    launch_job(JOBS, job, out, processes, launcher=launcher, accelerate_args=accelerate_args, env=env, timeout=420)


ACCELERATE_FSDP_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: Linear
  fsdp_reshard_after_forward: true
  fsdp_offload_params: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
machine_rank: 0
mixed_precision: 'no'
num_machines: 1
num_processes: {processes}
main_process_port: {port}
use_cpu: false
"""


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The FSDP job on one process (unsharded) and on two (FSDP2), sharing the global batch."""
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    launch("fsdp", one, 1)
    launch("fsdp", two, 2)
    return one, two


# -- FSDP2 on 2 CPU processes against one process ---------------------------------------------------------
def test_fsdp_on_two_processes_equals_one_process(fsdp_runs: tuple[Path, Path]) -> None:
    from sharded_jobs import CONFIGS

    one, two = fsdp_runs
    single, ranks = results(one, "fsdp"), [results(two, "fsdp", r) for r in range(2)]
    assert single["world_size"] == 1 and [r["world_size"] for r in ranks] == [2, 2]
    for name, *_ in CONFIGS:
        expected = single["configs"][name]
        assert expected["model_class"] == "TokenModel"  # one process: FSDP has nothing to shard across
        for rank in ranks:
            got = rank["configs"][name]
            assert got["model_class"] == "FSDPTokenModel"  # sharded in place by fully_shard
            assert_close(got["params"], expected["params"], f"{name} params")
            # every step's loss, grad_norm (the norm over all shards, before clipping) and learning rate
            assert_close(untimed(got["log_history"]), untimed(expected["log_history"]), f"{name} logs")
            assert_close(got["training_loss"], expected["training_loss"], f"{name} training_loss")
        # each rank holds its half of every parameter (11 rows: 6 and 5)
        numels = [rank["configs"][name]["local_numels"] for rank in ranks]
        assert all(numels[0][p] + numels[1][p] == math.prod(_shape(p)) for p in numels[0])
        assert numels[0]["embed.weight"] == 6 * 8 and numels[1]["embed.weight"] == 5 * 8
    # fsdp_config reached FSDP: the head is its own unit, checkpointed in the second config
    assert [ranks[0]["configs"][n]["head_class"] for n, *_ in CONFIGS] == ["FSDPLinear", "FSDPCheckpointWrapper"]
    for rank in ranks:  # evaluation of the sharded model: 101 samples, exact metrics
        assert_close(untimed([rank["evaluate"]]), untimed([single["evaluate"]]), "evaluate")
    assert "transformer layer class DecoderLayer" in ranks[0]["bad_wrap_error"]
    for rank in ranks:  # a bare Engine whose AdamW was made before sharding: pointed at the sharded parameters
        assert_close(rank["engine"], single["engine"], "engine params")
    for rank in ranks:  # bf16: autocast by MixedPrecision, bf16 compute / float32 reduction by FSDP's policy
        mixed = rank["bf16"]
        assert mixed["policy"] == ["torch.bfloat16", "torch.float32"] and mixed["param_dtypes"] == ["torch.float32"]
        assert "MixedPrecision" in mixed["plugins"] and math.isfinite(mixed["training_loss"])


def _shape(name: str) -> tuple[int, ...]:
    return {"embed.weight": (11, 8), "head.weight": (11, 8), "head.bias": (11,)}[
        name.replace("_checkpoint_wrapped_module.", "")
    ]


def test_each_rank_writes_only_its_shard_of_a_checkpoint(fsdp_runs: tuple[Path, Path], tmp_path: Path) -> None:
    one, two = fsdp_runs
    single = one / "runs" / "adamw-k1" / "checkpoint-2"
    sharded = two / "runs" / "adamw-k1" / "checkpoint-2"
    manifest = json.loads((sharded / "manifest.json").read_text())
    assert manifest["sharded"] == "fsdp2" and manifest["world_size"] == 2
    assert not (sharded / "model.safetensors").exists()
    full = st.load_file(str(single / "model.safetensors"))
    index = json.loads((sharded / "shards.json").read_text())["tensors"]
    held = []
    for rank in range(2):
        own = st.load_file(str(sharded / f"model-rank{rank}.safetensors"))
        assert sorted(own) == sorted(full)
        held.append(sum(t.numel() for t in own.values()))
        for name, tensor in own.items():
            piece = next(s for s in index[name]["slices"] if s["rank"] == rank)
            rows = slice(piece["offsets"][0], piece["offsets"][0] + piece["sizes"][0])
            assert list(tensor.shape) == piece["sizes"]
            torch.testing.assert_close(tensor, full[name][rows], rtol=0, atol=TOL)
        # the optimizer's states are this rank's slices too
        exp_avg = st.load_file(str(sharded / f"optimizer-rank{rank}.safetensors"))
        assert exp_avg and all(t.numel() <= 48 for t in exp_avg.values())
    # this rank's rows of every tensor (6 and 5 of 11), and nothing more: the ranks' files partition the model
    assert held == [6 * (8 + 8 + 1), 5 * (8 + 8 + 1)] and sum(held) == sum(t.numel() for t in full.values())
    # save_only_model: each rank's slices of the model, and no optimizer, plugin or RNG state
    model_only = two / "runs" / "sgd-k2" / "checkpoint-2"
    assert json.loads((model_only / "manifest.json").read_text())["model_only"] is True
    assert sorted(p.name for p in model_only.iterdir()) == [
        "manifest.json", "model-rank0.safetensors", "model-rank1.safetensors", "shards.json", "trainbus_state.json",
        "trainer_state.json",
    ]  # fmt: skip
    # the slices put together in one process give the one-process checkpoint's model
    consolidated = st.load_file(str(consolidate_checkpoint(sharded, tmp_path / "consolidated")))
    for name, tensor in full.items():
        torch.testing.assert_close(consolidated[name], tensor, rtol=0, atol=TOL)


def test_save_model_after_a_sharded_run_loads_in_one_process(fsdp_runs: tuple[Path, Path]) -> None:
    from dist_jobs import TokenModel

    from trainbus.plugins import load_model_weights

    one, two = fsdp_runs
    for name in ("adamw-k1", "sgd-k2"):
        saved = two / "runs" / name
        written = json.loads((saved / "trainbus_model.json").read_text())
        assert written["class"] == "dist_jobs.TokenModel" and written["num_parameters"] == 11 * 8 * 2 + 11
        model = TokenModel()
        load_model_weights(model, saved)  # one safetensors file, one process
        gathered = results(two, "fsdp")["configs"][name]["params"]
        assert {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()} == gathered
        reference = TokenModel()
        load_model_weights(reference, one / "runs" / name)
        for (n, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=TOL, msg=n)


# -- resume in a fresh launch (accelerate launch --config_file, no fsdp argument) ---------------------------
def test_sharded_checkpoint_resumes_bit_exactly_from_an_accelerate_config(fsdp_runs: tuple[Path, Path]) -> None:
    from sharded_jobs import RESUMED

    _, two = fsdp_runs
    launch("resume", two, 2, launcher="accelerate")
    reference = results(two, "fsdp")["configs"][RESUMED]
    for rank in range(2):
        resumed = results(two, "resume", rank)
        assert resumed["sharded"] == "FSDPTokenModel"  # the accelerate config's FSDP2 was honoured
        assert resumed["params"] == reference["params"]  # bit for bit
        steps = [entry for entry in resumed["log_history"] if "loss" in entry]
        assert steps == [entry for entry in reference["log_history"] if "loss" in entry]
        assert [e["step"] for e in steps] == list(range(1, 7)) and resumed["forwards"] == 4
    for step in (4, 6):  # the checkpoints the resumed run wrote equal the uninterrupted run's, file by file
        for name in ("model-rank0", "model-rank1", "optimizer-rank0", "optimizer-rank1"):
            a = st.load_file(str(two / "resumed" / f"checkpoint-{step}" / f"{name}.safetensors"))
            b = st.load_file(str(two / "runs" / RESUMED / f"checkpoint-{step}" / f"{name}.safetensors"))
            assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), (step, name)


def test_a_sharded_checkpoint_at_another_world_size_says_how_to_go_on(fsdp_runs: tuple[Path, Path]) -> None:
    from dist_jobs import TokenModel

    from trainbus.plugins.checkpoints.checkpoint import load_checkpoint

    _, two = fsdp_runs
    args = TrainingArguments(str(two / "other"), save_strategy="no", report_to="none", use_cpu=True)
    trainer = Trainer(TokenModel(), args)
    trainer.create_optimizer()
    with pytest.raises(ConfigError, match=r"written by 2 processes but this run has 1: resume it with 2 .*consolidate"):
        load_checkpoint(trainer, two / "runs" / "adamw-k1" / "checkpoint-2")


# -- DeepSpeed through accelerate (ZeRO-2 and ZeRO-3 on CPU) ---------------------------------------------
DS_TOL = 1e-6  # DeepSpeed trains a float32 copy of the float64 model (float32 master weights and states)


def test_deepspeed_zero_through_accelerate_trains_and_resumes(fsdp_runs: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from dist_jobs import TokenModel
    from sharded_jobs import ZERO_STAGES

    from trainbus.plugins import load_model_weights

    one, _ = fsdp_runs
    launch("deepspeed", tmp_path, 2, DS_ACCELERATOR="cpu")
    expected = results(one, "fsdp")["configs"]["adamw-k1"]
    steps = [e for e in expected["log_history"] if "loss" in e]
    for rank in range(2):
        got = results(tmp_path, "deepspeed", rank)
        for stage in ZERO_STAGES:
            run = got[f"zero{stage}"]
            assert run["engine"] == "DeepSpeedEngine"
            for param, values in expected["params"].items():
                assert max(abs(x - y) for x, y in zip(values, run["params"][param])) < DS_TOL, (stage, param)
            logged = [e for e in run["log_history"] if "loss" in e]
            for key in ("loss", "grad_norm", "learning_rate"):  # grad_norm: DeepSpeed's, before its clipping
                assert all(abs(a[key] - b[key]) < DS_TOL for a, b in zip(logged, steps, strict=True)), (stage, key)
            # each rank wrote its own ZeRO partition, rank 0 the module's weights (ZeRO-3: only its buffers)
            assert {"zero-rank0.safetensors", "zero-rank1.safetensors", "model-rank0.safetensors"} <= set(run["files"])
            assert not {"optimizer.safetensors", "model.safetensors"} & set(run["files"])
            # resumed from checkpoint-2 by a fresh Trainer: bit for bit
            assert run["resumed"]["params"] == run["params"], stage
            assert [e for e in run["resumed"]["log_history"] if "loss" in e] == logged
    manifest = json.loads((tmp_path / "zero3" / "full" / "checkpoint-2" / "manifest.json").read_text())
    assert manifest["sharded"] == "deepspeed-zero3" and manifest["world_size"] == 2
    for stage in ZERO_STAGES:  # save_model: one file that loads in one process (ZeRO-3 gathered it)
        model = TokenModel()
        load_model_weights(model, tmp_path / f"zero{stage}" / "full")
        saved = {n: p.detach().reshape(-1).tolist() for n, p in model.named_parameters()}
        assert saved == results(tmp_path, "deepspeed")[f"zero{stage}"]["params"]


# -- auto_find_batch_size ----------------------------------------------------------------------------------
class MemoryLimited(torch.nn.Module):
    """The token model, running out of memory on training batches of more than ``limit`` rows from forward ``after``."""

    def __init__(self, limit: int, after: int = 1, in_eval: bool = False) -> None:
        from dist_jobs import TokenModel

        super().__init__()
        self.inner = TokenModel()
        self.limit, self.after, self.in_eval, self.forwards = limit, after, in_eval, 0

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        self.forwards += self.training
        if (self.training or self.in_eval) and self.forwards >= self.after and input_ids.shape[0] > self.limit:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB"
            )
        return self.inner(input_ids, labels)  # type: ignore[no-any-return]


def _batch_trainer(out: Path, model: torch.nn.Module, batch: int, **more: Any) -> Trainer:
    from dist_jobs import eval_set, train_set

    args = TrainingArguments(**more,
        output_dir=str(out), per_device_train_batch_size=batch, num_train_epochs=2, learning_rate=0.05,
        optim="adamw_torch", logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
        seed=0,
    )  # fmt: skip
    return Trainer(model, args, train_dataset=train_set(), eval_dataset=eval_set() if more else None)


def test_auto_find_batch_size_halves_after_out_of_memory_and_starts_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # batch 8 runs out of memory at the 4th forward (epoch 2's first batch), after 3 optimizer steps;
    # batch 4 fits: the run starts over from the first weights, optimizer state and RNG states
    model = MemoryLimited(limit=4, after=4)
    trainer = _batch_trainer(tmp_path / "auto", model, 8, auto_find_batch_size=True)
    with caplog.at_level(logging.WARNING, logger="trainbus"):
        output = trainer.train()
    assert "out of memory at per-device train batch size 8" in caplog.text
    assert "training again from the start with per-device train batch size 4" in caplog.text
    assert trainer.state.train_batch_size == 4 and output.global_step == 2 * 5  # 20 samples / 4, two epochs
    fresh = _batch_trainer(tmp_path / "fresh", MemoryLimited(limit=100), 4)
    expected = fresh.train()
    assert [p.tolist() for p in model.parameters()] == [p.tolist() for p in fresh.model.parameters()]  # bit for bit
    assert untimed(trainer.state.log_history) == untimed(fresh.state.log_history)
    assert output.training_loss == expected.training_loss


def test_auto_find_batch_size_gives_up_at_zero_and_blames_evaluation(tmp_path: Path) -> None:
    trainer = _batch_trainer(tmp_path / "never", MemoryLimited(limit=0), 8, auto_find_batch_size=True)
    with pytest.raises(RuntimeError, match="No executable batch size found, reached zero"):
        trainer.train()
    # an eval batch that runs out of memory is not the train batch's fault: no halving, HF's message
    evaluating = MemoryLimited(limit=4, in_eval=True)
    trainer = _batch_trainer(tmp_path / "eval", evaluating, 4, auto_find_batch_size=True, eval_strategy="steps",
                             eval_steps=2, per_device_eval_batch_size=8)  # fmt: skip
    with pytest.raises(RuntimeError, match="reduce `per_device_eval_batch_size` instead") as raised:
        trainer.train()
    assert str(raised.value) == EVAL_OOM and trainer.state.train_batch_size == 4
    # without auto_find_batch_size the error is the model's own
    with pytest.raises(torch.OutOfMemoryError):
        _batch_trainer(tmp_path / "plain", MemoryLimited(limit=4), 8).train()


# -- bad input fails when the arguments are made -------------------------------------------------------------
def test_bad_fsdp_options_fail_at_construction_naming_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def make(**kwargs: Any) -> TrainingArguments:
        return TrainingArguments(str(tmp_path), **kwargs)

    with pytest.raises(ConfigError, match=r"unknown fsdp_config key 'versoin'; did you mean 'version'"):
        make(fsdp=True, fsdp_config={"versoin": 2})
    broken = tmp_path / "fsdp.json"
    broken.write_text('{"reshard_after_forward": true,}')
    with pytest.raises(ConfigError, match=r"fsdp_config file '.*fsdp.json' is not valid JSON"):
        make(fsdp=True, fsdp_config=str(broken))
    with pytest.raises(ConfigError, match=r"fsdp_config file '.*missing.json' does not exist"):
        make(fsdp=True, fsdp_config=str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match=r"unknown fsdp option 'ful_shard'; did you mean 'full_shard'"):
        make(fsdp="ful_shard")
    with pytest.raises(ConfigError, match="'hybrid_shard' is an FSDP1 strategy"):
        make(fsdp="hybrid_shard auto_wrap")
    with pytest.raises(ConfigError, match=r"fsdp_config\['reshard_after_forward'\] must be true or false, got 'maybe'"):
        make(fsdp=True, fsdp_config={"reshard_after_forward": "maybe"})
    with pytest.raises(ConfigError, match="set version 2"):
        make(fsdp=True, fsdp_config={"fsdp_version": 1})
    with pytest.raises(ConfigError, match=r"auto_wrap_policy'\]='BY_SIZE'; allowed"):
        make(fsdp=True, fsdp_config={"auto_wrap_policy": "BY_SIZE"})
    with pytest.raises(ConfigError, match="SIZE_BASED_WRAP' needs min_num_params > 0"):
        make(fsdp=True, fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP"})
    with pytest.raises(ConfigError, match="'NO_WRAP' picks none"):
        make(fsdp=True, fsdp_config={"auto_wrap_policy": "NO_WRAP", "activation_checkpointing": True})
    with pytest.raises(ConfigError, match=r"cpu_ram_efficient_loading.*not supported"):
        make(fsdp=True, fsdp_config={"cpu_ram_efficient_loading": "true"})
    with pytest.raises(ConfigError, match="fsdp_config is set but fsdp is off"):
        make(fsdp_config={"version": 2})
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # as `accelerate launch` sets it from a config file
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match=r"accelerate config asks for FSDP version 1.*set fsdp_version: 2"):
        make()


def test_fsdp_options_map_to_accelerates_plugin(tmp_path: Path) -> None:
    config = tmp_path / "fsdp.json"
    options = {"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "fsdp_cpu_offload": "false"}
    config.write_text(json.dumps({**options, "use_orig_params": True}))  # an FSDP1 key: ignored, as HF does
    args = TrainingArguments(str(tmp_path), fsdp="shard_grad_op auto_wrap", fsdp_config=str(config))
    assert args.fsdp_plugin_args == {
        "fsdp_version": 2, "reshard_after_forward": False, "cpu_offload": False, "activation_checkpointing": False,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_cls_names_to_wrap": ["LlamaDecoderLayer"],
        "state_dict_type": "SHARDED_STATE_DICT",
    }  # fmt: skip
    plugin = fsdp_plugin(args.fsdp_plugin_args, "bf16")
    assert type(plugin).__name__ == "FullyShardedDataParallelPlugin" and plugin.fsdp_version == 2
    assert plugin.reshard_after_forward is False
    # FSDP casts the gathered parameters for compute and reduce-scatters the gradients in float32
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert fsdp_plugin(fsdp_plugin_kwargs(True, None)).mixed_precision_policy is None
    assert fsdp_plugin_kwargs(None, None) is None and TrainingArguments(str(tmp_path)).fsdp_plugin_args is None


def test_bad_deepspeed_configs_fail_at_construction_naming_them(tmp_path: Path) -> None:
    def make(**kwargs: Any) -> TrainingArguments:
        return TrainingArguments(str(tmp_path), **kwargs)

    broken = tmp_path / "ds.json"
    broken.write_text('{"zero_optimization": {"stage": 2}')
    with pytest.raises(ConfigError, match=r"deepspeed config file '.*ds.json' is not valid JSON"):
        make(deepspeed=str(broken))
    with pytest.raises(ConfigError, match=r"deepspeed config file '.*nothing.json' does not exist"):
        make(deepspeed=str(tmp_path / "nothing.json"))
    with pytest.raises(ConfigError, match="needs a 'zero_optimization' object"):
        make(deepspeed={"train_micro_batch_size_per_gpu": "auto"})
    with pytest.raises(ConfigError, match=r"zero_optimization.stage=5; allowed: \(0, 1, 2, 3\)"):
        make(deepspeed={"zero_optimization": {"stage": 5}})
    with pytest.raises(ConfigError, match="has a 'optimizer' section: trainbus builds the optimizer"):
        make(deepspeed={"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}})
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu=16 but per_device_train_batch_size=8"):
        make(deepspeed={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 16})
    with pytest.raises(ConfigError, match=r"bf16.enabled=True but bf16\|bf16_full_eval=False"):
        make(deepspeed={"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="fsdp and deepspeed are both set"):
        make(fsdp=True, deepspeed={"zero_optimization": {"stage": 2}})
    with pytest.raises(ConfigError, match="auto_find_batch_size is not supported with deepspeed"):
        make(auto_find_batch_size=True, deepspeed={"zero_optimization": {"stage": 2}})


def test_a_deepspeed_config_maps_to_accelerates_plugin_with_auto_values_filled(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"},
                                  "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                                  "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}))  # fmt: skip
    args = TrainingArguments(str(tmp_path), deepspeed=str(config), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_grad_norm=0.5, bf16=True)  # fmt: skip
    plugin = args.deepspeed_plugin
    assert type(plugin).__name__ == "DeepSpeedPlugin" and plugin.zero_stage == 3
    filled = plugin.deepspeed_config
    assert (filled["train_micro_batch_size_per_gpu"], filled["train_batch_size"]) == (4, 8)
    assert (filled["gradient_accumulation_steps"], filled["gradient_clipping"]) == (2, 0.5)
    assert filled["bf16"] == {"enabled": True}
    assert json.loads(config.read_text())["bf16"] == {"enabled": "auto"}  # the user's file is left alone
