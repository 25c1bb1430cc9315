"""Weights declared with another dtype (int32 header over float32 bytes, a consistent manifest) are damage.

An explicit checkpoint is refused naming the tensor and both dtypes (tests/test_one_pass_resume.py); a
resume of True skips such a checkpoint with a warning and resumes the one before, as for any damage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.ckpt_hostile_helpers import make_engine, rehash
from trainbus.engine import ConfigError
from trainbus.plugins.checkpoints.checkpoint import resume
from trainbus.plugins.checkpoints.safety import DamagedCheckpoint


def _declare_as_int32(path: Path, name: str, dtype: str = "I32", shape: list[int] | None = None) -> None:
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header[name]["dtype"] = dtype  # I32: the same size as float32: the bytes stay, their meaning changes
    if shape is not None:
        header[name]["shape"] = shape
    text = json.dumps(header, separators=(",", ":")).encode()
    path.unlink()  # a file of its own, whatever links the checkpoints share
    path.write_bytes(data[:8] + text + b" " * (length - len(text)) + data[8 + length :])


def test_resume_true_falls_back_past_weights_of_another_dtype(tmp_path: Path) -> None:
    make_engine(tmp_path).fit()  # checkpoints at steps 2, 4 and 6
    newest = tmp_path / "checkpoint-6"
    _declare_as_int32(newest / "model.safetensors", "0.weight")
    rehash(newest, "model.safetensors")
    engine = make_engine(tmp_path, 8)
    with pytest.warns(UserWarning, match=r"checkpoint-6.*'0\.weight', 'int32', 'float32'"):
        resume(engine, True)
    assert engine.state.global_step == 4


def _declare_as_float16(path: Path, name: str) -> None:
    """float16 over a float32 (4, 3) weight's 48 bytes: a (4, 6) tensor, so the header is consistent."""
    _declare_as_int32(path, name, "F16", [4, 6])


def test_resume_true_falls_back_past_a_float16_header_over_float32_bytes(tmp_path: Path) -> None:
    """#37 item 7: a float16 header with the shape that fills a float32 weight's bytes failed "does not fit the
    model" (the shapes differ) as a ConfigError, so resume(True) stopped there instead of falling back."""
    make_engine(tmp_path).fit()
    newest = tmp_path / "checkpoint-6"
    _declare_as_float16(newest / "model.safetensors", "0.weight")
    rehash(newest, "model.safetensors")
    engine = make_engine(tmp_path, 8)
    with pytest.warns(UserWarning, match=r"checkpoint-6.*'0\.weight', 'float16', 'float32'.*\(4, 6\), \(4, 3\)"):
        resume(engine, True)
    assert engine.state.global_step == 4
    explicit = make_engine(tmp_path, 8)
    with pytest.raises(DamagedCheckpoint, match=r"'0\.weight', 'float16', 'float32'"):
        resume(explicit, newest)
    assert explicit.state.global_step == 0


def test_another_model_still_does_not_fit_by_its_shapes(tmp_path: Path) -> None:
    """The rule is narrow: another shape of the same dtype, or bytes that differ, is another model, not damage."""
    make_engine(tmp_path).fit()
    engine = make_engine(tmp_path, 8)
    engine.model[0] = torch.nn.Linear(3, 5)  # (5, 3): 60 bytes, not the saved 48
    engine.model[2] = torch.nn.Linear(5, 1)
    with pytest.raises(ConfigError, match=r"does not fit the model: \(name, saved shape, model shape\)"):
        resume(engine, tmp_path / "checkpoint-6")
