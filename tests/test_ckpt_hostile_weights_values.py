"""Values a checkpoint restores that a run cannot have written, or should not train on (issue 37, item 7).

A rehashed ``epochs_completed=10**9`` was taken (an integer in range): the resumed run "finished" its
epochs without a step. A checkpoint whose weights hold NaN (a run that diverged) was resumed and trained
on NaN without a word. Decided: non-finite weights are refused like damage (NaN anywhere, an infinity in
a parameter; a buffer may hold -inf, an attention mask does): ``resume(engine, True)`` warns and resumes
the checkpoint before, a path is refused naming the tensors; ``TRAINBUS_ALLOW_NONFINITE_WEIGHTS=1`` loads
them anyway, with a warning.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.ckpt_hostile_helpers import make_engine, rehash, rewrite_json, same_weights, weights
from trainbus.engine import ConfigError
from trainbus.plugins.checkpoints.checkpoint import resume
from trainbus.plugins.checkpoints.history import OWN_STATE
from trainbus.plugins.checkpoints.weights import NONFINITE_OPT_IN, check_finite


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights") / "run"
    make_engine(root, max_steps=4).fit()  # checkpoints 2 and 4
    return root


@pytest.fixture
def run(template: Path, tmp_path: Path) -> Path:
    shutil.copytree(template, tmp_path / "run")
    return tmp_path / "run"


def poison(directory: Path, name: str = "0.weight", value: float = float("nan")) -> None:
    """One value of one tensor replaced, the file rewritten and rehashed: a consistent checkpoint."""
    path = directory / "model.safetensors"
    tensors = weights(directory)
    tensors[name].view(-1)[1] = value
    path.unlink()
    save_file(tensors, str(path))
    rehash(directory, "model.safetensors")


def test_resume_true_falls_back_past_nan_weights(run: Path) -> None:
    poison(run / "checkpoint-4")
    fresh = make_engine(run, max_steps=6)
    with pytest.warns(UserWarning, match=r"skipping the damaged checkpoint .*checkpoint-4 .*'0\.weight': 1 NaN"):
        assert resume(fresh, True) == run / "checkpoint-2"
    assert fresh.state.global_step == 2 and same_weights(fresh.model, run / "checkpoint-2")


def test_a_checkpoint_with_nan_weights_is_refused_naming_them(run: Path) -> None:
    poison(run / "checkpoint-4")
    fresh = make_engine(run, max_steps=6)
    with pytest.raises(ConfigError, match=r"non-finite weights .*'0\.weight': 1 NaN, 0 infinite of 12.*diverged"):
        resume(fresh, run / "checkpoint-4")
    assert not any(torch.isnan(p).any() for p in fresh.model.parameters())


def test_the_opt_in_loads_them_with_a_warning(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    poison(run / "checkpoint-4", value=float("inf"))
    monkeypatch.setenv(NONFINITE_OPT_IN, "1")
    fresh = make_engine(run, max_steps=6)
    with pytest.warns(UserWarning, match=rf"'0\.weight': 0 NaN, 1 infinite of 12.*{NONFINITE_OPT_IN}=1"):
        resume(fresh, run / "checkpoint-4")
    assert fresh.state.global_step == 4 and torch.isinf(fresh.model[0].weight).sum() == 1


def test_a_buffer_may_hold_minus_infinity_never_nan() -> None:
    model = torch.nn.Linear(2, 2)
    model.register_buffer("mask", torch.full((2, 2), float("-inf")).triu(1))
    state = {**model.state_dict(), "mask": model.mask.clone()}
    check_finite(state, "here", model.state_dict(keep_vars=True))  # a causal mask: taken
    state["mask"][0, 0] = float("nan")
    with pytest.raises(ConfigError, match=r"'mask': 1 NaN, 0 infinite of 4"):
        check_finite(state, "here", model.state_dict(keep_vars=True))
    state = {**model.state_dict(), "weight": torch.full((2, 2), float("inf"))}
    with pytest.raises(ConfigError, match=r"'weight': 0 NaN, 4 infinite of 4"):
        check_finite(state, "here", model.state_dict(keep_vars=True))
    big = {
        "weight": torch.full((2, 2), 3e38),
        "bias": torch.zeros(2, dtype=torch.bfloat16),
    }  # finite, sum overflows fp32
    check_finite(big, "here", model.state_dict(keep_vars=True))
    half = {"weight": torch.full((2, 2), 6e4, dtype=torch.float16)}  # its float16 sum overflows: values decide
    check_finite(half, "here", model.state_dict(keep_vars=True))


def test_epochs_completed_beyond_the_run_falls_back(run: Path) -> None:
    """Every epoch holds at least one micro-batch: epochs_completed <= micro_steps, as batches_in_epoch is."""
    newest = run / "checkpoint-4"
    rewrite_json(newest, OWN_STATE, lambda document: document["state"].update(epochs_completed=10**9))
    fresh = make_engine(run, max_steps=6)
    with pytest.warns(UserWarning, match=r"skipping the damaged checkpoint .*checkpoint-4 .*epochs_completed"):
        assert resume(fresh, True) == run / "checkpoint-2"
    fresh.fit()
    assert fresh.state.global_step == 6
