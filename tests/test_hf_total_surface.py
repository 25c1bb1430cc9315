"""The port is total: every method and attribute of the installed transformers' Trainer is classified.

The names come from the installed release (CI runs this file on the newest transformers, 5.0 and the oldest
setup.cfg allows), so a release that adds a method fails here until it is classified in
``plugins/facade/hf_names.py``, never silently in a user's subclass:

- a HONOURED method exists with transformers' parameters, and a subclass's override of it is called in the
  same phases (construction, train, a resumed train, evaluate, predict, save_model) as many times as
  transformers calls it: the same recording subclass runs under both;
- an OFFERED method exists, and transformers itself never calls it in those phases;
- a REFUSED method overridden by a subclass is a ConfigError when the Trainer is built, naming the method
  and what to use; called where trainbus has no such method, it raises the same advice;
- every attribute a constructed transformers Trainer has, trainbus's has too, with the same value where
  the value is a plain one.
"""

from __future__ import annotations

import collections
import inspect
import types
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from trainbus.engine import ConfigError  # noqa: E402
from trainbus.plugins import Seq2SeqTrainer, Trainer, TrainingArguments  # noqa: E402
from trainbus.plugins.facade.hf_names import HONOURED, OFFERED, REFUSED, classification  # noqa: E402


def hf_methods() -> dict[str, Any]:
    """Every method and property transformers' Trainer and Seq2SeqTrainer define (not inherited from object)."""
    found: dict[str, Any] = {}
    for cls in (transformers.Trainer, transformers.Seq2SeqTrainer):
        for klass in cls.__mro__:
            if not klass.__module__.startswith("transformers"):
                continue
            for name, value in vars(klass).items():
                if name.startswith("__") and name != "__init__":
                    continue
                if inspect.isfunction(value) or isinstance(value, staticmethod | classmethod | property):
                    found.setdefault(name, value)
    return found


def test_the_tables_do_not_overlap() -> None:
    assert not set(HONOURED) & set(OFFERED)
    assert not set(HONOURED) & set(REFUSED)
    assert not set(OFFERED) & set(REFUSED)


def test_every_method_of_the_installed_release_is_classified() -> None:
    missing = sorted(name for name in hf_methods() if classification(name) is None)
    assert not missing, (
        f"transformers {transformers.__version__} has Trainer methods trainbus has not classified: {missing}; "
        "add each to HONOURED, OFFERED or REFUSED in plugins/facade/hf_names.py"
    )


def _parameters(fn: Any) -> tuple[set[str], bool]:
    fn = fn.fget if isinstance(fn, property) else getattr(fn, "__func__", fn)
    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}, any(
        p.kind is p.VAR_KEYWORD for p in params
    )


@pytest.mark.parametrize("name", sorted(n for n in hf_methods() if n in HONOURED or n in OFFERED))
def test_a_supported_method_takes_transformers_parameters(name: str) -> None:
    hf = hf_methods()[name]
    owner = (
        Seq2SeqTrainer
        if name in vars(transformers.Seq2SeqTrainer) and name not in vars(transformers.Trainer)
        else Trainer
    )
    ours = inspect.getattr_static(owner, name)
    if isinstance(hf, property) or isinstance(ours, property):
        assert isinstance(hf, property) == isinstance(ours, property), f"{name}: property on one side only"
        return
    theirs, _ = _parameters(hf)
    mine, takes_any = _parameters(ours)
    assert takes_any or theirs <= mine, f"Trainer.{name} lacks transformers' parameters {sorted(theirs - mine)}"


# -- the recorded differential: which overrides run, where, how often ---------------------------------------


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.lin(x).squeeze(-1)
        return {"logits": out} if labels is None else {"loss": ((out - labels) ** 2).mean(), "logits": out}


def _data(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    xs = torch.randn(n, 2, generator=g)
    return [{"x": x, "labels": x.sum() * 0.5} for x in xs]


def _recording_subclass(base: type, names: list[str], calls: collections.Counter[str]) -> type:
    def recorder(name: str) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return getattr(super(subclass, self), name)(*args, **kwargs)

        return method

    namespace = {name: recorder(name) for name in names}
    subclass = type("Recording", (base,), namespace)
    return subclass


def _recorded_phases(trainer_cls: type, args_cls: type, out: Path, names: list[str]) -> dict[str, dict[str, int]]:
    calls: collections.Counter[str] = collections.Counter()
    cls = _recording_subclass(trainer_cls, names, calls)
    data = _data(16)

    def args(folder: Path) -> Any:
        return args_cls(
            str(folder),
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            max_steps=6,
            eval_strategy="steps",
            eval_steps=2,
            save_steps=2,
            load_best_model_at_end=True,
            logging_steps=1,
            gradient_accumulation_steps=2,
            per_device_train_batch_size=2,
        )

    phases: dict[str, dict[str, int]] = {}

    def phase(label: str) -> None:
        phases[label] = dict(calls)
        calls.clear()

    torch.manual_seed(0)
    trainer = cls(Regressor(), args(out / "run"), train_dataset=data, eval_dataset=data[:8])
    phase("construction")
    trainer.train()
    phase("train")
    again = cls(Regressor(), args(out / "run"), train_dataset=data, eval_dataset=data[:8])
    calls.clear()
    again.train(resume_from_checkpoint=str(out / "run" / "checkpoint-4"))
    phase("resumed train")
    trainer.evaluate()
    phase("evaluate")
    trainer.predict(data[:4])
    phase("predict")
    trainer.save_model(str(out / "final"))
    phase("save_model")
    return phases


#: where trainbus deliberately calls an override a different number of times than the installed transformers
CALL_DIFFERENCES = {
    # transformers 5 calls create_optimizer() and create_scheduler() from train() directly; trainbus calls
    # create_optimizer_and_scheduler() when it or create_scheduler is overridden (transformers 4's order),
    # so an override of it runs under both majors
    "create_optimizer_and_scheduler",
}


#: overrides trainbus calls once more than transformers in the resumed train: the run resumes from checkpoint-4,
#: the last step of the first epoch, and trainbus's resumed run closes that epoch (EPOCH_END: on_epoch_end, and
#: the epoch's _maybe_log_save_evaluate) as the interrupted run would have, where transformers starts the next
#: epoch; so interrupted + resumed calls it as often as the uninterrupted run does
RESUMED_EPOCH_TAIL = {"_maybe_log_save_evaluate"}


HONOURED_HERE = sorted(
    n for n in hf_methods() if n in HONOURED and n != "__init__" and hasattr(transformers.Trainer, n)
)


@pytest.mark.parametrize("name", HONOURED_HERE)
def test_an_honoured_override_runs_where_transformers_runs_it(name: str, tmp_path: Path) -> None:
    """A subclass overriding just this method: its calls per phase, under transformers and trainbus."""
    hf = _recorded_phases(transformers.Trainer, transformers.TrainingArguments, tmp_path / "hf", [name])
    ours = _recorded_phases(Trainer, TrainingArguments, tmp_path / "tb", [name])
    if name in CALL_DIFFERENCES:
        assert any(ours.values()), f"trainbus never called the {name} override"
        return
    if name in RESUMED_EPOCH_TAIL:
        hf["resumed train"] = {name: hf["resumed train"].get(name, 0) + 1}
    assert ours == hf, f"{name} override calls per phase: transformers {hf}, trainbus {ours}"


def test_offered_methods_are_never_called_by_transformers_itself(tmp_path: Path) -> None:
    names = sorted(n for n in hf_methods() if n in OFFERED and hasattr(transformers.Trainer, n))
    hf = _recorded_phases(transformers.Trainer, transformers.TrainingArguments, tmp_path / "hf", names)
    ours = _recorded_phases(Trainer, TrainingArguments, tmp_path / "tb", names)
    called = {f"{phase}: {name}" for phase in hf for name in hf[phase]}
    assert not called, f"transformers calls these itself: they must be HONOURED or REFUSED: {sorted(called)}"
    called_by_us = {f"{phase}: {name}" for phase in ours for name in ours[phase]}
    assert not called_by_us, f"trainbus calls these itself: {sorted(called_by_us)}"


# -- refused overrides fail when the Trainer is built ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_override_is_an_error_naming_it(name: str, tmp_path: Path) -> None:
    subclass = type("MyTrainer", (Trainer,), {name: lambda self, *a, **k: None})
    args = TrainingArguments(str(tmp_path), report_to="none", use_cpu=True, max_steps=1)
    with pytest.raises(ConfigError) as error:
        subclass(Regressor(), args, train_dataset=_data(4))
    assert f"MyTrainer.{name}" in str(error.value) and REFUSED[name].split(" (")[0][:30] in str(error.value)


def test_a_refused_override_deeper_in_the_hierarchy_is_found(tmp_path: Path) -> None:
    class Base(Trainer):
        def _run_epoch(self, *args: Any, **kwargs: Any) -> None:
            return None

    class Leaf(Base):
        pass

    args = TrainingArguments(str(tmp_path), report_to="none", use_cpu=True, max_steps=1)
    with pytest.raises(ConfigError, match=r"Base\._run_epoch: use the engine's loop"):
        Leaf(Regressor(), args, train_dataset=_data(4))


@pytest.mark.parametrize(
    "name", sorted(n for n in REFUSED if n not in vars(Trainer) and not hasattr(Trainer.__mro__[1], n))
)
def test_calling_a_refused_method_trainbus_lacks_says_what_to_use(name: str, tmp_path: Path) -> None:
    from trainbus.plugins.facade import hf_names

    if getattr(Trainer, name) is not None and getattr(getattr(Trainer, name), "__module__", "") != hf_names.__name__:
        return  # trainbus has a method of this name (a mixin's): it is callable, only its override is refused
    args = TrainingArguments(str(tmp_path), report_to="none", use_cpu=True, max_steps=1)
    trainer = Trainer(Regressor(), args, train_dataset=_data(4))
    with pytest.raises(ConfigError, match=f"Trainer.{name} is not part of trainbus's Trainer: use "):
        getattr(trainer, name)()


# -- attributes -------------------------------------------------------------------------------------------------

PLAIN = (bool, int, float, str, type(None))


class ConfiguredRegressor(Regressor):
    """transformers reads ``model.config.problem_type`` when label smoothing is on."""

    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(problem_type=None, use_cache=False)


def _constructed(tmp_path: Path, **extra: Any) -> tuple[Any, Any]:
    kwargs = {"report_to": "none", "use_cpu": True, "max_steps": 1, **extra}
    model = ConfiguredRegressor if extra else Regressor
    hf = transformers.Trainer(
        model(), transformers.TrainingArguments(str(tmp_path / "hf"), **kwargs), train_dataset=_data(4)
    )
    ours = Trainer(model(), TrainingArguments(str(tmp_path / "tb"), **kwargs), train_dataset=_data(4))
    return hf, ours


#: attributes whose plain value differs on purpose, with the reason
VALUE_DIFFERENCES = {
    # "off": transformers 4.57 and 5.0 set False when the Trainer is built, 5.24 leaves None until train()
    "is_fsdp_xla_enabled",
    "is_fsdp_xla_v1_enabled",
    "is_fsdp_xla_v2_enabled",
}


def test_every_attribute_of_a_constructed_trainer_is_there_with_transformers_value(tmp_path: Path) -> None:
    hf, ours = _constructed(tmp_path)
    missing = sorted(name for name in vars(hf) if not hasattr(ours, name))
    assert not missing, f"a constructed transformers Trainer has these, trainbus's does not: {missing}"
    differing = {}
    for name, value in vars(hf).items():
        mine = getattr(ours, name)
        if isinstance(value, PLAIN) and name not in VALUE_DIFFERENCES and mine != value:
            differing[name] = (value, mine)
    assert not differing, f"(transformers, trainbus) values differ: {differing}"


def test_label_smoother_is_transformers_loss(tmp_path: Path) -> None:
    hf, ours = _constructed(tmp_path, label_smoothing_factor=0.1)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 7, generator=g)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[0, :2] = -100
    takes_count = "num_items_in_batch" in inspect.signature(type(hf.label_smoother).__call__).parameters
    cases = [{}, {"shift_labels": True}, {"num_items_in_batch": 9}, {"shift_labels": True, "num_items_in_batch": 11}]
    for kwargs in cases if takes_count else cases[:2]:
        expected = hf.label_smoother({"logits": logits}, labels, **kwargs)
        torch.testing.assert_close(ours.label_smoother({"logits": logits}, labels, **kwargs), expected)


def test_the_classification_is_in_the_docs() -> None:
    from trainbus.plugins.facade.hf_names import markdown_table

    doc = (Path(__file__).resolve().parents[1] / "docs" / "hf_surface.md").read_text(encoding="utf-8")
    start = doc.index("<!-- generated: python -m trainbus.plugins.facade.hf_names -->\n")
    shown = doc[doc.index("\n", start) + 1 : doc.index("<!-- end generated -->")]
    assert shown == markdown_table(), "docs/hf_surface.md is stale: python -m trainbus.plugins.facade.hf_names"


@pytest.mark.parametrize("name", ["save_model", "_save", "_load_from_checkpoint"])
def test_a_checkpoint_override_under_sharding_is_refused(name: str, tmp_path: Path) -> None:
    """FSDP writes its sharded checkpoints itself: a checkpoint override would not run there, so it is an error."""
    subclass = type("ShardedTrainer", (Trainer,), {name: lambda self, *a, **k: None})
    args = TrainingArguments(str(tmp_path), report_to="none", use_cpu=True, max_steps=1, fsdp="full_shard")
    with pytest.raises(ConfigError, match=f"ShardedTrainer.{name}: with fsdp"):
        subclass(Regressor(), args, train_dataset=_data(4))
