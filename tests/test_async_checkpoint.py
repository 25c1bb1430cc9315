"""Asynchronous checkpoints (``save_async=True``, #36 item 1) write what synchronous ones write and keep their promises.

Each equality test trains one run twice, ``save_async=False`` and ``True``, and compares every checkpoint file
(tensor files by their bytes and manifest entries, JSON files parsed, without the run's id and folder), then resumes
the asynchronous run's middle checkpoint: the end is the synchronous run's, bit for bit. Then: the host buffers are
reused and hold the saving step's values while training changes the weights in place; the best model, rotation and
``only_best_at_end``; Trainer subclasses; a writer's error; a failed run; the argument. Kills and full disks are
test_async_checkpoint_kills.py's; two processes test_async_checkpoint_ddp.py's.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch as st
import torch
from facade_helpers import Regressor, quiet_args, regression_data
from test_checkpoint import make_engine

from trainbus.engine import ConfigError, Engine, Event
from trainbus.engine.events import StepEndEvent
from trainbus.plugins import Trainer
from trainbus.plugins.checkpoints import io as cio
from trainbus.plugins.checkpoints import verified
from trainbus.plugins.checkpoints.background import CheckpointWriteError
from trainbus.plugins.checkpoints.checkpoint import Checkpointing, list_checkpoints, resume
from trainbus.plugins.checkpoints.snapshot import HostBuffers
from trainbus.plugins.checkpoints.writing import PendingCheckpoint

DROPPED = ("run_id", "save_async", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
PASSED = ("processing_class", "callbacks", "eval_dataset", "compute_metrics")  # train()'s Trainer arguments
RESUMED = ("event_counts", "torchelastic_run")  # a resumed run counts its own events; a fresh launch has its id


# -- comparing runs ------------------------------------------------------------------------------------
def _normal(value: Any, dropped: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        return {k: _normal(v, dropped) for k, v in value.items() if k not in dropped}
    if isinstance(value, list):
        return [_normal(v, dropped) for v in value]
    return value


def snapshot(run: Path, steps: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Every file of ``run``'s checkpoints, comparable across runs: tensor and other files as bytes with their
    manifest entry, JSON files parsed, without the run's folder, id, ``save_async`` and timings (``steps``:
    those of a resumed run, without the event counts too)."""
    assert not [p.name for p in run.iterdir() if ".tmp-" in p.name], "a temporary folder is left"
    found: dict[str, Any] = {}
    for step, checkpoint in list_checkpoints(run):
        if steps is not None and step not in steps:
            continue
        entries = verified.read_manifest(checkpoint)["files"]
        for path in sorted(checkpoint.iterdir()):
            if path.suffix == ".json":
                dropped = DROPPED if steps is None else DROPPED + RESUMED
                value = _normal(json.loads(path.read_text().replace(str(run), "<run>")), dropped)
                if path.name == "manifest.json":  # a JSON file's hash holds the run id; a tensor file's must agree
                    value["files"] = {n: e if not n.endswith(".json") else "json" for n, e in value["files"].items()}
                found[f"{checkpoint.name}/{path.name}"] = value
            else:
                found[f"{checkpoint.name}/{path.name}"] = (path.read_bytes(), entries.get(path.name))
    return found


def assert_same_checkpoints(one: Path, two: Path, steps: tuple[int, ...] | None = None) -> None:
    a, b = snapshot(one, steps), snapshot(two, steps)
    assert sorted(a) == sorted(b) and a, f"{sorted(a)} != {sorted(b)}"
    for name in a:
        assert a[name] == b[name], name


def assert_same_params(one: torch.nn.Module, two: torch.nn.Module) -> None:
    a, b = dict(one.named_parameters()), dict(two.named_parameters())
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def writes_in_background(trainer: Engine) -> int:
    plugin = trainer.get_plugin(Checkpointing)
    assert plugin is not None and plugin.writer is not None
    return plugin.writer.writes


def train(out: Path, *, trainer_class: type[Trainer] = Trainer, model: Callable[[], Any] = Regressor,
          data: Any = None, resume_from: Path | None = None, **options: Any) -> Trainer:  # fmt: skip
    torch.manual_seed(0)
    settings = {"save_strategy": "steps", "save_steps": 2, "max_steps": 6, "logging_steps": 1, "seed": 0, **options}
    more = {key: settings.pop(key) for key in PASSED if key in settings}
    trainer = trainer_class(model(), quiet_args(out, **settings), train_dataset=data or regression_data(24), **more)
    trainer.train(resume_from_checkpoint=None if resume_from is None else str(resume_from))
    return trainer


def check_trainer_runs(tmp_path: Path, resumable: bool = True, **options: Any) -> Trainer:
    """A synchronous and an asynchronous run write equal checkpoints; the asynchronous run's checkpoint-2, resumed
    (asynchronously), ends where the synchronous run ends and writes its checkpoints again."""
    sync = train(tmp_path / "sync", **options)
    done = train(tmp_path / "async", save_async=True, **options)
    assert writes_in_background(done) == 3
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")
    assert_same_params(sync.model, done.model)
    if resumable:
        later = train(tmp_path / "resumed", save_async=True, resume_from=tmp_path / "async" / "checkpoint-2", **options)
        assert_same_params(later.model, sync.model)
        assert_same_checkpoints(tmp_path / "sync", tmp_path / "resumed", steps=(4, 6))
    return done


# -- equality ------------------------------------------------------------------------------------------
def test_a_bare_engine_writes_the_same_checkpoints_and_resumes_bit_exact(tmp_path: Path) -> None:
    sync, done = make_engine(tmp_path / "sync", 6, save_steps=2), make_engine(tmp_path / "async", 6, save_steps=2,
                                                                            save_async=True)  # fmt: skip
    sync.fit(), done.fit()
    assert writes_in_background(done) == 3
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")
    resumed = make_engine(tmp_path / "resumed", 6, save_steps=2, save_async=True)
    resume(resumed, tmp_path / "async" / "checkpoint-2")
    resumed.fit()
    assert_same_params(resumed.model, sync.model)
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "resumed", steps=(4, 6))


@pytest.mark.parametrize(
    "options",
    [{}, {"gradient_accumulation_steps": 2}, {"fp16": True}, {"bf16": True}, {"save_only_model": True}],
    ids=["plain", "accumulation", "fp16", "bf16", "save_only_model"],
)
def test_the_trainer_writes_the_same_checkpoints_and_resumes_bit_exact(tmp_path: Path, options: dict[str, Any]) -> None:
    check_trainer_runs(tmp_path, resumable=not options.get("save_only_model"), **options)


def test_a_model_folder_with_config_and_tokenizer_is_the_same(tmp_path: Path) -> None:
    from facade_helpers import tiny_bert, token_data
    from test_hf_protocol import local_tokenizer

    tokenizer = local_tokenizer(tmp_path / "tok")
    check_trainer_runs(tmp_path, model=tiny_bert, data=token_data(24), processing_class=tokenizer)
    names = {p.name for p in (tmp_path / "async" / "checkpoint-2").iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= names


def test_a_lora_model_writes_the_same_adapter_checkpoints(tmp_path: Path) -> None:
    from test_adapters import lora
    from test_adapters import token_data as lora_data

    check_trainer_runs(tmp_path, model=lora, data=lora_data(24), learning_rate=1e-2)
    names = {p.name for p in (tmp_path / "async" / "checkpoint-2").iterdir()}
    assert {"trainbus_weights.safetensors", "adapter_model.safetensors", "adapter_config.json"} <= names


def test_a_long_log_history_links_its_segments_as_a_synchronous_save_does(tmp_path: Path) -> None:
    options = {"max_steps": 300, "save_steps": 130}  # 300 records: one full segment, linked by the third save
    sync = train(tmp_path / "sync", **options)
    done = train(tmp_path / "async", save_async=True, **options)
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")
    for run in ("sync", "async"):
        manifest = verified.read_manifest(tmp_path / run / "checkpoint-300")
        segment = manifest["log_history_segments"][0]
        linked = [os.stat(tmp_path / run / f"checkpoint-{s}" / segment).st_ino for s in (260, 300)]
        assert linked[0] == linked[1], run  # one inode: the later save linked the earlier one's segment
    later = train(tmp_path / "resumed", save_async=True, resume_from=tmp_path / "async" / "checkpoint-260", **options)
    assert_same_params(later.model, sync.model)
    assert later.state.log_history[:-1] == done.state.log_history[:-1]  # all but the timed summary


# -- the copy: reused buffers, the saving step's values ------------------------------------------------
def test_the_buffers_are_reused_and_hold_the_saving_steps_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, original_write, original_take = threading.Event(), PendingCheckpoint.write, HostBuffers.take

    def held_write(self: PendingCheckpoint) -> Path:
        if self.final.name == "checkpoint-4":
            assert release.wait(60), "never released"
        return original_write(self)

    pointers: list[tuple[str, dict[str, int]]] = []  # each take's buffers: weights, optimizer, plugins, rng

    def take(self: HostBuffers, prefix: str, tensors: Any) -> dict[str, torch.Tensor]:
        copies = original_take(self, prefix, tensors)
        assert all(copies[k].data_ptr() != t.data_ptr() for k, t in tensors.items() if t.numel())  # a real copy
        pointers.append((prefix, {k: v.data_ptr() for k, v in copies.items()}))
        return copies

    monkeypatch.setattr(PendingCheckpoint, "write", held_write)
    monkeypatch.setattr(HostBuffers, "take", take)
    engine = make_engine(tmp_path, 8, save_steps=4, save_async=True)
    plugin = engine.get_plugin(Checkpointing)
    assert plugin is not None and plugin.writer is not None
    at_save: dict[str, Any] = {}

    def record(ev: Any) -> None:
        if ev.engine.state.global_step == 4:
            at_save["model"] = {k: v.clone() for k, v in ev.engine.model.state_dict().items()}
            at_save["exp_avg"] = [s["exp_avg"].clone() for s in ev.engine.optimizer.state.values()]

    def release_later(ev: StepEndEvent) -> None:
        if ev.engine.state.global_step == 7:  # three steps after the save, its write still held
            assert plugin.writer is not None and plugin.writer.busy
            assert not all(torch.equal(v, at_save["model"][k]) for k, v in ev.engine.model.state_dict().items())
            release.set()

    engine.on(Event.SAVE, record)
    engine.on(Event.STEP_END, release_later)
    engine.fit()
    weights = st.load_file(str(tmp_path / "checkpoint-4" / "model.safetensors"))
    assert sorted(weights) == sorted(at_save["model"])
    for name, tensor in at_save["model"].items():
        assert torch.equal(weights[name], tensor), name
    optimizer = cio.read_bundle(tmp_path / "checkpoint-4", "optimizer")
    for saved, recorded in zip(optimizer["state"].values(), at_save["exp_avg"], strict=True):
        assert torch.equal(saved["exp_avg"], recorded)
    assert len(pointers) == 8 and pointers[:4] == pointers[4:]  # the second save reused the first one's buffers


# -- best model, rotation ------------------------------------------------------------------------------
@pytest.mark.parametrize(("limit", "best", "kept"), [(2, 4, [4, 8]), (1, 4, [4]), (1, 8, [8])])
def test_the_best_model_and_rotation_are_those_of_a_synchronous_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int, best: int, kept: list[int]
) -> None:
    slow_writes(monkeypatch, 0.1)  # best 8: its write is still in flight when training ends
    runs = {}
    for name in ("sync", "async"):
        scores = iter([1.0, 3.0, 2.0, 0.0] if best == 4 else [0.0, 1.0, 2.0, 3.0])  # at steps 2, 4, 6, 8
        runs[name] = train(tmp_path / name, save_async=name == "async", max_steps=8, eval_strategy="steps",
                           eval_steps=2, metric_for_best_model="score", greater_is_better=True, save_total_limit=limit,
                           load_best_model_at_end=True, eval_dataset=regression_data(8, 1),
                           compute_metrics=lambda p: {"score": next(scores)})  # fmt: skip
        assert runs[name].state.best_model_checkpoint == str(tmp_path / name / f"checkpoint-{best}")
        assert [step for step, _ in list_checkpoints(tmp_path / name)] == kept
    assert writes_in_background(runs["async"]) == 4
    loaded = st.load_file(str(tmp_path / "async" / f"checkpoint-{best}" / "model.safetensors"))
    assert torch.equal(runs["async"].model.lin.weight, loaded["lin.weight"])  # the best model was loaded at the end
    assert_same_params(runs["sync"].model, runs["async"].model)
    assert_same_checkpoints(tmp_path / "sync", tmp_path / "async")


# -- Trainer subclasses --------------------------------------------------------------------------------
def slow_writes(monkeypatch: pytest.MonkeyPatch, seconds: float = 0.2) -> None:
    """Each background write starts late: a reader that does not wait finds nothing."""
    original = PendingCheckpoint.write

    def slow(self: PendingCheckpoint) -> Path:
        time.sleep(seconds)
        return original(self)

    monkeypatch.setattr(PendingCheckpoint, "write", slow)


def test_a_save_checkpoint_override_finds_the_checkpoint_on_disk_after_super(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []

    class Reads(Trainer):
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            super()._save_checkpoint(model, trial)
            folder = Path(self.args.output_dir) / f"checkpoint-{self.state.global_step}"
            seen.append((sorted(p.name for p in folder.iterdir()), verified.read_manifest(folder)["global_step"]))

    slow_writes(monkeypatch)
    train(tmp_path / "run", trainer_class=Reads, save_async=True)
    assert [step for _, step in seen] == [2, 4, 6]
    assert all({"manifest.json", "model.safetensors", "optimizer.safetensors"} <= set(names) for names, _ in seen)


def test_a_save_override_still_writes_the_same_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class OwnSave(Trainer):
        def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
            super()._save(output_dir, state_dict)
            Path(output_dir or self.args.output_dir, "own.txt").write_text("written by _save")

    slow_writes(monkeypatch)
    check_trainer_runs(tmp_path, trainer_class=OwnSave)
    assert (tmp_path / "async" / "checkpoint-2" / "own.txt").read_text() == "written by _save"


def test_a_callbacks_on_save_finds_the_checkpoint_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' on_save: "called after a checkpoint save"; callbacks upload or add to checkpoint-N there."""
    from transformers import TrainerCallback

    seen: list[bool] = []

    class OnSave(TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            seen.append((Path(args.output_dir) / f"checkpoint-{state.global_step}" / "manifest.json").is_file())

    slow_writes(monkeypatch)
    train(tmp_path / "run", save_async=True, callbacks=[OnSave()])
    assert seen == [True, True, True]


# -- a writer's error, a failed run ------------------------------------------------------------------
@pytest.mark.parametrize(("failing", "raised_at"), [(4, 5), (6, 6)])
def test_a_failed_write_is_raised_at_the_next_step_once_with_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, failing: int, raised_at: int
) -> None:
    original = cio.write_manifest

    def write_manifest(directory: Path, *args: Any, **kwargs: Any) -> Any:
        if Path(directory).name.startswith(f"checkpoint-{failing}.tmp-"):
            raise OSError(28, "No space left on device")
        return original(directory, *args, **kwargs)

    monkeypatch.setattr(cio, "write_manifest", write_manifest)
    engine = make_engine(tmp_path, 6, save_steps=2, save_async=True)
    engine.on(Event.STEP_END, lambda ev: setattr(ev.engine.state, "best_global_step", ev.engine.state.global_step))
    plugin = engine.get_plugin(Checkpointing)
    assert plugin is not None and plugin.writer is not None
    writer = plugin.writer

    def written(ev: Any) -> None:  # the write has ended before the next step runs: the error is due there
        while writer.busy:
            time.sleep(0.001)

    engine.on(Event.STEP_START, written)
    with pytest.raises(CheckpointWriteError, match=f"checkpoint-{failing}") as raised:
        engine.fit()
    assert engine.state.global_step == raised_at
    assert isinstance(raised.value.__cause__, OSError) and raised.value.__cause__.errno == 28
    assert not writer.failed and caplog.text.count("the background write of") == 1
    kept = [step for step, _ in list_checkpoints(tmp_path)]
    assert kept == [s for s in (2, 4) if s < failing] and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert engine.state.best_model_checkpoint == str(tmp_path / f"checkpoint-{failing - 2}")  # rolled back


def test_a_failed_run_waits_for_the_write_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release, original = threading.Event(), PendingCheckpoint.write

    def held(self: PendingCheckpoint) -> Path:
        assert release.wait(60), "never released"
        return original(self)

    monkeypatch.setattr(PendingCheckpoint, "write", held)
    checkpointing = Checkpointing(tmp_path, save_strategy="steps", save_steps=2, save_async=True)
    calls: list[int] = []

    class Failing(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            calls.append(1)
            if len(calls) == 3:  # the model fails at step 3, checkpoint-2's write in flight
                assert checkpointing.writer is not None and checkpointing.writer.busy
                threading.Timer(0.3, release.set).start()
                raise RuntimeError("the model failed at step 3")
            return super().forward(x)

    torch.manual_seed(0)
    model = Failing(3, 1)
    step2: dict[str, torch.Tensor] = {}
    data = [(torch.randn(2, 3), torch.randn(2, 1)) for _ in range(4)]
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_steps=4,
                    loss_fn=torch.nn.MSELoss(), plugins=[checkpointing])  # fmt: skip
    engine.on(Event.SAVE, lambda ev: step2.update({k: v.clone() for k, v in model.state_dict().items()}))
    with pytest.raises(RuntimeError, match="the model failed at step 3"):
        engine.fit()
    assert release.is_set() and not checkpointing.writer.busy  # type: ignore[union-attr]
    assert [step for step, _ in list_checkpoints(tmp_path)] == [2]
    folder = tmp_path / "checkpoint-2"
    verified.read_manifest(folder)  # complete: the manifest is there and reads
    weights = st.load_file(str(folder / "model.safetensors"))
    assert sorted(weights) == sorted(step2) and all(torch.equal(weights[k], v) for k, v in step2.items())


# -- the argument --------------------------------------------------------------------------------------
def test_the_argument_parser_builds_save_async_and_a_wrong_type_is_refused(tmp_path: Path) -> None:
    from transformers import HfArgumentParser

    from trainbus.plugins import TrainingArguments

    parser = HfArgumentParser(TrainingArguments)
    for argv, expected in ((["--save_async"], True), (["--save_async", "false"], False), ([], False)):
        (args,) = parser.parse_args_into_dataclasses(["--output_dir", "o", *argv], look_for_args_file=False)
        assert args.save_async is expected, argv
    plugin = Trainer(Regressor(), quiet_args(tmp_path, save_strategy="steps", save_async=True)).get_plugin(
        Checkpointing
    )
    assert plugin is not None and plugin.writer is not None and plugin.save_async is True
    with pytest.raises(ConfigError, match=r"save_async must be True or False, got 'yes'"):
        TrainingArguments(str(tmp_path), save_async="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"save_async must be True or False, got 'yes'"):
        Checkpointing(tmp_path, save_async="yes")  # type: ignore[arg-type]
