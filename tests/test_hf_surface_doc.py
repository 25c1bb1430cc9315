"""docs/hf_surface.md stays true: what it calls supported exists, what it calls unsupported fails clearly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.facade_helpers import Regressor, quiet_args, regression_data
from trainbus.engine import ConfigError
from trainbus.plugins import Trainer

DOC = Path(__file__).resolve().parents[1] / "docs" / "hf_surface.md"
ROW = re.compile(r"^\| `(?P<name>[A-Za-z_]+)` \| (?P<status>yes|no) \|", re.MULTILINE)


def _section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def _rows() -> list[tuple[str, str]]:
    rows = [(m["name"], m["status"]) for m in ROW.finditer(_section("Methods"))]
    assert len(rows) > 40, "the method table was not found"
    return rows


#: the public methods of HF's Trainer method index (the seeds' 004 document) and trainer_pt_utils' helpers
HF_METHODS = """
__init__ create_accelerator_and_postprocess tokenizer get_train_dataloader get_eval_dataloader get_test_dataloader
create_optimizer create_scheduler create_optimizer_and_scheduler get_optimizer_cls_and_kwargs
get_decay_parameter_names get_num_trainable_parameters get_learning_rates get_optimizer_group num_examples
num_tokens train training_step compute_loss get_total_train_batch_size get_tp_size set_initial_training_values
get_batch_samples evaluate predict evaluation_loop prediction_loop prediction_step save_model add_callback
remove_callback pop_callback hyperparameter_search is_local_process_zero is_world_process_zero log
floating_point_ops store_flos torch_jit_model_eval autocast_smart_context_manager compute_loss_context_manager
create_model_card push_to_hub init_hf_repo log_metrics save_metrics save_state metrics_format
""".split()  # noqa: SIM905  (one name per word reads better here)


def test_every_public_method_of_the_index_is_in_the_table() -> None:
    listed = [name for name, _ in _rows()]
    assert sorted(listed) == sorted(set(listed)), "a method is listed twice"
    assert set(HF_METHODS) == set(listed), f"not in the table: {sorted(set(HF_METHODS) - set(listed))}"


@pytest.mark.parametrize(("name", "status"), _rows())
def test_the_table_says_what_the_trainer_does(name: str, status: str, tmp_path: Path) -> None:
    if status == "yes":
        assert hasattr(Trainer, name), f"docs/hf_surface.md says Trainer.{name} exists"
        return
    if not hasattr(Trainer, name):
        return
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=1), train_dataset=regression_data(4))
    with pytest.raises(ConfigError):
        getattr(trainer, name)()


ARG_ROW = re.compile(r"^\| `(?P<name>[a-z_0-9]+)` \| (?P<status>yes|refused) \|", re.MULTILINE)


def test_the_arguments_table_lists_every_hf_field_with_what_trainbus_does() -> None:
    import dataclasses

    transformers = pytest.importorskip("transformers")
    from trainbus.plugins.facade.arguments import UNSUPPORTED, TrainingArguments

    rows = {m["name"]: m["status"] for m in ARG_ROW.finditer(_section("TrainingArguments"))}
    hf = [f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init]
    ours = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(rows) == set(hf), f"rows missing: {sorted(set(hf) - set(rows))}; extra: {sorted(set(rows) - set(hf))}"
    for name in hf:
        expected = "yes" if name in ours else "refused"
        assert rows[name] == expected, f"docs/hf_surface.md says {name}: {rows[name]}, the code does {expected}"
        if expected == "refused":
            default = UNSUPPORTED[name][0]
            TrainingArguments("out", **{name: default})  # the default is accepted


def test_the_readme_counts_match_the_tables() -> None:
    import dataclasses

    transformers = pytest.importorskip("transformers")
    from trainbus.plugins.facade.arguments import TrainingArguments

    readme = (DOC.parents[1] / "README.md").read_text(encoding="utf-8")
    hf = [f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.init]
    ours = {f.name for f in dataclasses.fields(TrainingArguments)}
    supported = sum(name in ours for name in hf)
    assert f"{supported} of transformers 5's {len(hf)} fields" in readme
    assert f"the other {len(hf) - supported} " in readme
    methods = _rows()
    assert f"{sum(s == 'yes' for _, s in methods)} of the {len(methods)} public methods" in readme


def test_every_subclass_surface_row_names_a_test_that_exists() -> None:
    """docs/hf_surface.md's subclass surface: each row's test is a real test function in the named file."""
    section = _section("The subclass surface")
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    assert len(rows) >= 15
    tests_dir = DOC.parents[1] / "tests"
    default = tests_dir / "differential" / "test_diff_subclass_surface.py"
    for row in rows:
        cell = row.rstrip(" |").rsplit("|", 1)[-1]
        for name in re.findall(r"`([\w./]+)`", cell):
            if name.endswith(".py"):
                assert (tests_dir / name).is_file(), f"{row}: no tests/{name}"
            else:
                assert f"def {name}(" in default.read_text(encoding="utf-8"), f"{row}: no test {name}"


def test_internal_attributes_a_copied_body_reads(tmp_path: Path) -> None:
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=1), train_dataset=regression_data(4))
    trainer.train()
    assert trainer._signature_columns[:1] == ["x"]
    assert trainer._get_learning_rate() == trainer.optimizer.param_groups[0]["lr"]
    context, inputs = trainer._prepare_context_parallel_inputs(trainer.model, {"x": 1})
    with context():
        assert inputs == {"x": 1}
    assert (trainer.is_deepspeed_enabled, trainer.is_fsdp_enabled, trainer.use_apex) == (False, False, False)
    assert (trainer.is_model_parallel, trainer.place_model_on_device) == (False, True)
