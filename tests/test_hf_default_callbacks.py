"""transformers' default callbacks in callback_handler.callbacks stand in for trainbus's plugins (#34 item 3)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.differential.hf_diff import run_both
from tests.facade_helpers import Regressor, regression_data

transformers = pytest.importorskip("transformers")
from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback  # noqa: E402

from trainbus.plugins.control.flow import FlowControl  # noqa: E402
from trainbus.plugins.observability.progress import Printer  # noqa: E402


def _trainer(impl, folder: Path, **kwargs):
    args = impl.args(folder, max_steps=4, logging_steps=1, eval_strategy="steps", eval_steps=2, save_steps=2,
                     per_device_train_batch_size=2, **kwargs)  # fmt: skip
    return impl.Trainer(model=Regressor(), args=args, train_dataset=regression_data(8), eval_dataset=regression_data(4))


def test_without_default_flow_callback_nothing_is_logged_evaluated_or_saved_by_steps(tmp_path: Path) -> None:
    def scenario(impl, folder):
        trainer = _trainer(impl, folder)
        trainer.remove_callback(DefaultFlowCallback)
        trainer.train()
        records = [sorted(k for k in r if not k.endswith(("runtime", "per_second"))) for r in trainer.state.log_history]
        return records, sorted(p.name for p in folder.glob("checkpoint-*"))

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb
    assert not hf[1] and len(hf[0]) == 1, "transformers logs only the train summary, saves nothing"


def test_removing_and_adding_a_default_callback_removes_and_adds_its_plugin(tmp_path: Path) -> None:
    from tests.facade_helpers import quiet_args
    from trainbus.plugins import Trainer

    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=2), train_dataset=regression_data(4))
    assert trainer.get_plugin(FlowControl) is not None and trainer.get_plugin(Printer) is not None
    assert trainer.pop_callback(PrinterCallback) is not None
    assert trainer.get_plugin(Printer) is None
    trainer.remove_callback(DefaultFlowCallback)
    assert trainer.get_plugin(FlowControl) is None
    trainer.add_callback(DefaultFlowCallback)
    assert trainer.get_plugin(FlowControl) is not None
    trainer.args.logging_steps = 2  # changed arguments: train() builds the plugins again
    trainer.train()  # ... without the printer: the script took its callback out
    assert trainer.get_plugin(Printer) is None
