"""The README's code is real: every ```python block runs, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"```python\n(.*?)```", re.DOTALL)


def readme_blocks() -> list[str]:
    return BLOCK.findall(README.read_text(encoding="utf-8"))


def test_readme_has_code() -> None:
    assert len(readme_blocks()) >= 4


def test_readme_blocks_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # blocks may write output dirs
    namespace: dict[str, object] = {"__name__": "readme"}
    for index, block in enumerate(readme_blocks()):
        try:
            exec(compile(block, f"README.md block {index}", "exec"), namespace)
        except Exception as exc:  # pragma: no cover - the message is the point
            raise AssertionError(f"README block {index} failed: {exc!r}\n{block}") from exc
    # blocks that define property tests leave them to be called here
    for name, value in list(namespace.items()):
        if name.startswith("test_") and callable(value):
            value()
