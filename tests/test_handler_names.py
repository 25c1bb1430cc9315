"""One name for a handler's argument across the built-in plugins (#24 item 3): ``ev``, the payload.

A reader who has seen one handler reads every other the same way; the README's handlers use it too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAYLOAD_TYPE = re.compile(r"\b(\w+Event|Payload)\b")


def handler_arguments() -> list[tuple[str, str, str]]:
    """(file, function, argument name) of every function taking a payload (annotated with a payload type)."""
    found = []
    for path in sorted((ROOT / "plugins").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef):
                continue
            args = [a for a in node.args.args if a.arg != "self"]
            annotation = args[0].annotation if len(args) == 1 else None
            if annotation is not None and PAYLOAD_TYPE.search(ast.unparse(annotation)):
                found.append((path.relative_to(ROOT).as_posix(), node.name, args[0].arg))
    return found


def test_every_handler_names_its_payload_ev() -> None:
    handlers = handler_arguments()
    assert len(handlers) > 80  # the check sees the plugins' handlers
    others = [f"{file}:{name}({arg})" for file, name, arg in handlers if arg != "ev"]
    assert not others, f"handlers whose payload argument is not named ev: {others}"
