"""Weights declared with another dtype (int32 header over float32 bytes, a consistent manifest) are damage.

An explicit checkpoint is refused naming the tensor and both dtypes (tests/test_one_pass_resume.py); a
resume of True skips such a checkpoint with a warning and resumes the one before, as for any damage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.ckpt_hostile_helpers import make_engine, rehash
from trainbus.plugins.checkpoints.checkpoint import resume


def _declare_as_int32(path: Path, name: str) -> None:
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    header[name]["dtype"] = "I32"  # the same size as float32: the bytes stay, their meaning changes
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
