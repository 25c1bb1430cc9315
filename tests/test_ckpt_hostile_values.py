"""Every value a checkpoint restores is checked before anything is applied, with a fallback (#29 item 7).

A trainer state rewritten (and rehashed in its manifest, so that the hashes agree) with a value of the
wrong type or out of range used to be applied as it was: ``global_step`` 1e30 "finished" without
training, -7 trained 77 steps, 60.5 wrote ``checkpoint-70.5``, a string or a negative
``batches_in_epoch`` failed with a raw error and no fallback. Now each is damage naming the field:
``resume_from_checkpoint=True`` warns and resumes from the checkpoint before; a path fails clearly.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ckpt_hostile_helpers import make_engine, rewrite_json, same_weights
from trainbus.plugins.checkpoints import io as cio
from trainbus.plugins.checkpoints.checkpoint import resume
from trainbus.plugins.checkpoints.history import HF_STATE_FIELDS, OWN_STATE
from trainbus.plugins.checkpoints.safety import DamagedCheckpoint


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("values") / "run"
    make_engine(root, max_steps=4).fit()
    return root


@pytest.fixture
def run(template: Path, tmp_path: Path) -> Path:
    shutil.copytree(template, tmp_path / "run")
    return tmp_path / "run"


def set_field(name: str, value: Any) -> Any:
    def change(state: dict[str, Any]) -> None:
        state[name] = value

    return change


#: (field, hostile value): each written into checkpoint-4's trainer_state.json (global_step into the manifest too),
#: or, for the engine's own fields (not transformers' TrainerState's), into its trainbus_state.json
BAD_STATE = [
    ("global_step", 1e30),
    ("global_step", -7),
    ("global_step", 60.5),
    ("global_step", "4"),
    ("global_step", True),
    ("global_step", 2**70),
    ("global_step", None),
    ("batches_in_epoch", "2"),
    ("batches_in_epoch", -1),
    ("batches_in_epoch", 10**6),  # more micro-batches in the epoch than in the whole run
    ("epoch", -0.5),
    ("epoch", "x"),
    ("epoch", {"__float__": "NaN"}),
    ("epoch", {"__float__": "Infinity"}),
    ("epochs_completed", -1),
    ("epoch_step", 99),  # more optimizer steps in the epoch than in the run
    ("optimizer_steps_taken", 5),
    ("micro_steps", [2]),
    ("max_steps", -1),
    ("num_train_epochs", "1"),
    ("steps_per_epoch", 0),
    ("train_batch_size", 0),
    ("eval_steps", -5),
    ("logging_steps", 1.5),
    ("num_input_tokens_seen", -3),
    ("total_flos", "big"),
    ("best_global_step", 9),  # after the checkpoint's own step
    ("best_metric", "good"),
    ("best_model_checkpoint", 7),
    ("is_world_process_zero", "yes"),
    ("trial_name", 3),
    ("trial_params", [1]),
    ("stateful_callbacks", None),
    ("event_counts", {"SAVE": -1}),
    ("event_counts", ["SAVE"]),
    ("log_history", {"loss": 1}),
    ("log_history", [1, 2]),
]


@pytest.mark.parametrize(("field", "value"), BAD_STATE, ids=[f"{f}={v!r}"[:40] for f, v in BAD_STATE])
def test_a_bad_state_value_falls_back_to_the_checkpoint_before(run: Path, field: str, value: Any) -> None:
    newest = run / "checkpoint-4"
    if field in HF_STATE_FIELDS:
        name = "trainer_state.json"
        rewrite_json(newest, name, set_field(field, value))
    else:
        name = OWN_STATE
        rewrite_json(newest, name, lambda document: set_field(field, value)(document["state"]))
    if field == "global_step":  # a consistent forgery: the manifest says the same
        manifest = json.loads((newest / cio.MANIFEST).read_text())
        manifest["global_step"] = value
        (newest / cio.MANIFEST).write_text(json.dumps(manifest))
    fresh = make_engine(run, max_steps=6)
    with pytest.warns(UserWarning, match=rf"skipping the damaged checkpoint .*checkpoint-4 .*{field}"):
        assert resume(fresh, True) == run / "checkpoint-2"
    assert fresh.state.global_step == 2 and same_weights(fresh.model, run / "checkpoint-2")
    with pytest.raises(DamagedCheckpoint, match=rf"{name}.*{field}"):
        resume(make_engine(run, max_steps=6), newest)
    fresh.fit()
    assert fresh.state.global_step == 6


def test_the_manifest_and_the_state_must_agree_on_the_step(run: Path) -> None:
    newest = run / "checkpoint-4"
    manifest = json.loads((newest / cio.MANIFEST).read_text())
    manifest["global_step"] = 3
    (newest / cio.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DamagedCheckpoint, match=r"global_step 4 .*manifest.*3"):
        resume(make_engine(run, max_steps=6), newest)


def test_sound_edge_values_still_resume(run: Path) -> None:
    """What a real run can write: ints as epoch, a NaN best metric, a float num_train_epochs (HF's type)."""
    newest = run / "checkpoint-4"

    def change(state: dict[str, Any]) -> None:
        state.update(epoch=1, best_metric={"__float__": "NaN"}, num_train_epochs=2.5, best_global_step=4)

    rewrite_json(newest, "trainer_state.json", change)
    fresh = make_engine(run, max_steps=6)
    resume(fresh, newest)
    assert fresh.state.epoch == 1 and math.isnan(fresh.state.best_metric or 0.0)


BAD_RNG = {
    "python state": lambda rng: rng["data"].update(python={"__tuple__": [3, "x", None]}),
    "torch state": lambda rng: rng["data"].update(torch=[1, 2, 3]),
    "numpy state": lambda rng: rng["data"].update(numpy={"__tuple__": ["MT19937", [1, 2], 0, 0, 0.0]}),
    "CUDA states": lambda rng: rng["data"].update(cuda=["not a tensor"]),
}


@pytest.mark.parametrize("kind", sorted(BAD_RNG))
def test_rng_states_that_cannot_be_set_fall_back(run: Path, kind: str) -> None:
    newest = run / "checkpoint-4"
    rewrite_json(newest, "rng.json", BAD_RNG[kind])
    fresh = make_engine(run, max_steps=6)
    with pytest.warns(UserWarning, match=r"skipping the damaged checkpoint .*checkpoint-4 .*RNG states"):
        assert resume(fresh, True) == run / "checkpoint-2"
    assert fresh.state.global_step == 2
    checked = cio.read_bundle(run / "checkpoint-2", "rng")
    assert torch.equal(torch.get_rng_state(), checked["torch"])  # checkpoint-2's states, not the forged ones
