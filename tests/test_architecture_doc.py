"""docs/architecture.md names every module of engine/, hooks/ and plugins/, and cites nothing outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
FOLDERS = ("engine", "hooks", "plugins")
SKIPPED = {"__init__.py", "__main__.py"}


def modules() -> list[Path]:
    found = [
        path
        for folder in FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.name not in SKIPPED and "__pycache__" not in path.parts
    ]
    assert found, "no modules found: the test is looking in the wrong place"
    return found


@pytest.mark.parametrize("module", modules(), ids=lambda path: str(path.relative_to(ROOT)))
def test_every_module_is_in_the_doc(module: Path) -> None:
    assert module.name in DOC.read_text(encoding="utf-8"), (
        f"{module.relative_to(ROOT)} is not described in docs/architecture.md: add a row to its folder's table"
    )


def test_doc_cites_nothing_outside_the_repository() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert "../shared" not in text
    assert re.search(r"(?<![\w.])/work\b", text) is None, "the doc names an absolute /work path"
