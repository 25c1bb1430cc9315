"""The engine's messages name the Engine's API, not the Trainer's (#28 item 10).

An Engine user never wrote ``resume_from_checkpoint=True`` or ``load_best_model_at_end``: a message
of the engine that says so points at an API they do not have. The Trainer adds its own wording above.
This scans every string in the engine's ``raise`` / ``warn`` / ``logger`` calls (the testing kit too).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[1] / "engine"
#: TrainingArguments / Trainer words an Engine user never wrote
TRAINER_WORDS = (
    "resume_from_checkpoint", "load_best_model_at_end", "metric_for_best_model", "TrainingArguments",
    "gradient_accumulation_steps", "per_device_train_batch_size", "save_total_limit", "eval_strategy",
    "save_strategy", "logging_steps", "num_train_epochs", "trainer.train", "Trainer(",
)  # fmt: skip


def message_strings(source: str) -> list[str]:
    """The string parts of every message raised, warned or logged in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        calls = []
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            calls.append(node.exc)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"warn", "warning", "error", "info", "debug", "exception"}
        ):
            calls.append(node)
        for call in calls:
            for arg in call.args:
                found += [c.value for c in ast.walk(arg) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return found


def trainer_words(source: str) -> list[str]:
    return [f"{word!r} in {text!r}" for text in message_strings(source) for word in TRAINER_WORDS if word in text]


def test_the_scan_finds_trainer_words_in_a_message() -> None:
    source = 'def f(x):\n    raise ValueError(f"resume_from_checkpoint=True: no checkpoint in {x}")\n'
    assert trainer_words(source) == ["'resume_from_checkpoint' in 'resume_from_checkpoint=True: no checkpoint in '"]
    assert trainer_words('raise ValueError("resume(engine, True): no checkpoint")') == []


@pytest.mark.parametrize("path", sorted(ENGINE.rglob("*.py")), ids=lambda p: p.relative_to(ENGINE).as_posix())
def test_engine_messages_speak_the_engines_api(path: Path) -> None:
    assert trainer_words(path.read_text(encoding="utf-8")) == []
