"""The transformers releases the facade supports (#27 item 7): 4.57.1 to the newest, or none at all.

Below ``MIN_TRANSFORMERS`` importing the facade fails at once, naming the installed version and the
minimum; without transformers the facade imports and trains (transformers is optional). setup.cfg's
extras ask for the same minimum. CI runs the port's tests on the oldest, on 5.0 and on the newest.
"""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainbus.plugins.facade import MIN_TRANSFORMERS, check_transformers, release

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version", ["4.57.0", "4.56.2", "4.46.0", "3.5.1"])
def test_an_older_release_is_refused_naming_both_versions(version: str) -> None:
    with pytest.raises(ImportError, match=rf"transformers >= {re.escape(MIN_TRANSFORMERS)}.*{re.escape(version)}"):
        check_transformers(version)


@pytest.mark.parametrize("version", [MIN_TRANSFORMERS, "4.57.6", "5.0.0", "5.24.0", "6.1.0.dev0", None])
def test_supported_releases_and_none_pass(version: str | None) -> None:
    """None: no transformers installed. A development build of a release counts as that release."""
    check_transformers(version)


def test_release_parses_versions() -> None:
    assert release("4.57.0") == (4, 57, 0) and release("5.0") == (5, 0, 0) and release("4.57.0.dev0") == (4, 57, 0)
    with pytest.raises(ValueError, match="'main'"):
        release("main")


def test_setup_cfg_asks_for_the_same_minimum() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    extras = config["options.extras_require"]
    bounds = {name: re.findall(r"^transformers>=(\S+)$", extras[name], re.M) for name in extras}
    asked = {name: found for name, found in bounds.items() if found}
    assert set(asked) >= {"test", "liger", "bench"}, asked
    assert all(found == [MIN_TRANSFORMERS] for found in asked.values()), asked


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        cwd=ROOT,
    )


def test_importing_the_facade_under_an_older_transformers_says_so(tmp_path: Path) -> None:
    """A transformers 4.56.2 installed first on the path: the facade refuses, the bare engine's plugins do not."""
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text('__version__ = "4.56.2"\n', encoding="utf-8")
    dist = tmp_path / "transformers-4.56.2.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 4.56.2\n", encoding="utf-8")
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    refused = _python("from trainbus.plugins import Trainer", PYTHONPATH=path)
    assert refused.returncode != 0
    last = refused.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError:") and "4.56.2" in last and MIN_TRANSFORMERS in last, refused.stderr
    engine = _python("from trainbus.plugins import GradientAccumulation; import trainbus.engine", PYTHONPATH=path)
    assert engine.returncode == 0, engine.stderr


def test_the_facade_trains_without_transformers(tmp_path: Path) -> None:
    """transformers hidden from imports and from the installed distributions: the facade imports and trains."""
    result = _python(
        f"""
        import sys
        from importlib import abc, metadata

        class NoTransformers(abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.partition(".")[0] == "transformers":
                    raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
                return None

        sys.meta_path.insert(0, NoTransformers())
        version = metadata.version

        def without_transformers(name):
            if name == "transformers":
                raise metadata.PackageNotFoundError(name)
            return version(name)

        metadata.version = without_transformers

        import torch
        from trainbus.plugins import Trainer, TrainingArguments

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(4, 2)

            def forward(self, x, labels=None):
                logits = self.linear(x)
                return {{"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}}

        g = torch.Generator().manual_seed(0)
        data = [{{"x": torch.randn(4, generator=g), "labels": torch.tensor(i % 2)}} for i in range(16)]
        args = TrainingArguments(output_dir={str(tmp_path)!r}, max_steps=3, per_device_train_batch_size=4,
                                 report_to="none", use_cpu=True, disable_tqdm=True, save_strategy="no")
        trainer = Trainer(Model(), args, train_dataset=data, eval_dataset=data)
        steps, loss = trainer.train().global_step, trainer.evaluate()["eval_loss"]
        print("result", steps, loss > 0, "transformers" in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].split() == ["result", "3", "True", "False"], result.stdout
