"""TRL's own command-line scripts (``trl/scripts/sft.py``, ``dpo.py``), run as shipped under ``trl`` and, with only
the trainer / config import changed, under ``trainbus.trl``: each in its own Python process, offline, on a tiny
Llama and a locally trained tokenizer saved to a folder (``--model_name_or_path``) and json-lines data in a
folder (``--dataset_name``, read by ``datasets.load_dataset`` as TRL's script reads it).
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from conformance.harness import Run, files_under

#: the names a port takes from trainbus.trl instead of trl
PORTED = frozenset({"SFTTrainer", "SFTConfig", "DPOTrainer", "DPOConfig"})
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_DISABLE_TELEMETRY": "1", "TRANSFORMERS_VERBOSITY": "error"}  # fmt: skip


def shipped_source(name: str) -> str:
    """The installed TRL's ``trl/scripts/<name>.py``, as it is on disk."""
    spec = importlib.util.find_spec(f"trl.scripts.{name}")
    assert spec is not None and spec.origin is not None, f"trl.scripts.{name} is not installed"
    return Path(spec.origin).read_text(encoding="utf-8")


def ported_source(source: str) -> tuple[str, list[str]]:
    """``source`` with every ``from trl import ...`` of a trainer or config split in two: the ported names from
    ``trainbus.trl``, the rest still from ``trl``. Returns the new source and the names moved."""
    lines = source.splitlines(keepends=True)
    moved: list[str] = []
    nodes = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom) and n.module == "trl"]
    for node in sorted(nodes, key=lambda n: -n.lineno):  # bottom up: earlier line numbers stay valid
        names = [a.name for a in node.names]
        ours = [n for n in names if n in PORTED]
        if not ours:
            continue
        indent = " " * node.col_offset
        rest = [n for n in names if n not in PORTED]
        new = (f"{indent}from trl import {', '.join(rest)}\n" if rest else "") + (
            f"{indent}from trainbus.trl import {', '.join(ours)}\n"
        )
        lines[node.lineno - 1 : node.end_lineno] = [new]
        moved += ours
    return "".join(lines), sorted(moved)


def write_workspace(root: Path) -> dict[str, str]:
    """A model folder (tokenizer + tiny Llama, saved), text data and preference data folders (train / test)."""
    from transformers import AutoTokenizer
    from trl_jobs import preference_rows, text_rows, tiny_model, write_tokenizer

    model_dir = root / "model"
    write_tokenizer(model_dir)
    tiny_model("llama", len(AutoTokenizer.from_pretrained(str(model_dir)))).save_pretrained(str(model_dir))
    folders = {"model": str(model_dir)}
    for kind, rows in (("text", text_rows), ("preference", preference_rows)):
        folder = root / kind
        folder.mkdir()
        for split, n, seed in (("train", 12, 1), ("test", 6, 2)):
            with open(folder / f"{split}.jsonl", "w", encoding="utf-8") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows(n, seed))
        folders[kind] = str(folder)
    return folders


def argv(options: dict[str, Any]) -> list[str]:
    out = []
    for key, value in options.items():
        out += [f"--{key}"] if value is True else [f"--{key}", str(value)]
    return out


def start(script: Path, options: dict[str, Any], cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, **OFFLINE}
    env.pop("PYTHONPATH", None)  # the script sees the installed packages only, as a user's would
    return subprocess.Popen(
        [sys.executable, str(script), *argv(options)], cwd=cwd, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def printed_records(stdout: str) -> list[dict[str, Any]]:
    """The log records transformers' PrinterCallback prints (one dict a line, values rounded to 4 digits)."""
    return [ast.literal_eval(line) for line in stdout.splitlines() if line.startswith("{'")]


def as_run(name: str, output_dir: Path) -> Run:
    """The run read back from its folder: the log history of its newest checkpoint's trainer_state.json."""
    newest = max(output_dir.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    history = json.loads((newest / "trainer_state.json").read_text())["log_history"]
    return Run(
        implementation="transformers" if name == "trl" else "trainbus", output_dir=output_dir,
        log_history=history, train_metrics={}, eval_metrics={}, predictions=None, label_ids=None,
        predict_metrics={}, files=files_under(output_dir),
    )  # fmt: skip
