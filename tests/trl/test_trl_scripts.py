"""TRL's own ``sft.py`` and ``dpo.py`` (trl/scripts, as the installed TRL ships them) under ``trl`` and, with only
the trainer / config import changed, under ``trainbus.trl``: both exit 0 (the scripts end with ``trainer.end()``),
every log record agrees (the newest checkpoint's history key by key, losses at rtol 1e-5; the records the
scripts print, to their 4 printed digits) and the output folders agree file by file.

Each script runs in its own process, offline, with ``--model_name_or_path`` a folder holding a tiny Llama and a
locally trained tokenizer, and ``--dataset_name`` a folder of json-lines files (``train`` / ``test`` splits).
"""

from __future__ import annotations

import difflib
import math
from typing import Any

import pytest
from conformance.harness import differences, extra_files
from trl_scripts import as_run, ported_source, printed_records, shipped_source, start, write_workspace

COMMON = {"use_cpu": True, "bf16": "false", "dtype": "float32", "seed": 42, "report_to": "none",
          "disable_tqdm": "true", "logging_steps": 1, "max_steps": 4, "gradient_accumulation_steps": 2,
          "eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 4,
          "learning_rate": 5e-3}  # fmt: skip
PER_TOKEN = "eval_loss_per_token"
SCRIPTS = {
    # TRL's documented SFT run: packing (best-fit decreasing, padding-free), an EOS token named on the command line
    "sft": ("text", {"packing": True, "max_length": 32, "per_device_train_batch_size": 4, "eos_token": "<|im_end|>"}),
    # DPO on conversational preference pairs; the reference model is loaded from the same folder
    "dpo": ("preference", {"max_length": 32, "per_device_train_batch_size": 2}),
}


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both scripts under both implementations, the four processes at once: ``{(name, impl): (process, out, err)}``."""
    root = tmp_path_factory.mktemp("trl_scripts")
    workspace = write_workspace(root)
    processes = {}
    for name, (data, options) in SCRIPTS.items():
        for impl in ("trl", "trainbus"):
            shipped = shipped_source(name)
            script = root / f"{name}_{impl}.py"
            script.write_text(shipped if impl == "trl" else ported_source(shipped)[0])
            given = {"model_name_or_path": workspace["model"], "dataset_name": workspace[data],
                     "output_dir": root / name / impl, **COMMON, **options}  # fmt: skip
            processes[name, impl] = (start(script, given, root), root / name / impl)
    return {key: (p, *p.communicate(timeout=300), out) for key, (p, out) in processes.items()}


def test_port_changes_only_the_import() -> None:
    """The ported scripts differ from TRL's by the trainer and config imports, nothing else."""
    for name, names in (("sft", ["SFTConfig", "SFTTrainer"]), ("dpo", ["DPOConfig", "DPOTrainer"])):
        shipped = shipped_source(name)
        ported, moved = ported_source(shipped)
        assert moved == names
        changed = [line for line in difflib.ndiff(shipped.splitlines(), ported.splitlines()) if line[:2] in "+ - "]
        changed = [line[2:].strip() for line in changed if line[:2] in ("+ ", "- ")]
        assert changed and all(line.startswith(("from trl import", "from trainbus.trl import")) for line in changed)


def close(expected: Any, actual: Any) -> bool:
    try:
        return math.isclose(float(expected), float(actual), rel_tol=2e-3, abs_tol=1e-8)
    except ValueError:
        return expected == actual


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_trl_script_runs_unchanged_but_for_the_import(finished: dict[str, Any], name: str) -> None:
    for impl in ("trl", "trainbus"):
        process, out, err, _ = finished[name, impl]
        assert process.returncode == 0, f"{name}.py under {impl} exited {process.returncode}:\n{err[-4000:]}"
        assert "Training completed" in out and "Model saved" in out
    trl, ours = as_run("trl", finished[name, "trl"][3]), as_run("trainbus", finished[name, "trainbus"][3])
    assert not {f for f in extra_files(trl, ours) if f.endswith("README.md")}  # a model card only where TRL writes one
    found = differences(trl, ours, ignore=[PER_TOKEN])  # trainbus.trl's exact token mean beside TRL's eval_loss
    assert not found, f"{len(found)} differences from trl:\n" + "\n".join(found)
    assert sum("eval_loss" in r for r in ours.log_history) == 2 and sum("loss" in r for r in ours.log_history) == 4
    printed = {impl: printed_records(finished[name, impl][1]) for impl in ("trl", "trainbus")}
    assert len(printed["trainbus"]) == len(printed["trl"]) == 7  # 4 steps, 2 evaluations, the train summary
    assert any(PER_TOKEN in r for r in ours.log_history) == (name == "sft")  # packed: padding-free eval batches
    for theirs, mine in zip(printed["trl"], printed["trainbus"], strict=True):
        mine.pop(PER_TOKEN, None)
        assert set(theirs) == set(mine)
        timing = ("_runtime", "_per_second")
        assert all(close(v, mine[k]) for k, v in theirs.items() if not k.endswith(timing)), (theirs, mine)
