"""Start-up cost: the Trainer's first optimizer step imports nothing heavy that torch does not import itself.

Each check runs benchmarks/startup.py's child in a fresh interpreter (the only place sys.modules
means anything): a hand-written loop to its first step, and the trainbus Trainer to its first step.

torch itself imports ``torch._dynamo`` (about 2 s) the first time any optimizer is built:
``Optimizer.add_param_group`` is wrapped by ``torch._compile._disable_dynamo``, which imports it on
its first call. So "torch._dynamo is never imported" cannot hold for a training step; what trainbus
controls is that it imports nothing before the optimizer is built and nothing the raw loop does not.
"""

from __future__ import annotations

import concurrent.futures

import pytest

from benchmarks import startup


@pytest.fixture(scope="module")
def children() -> dict[str, dict[str, object]]:
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        raw, trainbus = pool.map(startup.run_child, ("raw", "trainbus"))
    return {"raw": raw, "trainbus": trainbus}


def test_building_the_trainer_imports_no_compiler(children: dict[str, dict[str, object]]) -> None:
    trainbus = children["trainbus"]
    assert trainbus["dynamo_before"] is False  # `from trainbus.plugins import Trainer, TrainingArguments`
    assert trainbus["dynamo_at_init"] is False  # Trainer(...): no optimizer yet, nothing of torch.compile


def test_first_step_imports_nothing_heavy_beyond_the_raw_loop(children: dict[str, dict[str, object]]) -> None:
    raw, trainbus = children["raw"], children["trainbus"]
    assert isinstance(raw["heavy"], list) and isinstance(trainbus["heavy"], list)
    extra = set(trainbus["heavy"]) - set(raw["heavy"])
    assert not extra, f"the trainbus Trainer's first step imports {sorted(extra)}; a raw torch loop does not"


def test_the_startup_table_has_numbers(children: dict[str, dict[str, object]]) -> None:
    rows = startup.table({name: [result] for name, result in children.items()})
    assert [row[0] for row in rows] == ["raw", "trainbus"]
    for row in rows:
        name, imports, arguments, to_step, init, total, dynamo, each = row
        assert float(imports) > 0 and float(to_step) > 0 and float(init) >= 0 and float(total) > float(to_step)
        assert arguments == "-" if name == "raw" else float(arguments) >= 0
        assert dynamo == "no" and each == to_step
