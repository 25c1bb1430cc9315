"""The README's GAN (#35 item 2) runs as written and resumes mid-epoch bit for bit: weights, optimizers, schedules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_readme import readme_blocks


def gan_block() -> str:
    blocks = [block for block in readme_blocks() if "def gan_step(" in block]
    assert len(blocks) == 1, "the README has one GAN example"
    return blocks[0]


def test_the_readme_gan_resumes_mid_epoch_bit_exact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "readme_gan"}
    exec(compile(gan_block(), "README.md GAN block", "exec"), namespace)  # its own assert: the weights
    whole, again = namespace["gan"], namespace["gan_again"]
    assert whole.state.global_step == again.state.global_step == 24
    assert again.state.log_history == whole.state.log_history
    saved, resumed = whole.optimizer.state_dict()["named"], again.optimizer.state_dict()["named"]
    assert sorted(saved) == sorted(resumed) == ["d", "g"]
    for name in saved:
        assert saved[name]["param_groups"] == resumed[name]["param_groups"]
        for index, values in saved[name]["state"].items():
            for key, value in values.items():
                assert torch.equal(value, resumed[name]["state"][index][key]), (name, index, key)
    for name in ("LRScheduler[d]", "LRScheduler[g]"):
        assert whole.get_plugin(name).state_dict() == again.get_plugin(name).state_dict()
    fresh = namespace["build_gan"](str(tmp_path / "fresh"))  # it did train: both nets moved from their start
    assert all(not torch.equal(a, b) for a, b in zip(fresh.model.parameters(), whole.model.parameters()))
