"""Checkpoint overrides run where transformers runs them (#34 items 2, 3), each against transformers.Trainer.

The same subclass (its override recording its calls, calling ``super()``, or doing what community
subclasses do: writing an extra file, saving only some weights) runs under ``transformers.Trainer`` and
``trainbus.plugins.Trainer``; the calls (points and arguments) and their effect (the files in each
checkpoint and in the final model folder) are compared, and trainbus's guarantees checked on top: the
override's files are in the checkpoint's manifest, and a resume is bit for bit.

trainbus writes a checkpoint into ``checkpoint-N.tmp-PID`` and renames it when complete, so an override
of ``save_model`` / ``_save`` gets that folder where transformers passes ``checkpoint-N``: the arguments
are compared with the suffix taken off.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.differential.hf_diff import (
    Impl,
    RegressionModel,
    RegressionPreTrainedModel,
    assert_same_logs,
    assert_same_weights,
    checkpoint_names,
    regression_trainer,
    run_both,
)

STEPS = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "logging_steps": 1, "learning_rate": 0.1}
_TMP = re.compile(r"\.tmp-\d+$")


def where(output_dir: Any, root: Path) -> str:
    """A folder an override got, relative to output_dir, without trainbus's temporary suffix."""
    return _TMP.sub("", os.path.relpath(str(output_dir), str(root)))


def manifest_files(folder: Path) -> set[str]:
    return set(json.loads((folder / "manifest.json").read_text())["files"])


# -- save_model / _save --------------------------------------------------------------------------------------
def extra_file_job(impl: Impl, out: Path, *, pretrained: bool = True, resume: str | None = None) -> dict[str, Any]:
    """``_save`` writing a file of its own next to the model, then super(); ``save_model`` recording its calls."""
    calls: list[tuple[Any, ...]] = []

    class Saving(impl.Trainer):  # type: ignore[misc,name-defined]
        def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
            calls.append(("save_model", where(output_dir or self.args.output_dir, out), _internal_call))
            super().save_model(output_dir, _internal_call)

        def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
            calls.append(("_save", where(output_dir, out), state_dict is None, self.state.global_step))
            os.makedirs(output_dir, exist_ok=True)
            Path(output_dir, "extra.json").write_text(json.dumps({"step": self.state.global_step}))
            super()._save(output_dir, state_dict)

    trainer = regression_trainer(replace(impl, Trainer=Saving), out, pretrained=pretrained, **STEPS)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    return {"trainer": trainer, "calls": calls, "out": out}


def test_save_and_save_model_overrides_run_in_every_checkpoint_and_the_final_save(tmp_path: Path) -> None:
    hf, tb = run_both(extra_file_job, tmp_path)
    assert tb["calls"] == hf["calls"], (hf["calls"], tb["calls"])
    assert [c[:3] for c in hf["calls"] if c[0] == "save_model"] == [
        ("save_model", "checkpoint-2", True), ("save_model", "checkpoint-4", True), ("save_model", ".", False),
    ]  # fmt: skip
    assert checkpoint_names(tb["out"]) == checkpoint_names(hf["out"]) == ["checkpoint-2", "checkpoint-4"]
    for name in ("checkpoint-2", "checkpoint-4", "."):
        texts = [(run["out"] / name / "extra.json").read_text() for run in (hf, tb)]
        assert texts[0] == texts[1], (name, texts)
        # the model folder under both: the weights and config.json from super()._save
        for run in (hf, tb):
            assert {"model.safetensors", "config.json"} <= set(os.listdir(run["out"] / name)), (name, run["out"])
    for name in ("checkpoint-2", "checkpoint-4"):  # written before the manifest: listed, hashed, published with it
        assert {"extra.json", "model.safetensors", "config.json"} <= manifest_files(tb["out"] / name)
        assert "weights" not in json.loads((tb["out"] / name / "manifest.json").read_text())  # super() wrote them
    assert_same_weights(hf["trainer"].model, tb["trainer"].model)


def test_a_resume_with_the_save_override_is_bit_for_bit(tmp_path: Path) -> None:
    from trainbus.plugins.checkpoints.verified import read_manifest

    full = extra_file_job(Impl_trainbus(), tmp_path / "full")
    read_manifest(tmp_path / "full" / "checkpoint-2", verify=True)  # every listed file, the override's too
    resumed = extra_file_job(Impl_trainbus(), tmp_path / "full", resume=str(tmp_path / "full" / "checkpoint-2"))
    for (name, a), b in zip(full["trainer"].model.state_dict().items(), resumed["trainer"].model.state_dict().values()):
        assert torch.equal(a, b), name


def Impl_trainbus() -> Impl:
    from tests.differential.hf_diff import implementation

    return implementation("trainbus")


def partial_weights_job(impl: Impl, out: Path, *, own_file: bool, resume: str | None = None) -> dict[str, Any]:
    """What community ``_save`` overrides do: save only some weights (``own_file``: into a file of their own,
    no super(); else super() with the state_dict they choose)."""

    class OnlyA(impl.Trainer):  # type: ignore[misc,name-defined]
        def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
            output_dir = output_dir or self.args.output_dir
            only_a = {"a": self.model.a.detach().clone()}
            if own_file:
                os.makedirs(output_dir, exist_ok=True)
                save_file(only_a, os.path.join(output_dir, "head.safetensors"))
            else:
                super()._save(output_dir, state_dict=only_a)

    trainer = regression_trainer(replace(impl, Trainer=OnlyA), out, model=RegressionModel(), **STEPS)
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    return {"trainer": trainer, "out": out}


@pytest.mark.parametrize("own_file", [False, True], ids=["super-with-a-state-dict", "own-file-no-super"])
def test_an_override_saving_only_some_weights_owns_the_model_files_and_the_resume_stays_exact(
    tmp_path: Path, own_file: bool
) -> None:
    hf, tb = run_both(lambda impl, out: partial_weights_job(impl, out, own_file=own_file), tmp_path)
    weights = "head.safetensors" if own_file else "model.safetensors"
    for name in ("checkpoint-2", "checkpoint-4", "."):
        saved = [load_file(str(run["out"] / name / weights)) for run in (hf, tb)]
        assert set(saved[0]) == set(saved[1]) == {"a"}, name  # what the override chose, under both
        torch.testing.assert_close(saved[1]["a"], saved[0]["a"], rtol=1e-5, atol=1e-6)
        # transformers: no model.safetensors without super()
        assert os.path.exists(hf["out"] / name / "model.safetensors") == (not own_file)
        if name != ".":
            tb_files = set(os.listdir(tb["out"] / name))
            assert ("model.safetensors" in tb_files) == (not own_file), tb_files  # the model folder is the override's
            manifest = json.loads((tb["out"] / name / "manifest.json").read_text())
            assert manifest["weights"] == "trainbus_weights.safetensors"  # trainbus's resume weights beside them
            assert set(load_file(str(tb["out"] / name / "trainbus_weights.safetensors"))) == {"a", "b"}
    assert_same_weights(hf["trainer"].model, tb["trainer"].model)
    resumed = partial_weights_job(Impl_trainbus(), tb["out"], own_file=own_file, resume=str(tb["out"] / "checkpoint-2"))
    assert_same_weights(tb["trainer"].model, resumed["trainer"].model, rtol=0, atol=0)  # every weight, not only "a"


# -- _save_checkpoint -----------------------------------------------------------------------------------------
def save_checkpoint_job(impl: Impl, out: Path) -> dict[str, Any]:
    """``_save_checkpoint`` calling super() then adding a file to the checkpoint, as TRL-style subclasses do."""
    events: list[tuple[Any, ...]] = []

    class OnSave(impl.TrainerCallback):  # type: ignore[misc,name-defined]
        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            events.append(("on_save", state.global_step))

    class Adding(impl.Trainer):  # type: ignore[misc,name-defined]
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            events.append(("_save_checkpoint", self.state.global_step, model is self.model_wrapped, trial))
            super()._save_checkpoint(model, trial)
            folder = Path(self.args.output_dir, f"checkpoint-{self.state.global_step}")
            (folder / "after_super.txt").write_text(str(sorted(os.listdir(folder))))

    callbacks = {"callbacks": [OnSave()]}
    trainer = regression_trainer(replace(impl, Trainer=Adding), out, pretrained=True, trainer_kwargs=callbacks, **STEPS)
    trainer.train()
    return {"trainer": trainer, "events": events, "out": out}


def test_save_checkpoint_override_runs_at_each_save_before_on_save_and_its_super_writes(tmp_path: Path) -> None:
    hf, tb = run_both(save_checkpoint_job, tmp_path)
    assert tb["events"] == hf["events"] == [
        ("_save_checkpoint", 2, True, None), ("on_save", 2), ("_save_checkpoint", 4, True, None), ("on_save", 4),
    ]  # fmt: skip
    for name in ("checkpoint-2", "checkpoint-4"):
        for run in (hf, tb):
            listed = (run["out"] / name / "after_super.txt").read_text()
            assert "model.safetensors" in listed and "trainer_state.json" in listed  # super() had written it
    assert_same_logs(hf["trainer"].state.log_history, tb["trainer"].state.log_history)


# -- _load_from_checkpoint, _load_best_model, _issue_warnings_after_load, a model's load_state_dict -------------
class OwnLoad(RegressionPreTrainedModel):
    """A model with a load_state_dict of its own: it records how a Trainer loads weights into it."""

    loads: ClassVar[list[tuple[Any, ...]]] = []

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        OwnLoad.loads.append((sorted(state_dict), strict))
        return super().load_state_dict(state_dict, strict, assign)


def loading_job(impl: Impl, out: Path, *, resume: str | None = None) -> dict[str, Any]:
    calls: list[tuple[Any, ...]] = []

    class Loading(impl.Trainer):  # type: ignore[misc,name-defined]
        def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
            calls.append(("_load_from_checkpoint", where(resume_from_checkpoint, out), model))
            super()._load_from_checkpoint(resume_from_checkpoint, model)

        def _load_best_model(self) -> None:
            calls.append(("_load_best_model", where(self.state.best_model_checkpoint, out)))
            super()._load_best_model()

        def _issue_warnings_after_load(self, load_result: Any) -> None:
            calls.append(("_issue_warnings_after_load", list(load_result.missing_keys),
                          list(load_result.unexpected_keys)))  # fmt: skip
            super()._issue_warnings_after_load(load_result)

    from tests.differential.hf_diff import RegressionConfig

    OwnLoad.loads = []
    args = {**STEPS, "max_steps": 6, "eval_strategy": "steps", "eval_steps": 2, "load_best_model_at_end": True,
            "metric_for_best_model": "loss", "greater_is_better": False, "learning_rate": 0.5}  # fmt: skip
    model = OwnLoad(RegressionConfig(a=0.0, b=0.0))
    trainer = regression_trainer(replace(impl, Trainer=Loading), out, model=model, **args)
    trainer.train(resume_from_checkpoint=resume)
    return {"trainer": trainer, "calls": calls, "loads": list(OwnLoad.loads), "out": out}


def test_load_overrides_and_the_models_load_state_dict_run_on_resume_and_at_the_best_model(tmp_path: Path) -> None:
    def job(impl: Impl, out: Path) -> dict[str, Any]:
        loading_job(impl, out / "first")
        return loading_job(impl, out / "first", resume=str(out / "first" / "checkpoint-2"))

    hf, tb = run_both(job, tmp_path)
    assert tb["calls"] == hf["calls"], (hf["calls"], tb["calls"])
    best = hf["trainer"].state.best_model_checkpoint
    assert hf["calls"] == [
        ("_load_from_checkpoint", "checkpoint-2", None), ("_issue_warnings_after_load", [], []),
        ("_load_best_model", where(best, hf["out"])), ("_issue_warnings_after_load", [], []),
    ]  # fmt: skip
    assert tb["loads"] == hf["loads"] == [(["a", "b"], False)] * 2  # load_state_dict(state, False), as transformers
    assert_same_weights(hf["trainer"].model, tb["trainer"].model)


# -- trainer.state and trainer_state.json: transformers' TrainerState --------------------------------------------
def test_trainer_state_json_reads_with_transformers_and_trainer_state_is_one(tmp_path: Path) -> None:
    import dataclasses

    from transformers import TrainerState

    def job(impl: Impl, out: Path) -> Any:
        trainer = regression_trainer(impl, out, eval_strategy="steps", eval_steps=2, metric_for_best_model="loss",
                                     load_best_model_at_end=True, **STEPS)  # fmt: skip
        trainer.train()
        trainer.save_state()
        return trainer

    _, tb = run_both(job, tmp_path)
    assert isinstance(tb.state, TrainerState)
    hf_fields = {f.name for f in dataclasses.fields(TrainerState)}
    for folder in ("checkpoint-2", "checkpoint-4", "."):
        states = [TrainerState.load_from_json(str(tmp_path / name / folder / "trainer_state.json"))
                  for name in ("transformers", "trainbus")]  # fmt: skip
        got = [dataclasses.asdict(s) for s in states]
        assert set(json.loads((tmp_path / "trainbus" / folder / "trainer_state.json").read_text())) == hf_fields
        for key in hf_fields - {"log_history", "best_model_checkpoint"}:
            hf_value, tb_value = got[0][key], got[1][key]
            same = tb_value == pytest.approx(hf_value) if isinstance(hf_value, float) else tb_value == hf_value
            assert same, (folder, key, hf_value, tb_value)
        assert_same_logs(got[0]["log_history"], got[1]["log_history"])
        bests = [g["best_model_checkpoint"] for g in got]
        assert [b and os.path.basename(b) for b in bests] == [bests[0] and os.path.basename(bests[0])] * 2


def test_a_checkpoint_written_before_the_split_still_resumes(tmp_path: Path) -> None:
    """Checkpoints from before trainbus_state.json hold the engine's fields in trainer_state.json."""
    from trainbus.plugins.checkpoints import io as cio

    impl = Impl_trainbus()
    full = regression_trainer(impl, tmp_path, **STEPS)
    full.train()
    folder = tmp_path / "checkpoint-2"
    manifest = json.loads((folder / "manifest.json").read_text())
    state = json.loads((folder / "trainer_state.json").read_text())
    state.update(json.loads((folder / "trainbus_state.json").read_text())["state"])
    (folder / "trainer_state.json").write_text(json.dumps(state))
    (folder / "trainbus_state.json").unlink()
    del manifest["files"]["trainbus_state.json"]
    manifest["files"]["trainer_state.json"] = cio.file_entry(folder / "trainer_state.json")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    resumed = regression_trainer(impl, tmp_path, **STEPS)
    resumed.train(resume_from_checkpoint=str(folder))
    assert resumed.state.batches_in_epoch == full.state.batches_in_epoch
    assert_same_weights(full.model, resumed.model, rtol=0, atol=0)


# -- no model card without a push; adapter checkpoints -----------------------------------------------------------
def test_save_model_writes_no_model_card_as_transformers(tmp_path: Path) -> None:
    def job(impl: Impl, out: Path) -> set[str]:
        trainer = regression_trainer(impl, out, pretrained=True, max_steps=2, save_strategy="no")
        trainer.train()
        trainer.save_model()
        return set(os.listdir(out))

    hf, tb = run_both(job, tmp_path)
    assert "README.md" not in hf and "README.md" not in tb, (hf, tb)
    assert {"model.safetensors", "config.json"} <= hf & tb


def lora_job(impl: Impl, out: Path, resume: str | None = None) -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)  # fmt: skip
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    ids = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(1))
    args = impl.args(out, per_device_train_batch_size=4, **STEPS)
    trainer = impl.Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_an_adapter_checkpoint_holds_no_model_safetensors_and_resumes_exactly(tmp_path: Path) -> None:
    hf, tb = run_both(lora_job, tmp_path)
    for name in ("checkpoint-2", "checkpoint-4"):
        for impl in ("transformers", "trainbus"):
            files = set(os.listdir(tmp_path / impl / name))
            assert "adapter_model.safetensors" in files and "model.safetensors" not in files, (impl, files)
    resumed = lora_job(Impl_trainbus(), tmp_path / "trainbus", str(tmp_path / "trainbus" / "checkpoint-2"))
    assert_same_weights(tb.model, resumed.model, rtol=0, atol=0)
    assert_same_weights(hf.model, tb.model)
