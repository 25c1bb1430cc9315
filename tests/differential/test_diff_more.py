"""More scenarios of transformers' test_trainer.py: the logged training loss, the NaN / Inf filter,
the loaders' sizes and the optimizer / parameter inspection helpers; and of test_trainer_callback.py:
callback states restored from a checkpoint.

Each test runs the same job under transformers.Trainer and trainbus.plugins.Trainer (hf_diff.run_both)
and compares what transformers' own test pins. Test names: ``test_<what>__mirrors_<transformers test>``.
"""

from __future__ import annotations

import math
from unittest import mock

import pytest
import torch
from hf_diff import RegressionData, assert_same_logs, assert_same_weights, regression_trainer, run_both


class RepeatData:
    """transformers' RepeatDataset: ``length`` copies of one token sequence, as input_ids and labels."""

    def __init__(self, x: torch.Tensor, length: int = 64) -> None:
        self.x, self.length = x, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x, "labels": self.x}


def _losses(trainer):
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def test_logged_loss_averages_to_train_loss__mirrors_test_training_loss(tmp_path):
    # HF: with logs every 64 / 8 = 8 steps (3 in the run of 24), the mean of the logged losses is
    # train_loss; with logs every 5 steps (uneven windows) train_loss is the same number
    def scenario(impl, d):
        trainers = {}
        for steps in (8, 5):
            trainers[steps] = regression_trainer(impl, d / str(steps), logging_steps=steps)
            trainers[steps].train()
        return trainers

    hf, tb = run_both(scenario, tmp_path)
    for steps in (8, 5):
        assert_same_logs(hf[steps].state.log_history, tb[steps].state.log_history)
        assert_same_weights(hf[steps].model, tb[steps].model)
    train_loss = tb[8].state.log_history[-1]["train_loss"]
    losses = _losses(tb[8])
    assert len(losses) == 3 and len(_losses(tb[5])) == 4
    assert sum(losses) / len(losses) == pytest.approx(train_loss, abs=1e-4)
    assert tb[5].state.log_history[-1]["train_loss"] == pytest.approx(train_loss, abs=1e-4)


def test_nan_inf_losses_filtered__mirrors_test_logging_inf_nan_filter(tmp_path):
    # HF: a tiny GPT-2 at learning rate 1e9 diverges after its first step; without the filter a logged
    # loss is NaN or Inf, with it (the default) none is. Here without dropout, so that the first step's
    # loss L can be computed independently: the filter fills each NaN step of the first 5-step window
    # with HF's running mean (total / (1 + step - last logged)), which gives 3 L, logged as 0.6 L.
    # transformers wrong: it divides the loss by num_items_in_batch counted on the unshifted labels
    # (128 per row), while GPT-2 averages over the 127 shifted ones, so it logs 127/128 of that (as in
    # test_cache_dropped_by_default). trainbus logs the model's own loss.
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    x = torch.randint(0, 100, (128,))
    config = GPT2Config(
        vocab_size=100, n_positions=128, n_embd=32, n_layer=3, n_head=4, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    state = GPT2LMHeadModel(config).state_dict()

    def model():
        m = GPT2LMHeadModel(config)
        m.load_state_dict(state)
        return m

    def scenario(impl, d):
        out = {}
        for flag in (False, True):
            args = impl.args(d / str(flag), learning_rate=1e9, logging_steps=5, logging_nan_inf_filter=flag)
            trainer = impl.Trainer(model(), args, train_dataset=RepeatData(x))
            trainer.train()
            out[flag] = trainer.state.log_history
        return out

    def bad(history):
        return [math.isnan(log["loss"]) or math.isinf(log["loss"]) for log in history[:-1]]

    hf, tb = run_both(scenario, tmp_path)
    for logs in (hf, tb):
        assert any(bad(logs[False])) and not any(bad(logs[True]))
    for flag in (False, True):
        assert [sorted(r) for r in hf[flag]] == [sorted(r) for r in tb[flag]]
        assert [r["step"] for r in hf[flag]] == [r["step"] for r in tb[flag]] == [5, 10, 15, 20, 24]
        assert bad(hf[flag]) == bad(tb[flag])
    with torch.no_grad():
        first = model()(input_ids=x.repeat(8, 1), labels=x.repeat(8, 1)).loss.item()
    expected = [0.6 * first, 0.0, 0.0, 0.0]
    assert [r["loss"] for r in tb[True][:-1]] == pytest.approx(expected, rel=1e-5)
    assert tb[True][-1]["train_loss"] == pytest.approx(3 * first / 24, rel=1e-5)
    # what transformers logs (recorded, see above)
    assert [r["loss"] for r in hf[True][:-1]] == pytest.approx([v * 127 / 128 for v in expected], rel=1e-5)
    assert hf[True][-1]["train_loss"] == pytest.approx(3 * first / 24 * 127 / 128, rel=1e-5)


def _first_batch_size(loader):
    return len(next(iter(loader))["input_x"])


def test_loader_sizes__mirrors_test_train_and_eval_dataloaders(tmp_path):
    # HF pins ``loader.total_batch_size`` (16), an attribute of accelerate's loaders; trainbus's loaders are
    # torch DataLoaders without it (trainbus differs, see docs/hf_differential.md). The batch size is
    # compared here as the size of the first batch; the loader lengths, with and without drop_last and for
    # a new eval set, as HF pins them.
    def scenario(impl, d):
        out = {}
        trainer = regression_trainer(impl, d, learning_rate=0.1, per_device_train_batch_size=16)
        out["train_batch"] = _first_batch_size(trainer.get_train_dataloader())
        trainer = regression_trainer(impl, d, learning_rate=0.1, per_device_eval_batch_size=16)
        out["eval_batch"] = _first_batch_size(trainer.get_eval_dataloader())
        out["loader_total_batch_size"] = getattr(trainer.get_eval_dataloader(), "total_batch_size", None)
        sizes = {"train_len": 66, "eval_len": 74, "per_device_train_batch_size": 16, "per_device_eval_batch_size": 32}
        for drop_last in (False, True):
            trainer = regression_trainer(impl, d, learning_rate=0.1, dataloader_drop_last=drop_last, **sizes)
            out[f"train_len_drop_{drop_last}"] = len(trainer.get_train_dataloader())
            out[f"eval_len_drop_{drop_last}"] = len(trainer.get_eval_dataloader())
            out[f"new_eval_len_drop_{drop_last}"] = len(trainer.get_eval_dataloader(RegressionData(length=128)))
        return out

    hf, tb = run_both(scenario, tmp_path)
    assert hf.pop("loader_total_batch_size") == 16  # trainbus: no such attribute (not compared)
    tb.pop("loader_total_batch_size")
    assert hf == tb
    assert tb == {
        "train_batch": 16,
        "eval_batch": 16,
        "train_len_drop_False": 66 // 16 + 1,
        "eval_len_drop_False": 74 // 32 + 1,
        "new_eval_len_drop_False": 128 // 32,
        "train_len_drop_True": 66 // 16,
        "eval_len_drop_True": 74 // 32,
        "new_eval_len_drop_True": 128 // 32,
    }


def test_trainable_parameter_count__mirrors_test_get_num_trainable_parameters(tmp_path):
    def scenario(impl, d):
        model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.Linear(64, 32))
        trainer = impl.Trainer(model=model, args=impl.args(d))
        counts = [trainer.get_num_trainable_parameters()]
        for param in model[-1].parameters():
            param.requires_grad = False
        counts.append(trainer.get_num_trainable_parameters())
        return counts

    hf, tb = run_both(scenario, tmp_path)
    layer_1, layer_2 = 128 * 64 + 64, 64 * 32 + 32
    assert hf == tb == [layer_1 + layer_2, layer_1]


def test_learning_rates_per_group__mirrors_test_get_learning_rates(tmp_path):
    def scenario(impl, d):
        trainer = impl.Trainer(model=torch.nn.Sequential(torch.nn.Linear(128, 64)), args=impl.args(d))
        with pytest.raises(ValueError):
            trainer.get_learning_rates()
        trainer.create_optimizer()
        return trainer.get_learning_rates()

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb == [5e-05, 5e-05]  # the decay group (weight) and the no-decay group (bias)


def test_optimizer_group_lookup__mirrors_test_get_optimizer_group(tmp_path):
    def scenario(impl, d):
        model = torch.nn.Sequential(torch.nn.Linear(128, 64))
        trainer = impl.Trainer(model=model, args=impl.args(d))
        with pytest.raises(ValueError):
            trainer.get_optimizer_group()
        trainer.create_optimizer()
        groups = trainer.get_optimizer_group()
        names = {id(p): n for n, p in model.named_parameters()}
        param = next(model.parameters())
        group = trainer.get_optimizer_group(param)
        return len(groups), any(p is param for p in group["params"]), [names[id(p)] for p in group["params"]]

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb == (2, True, ["0.weight"])


# -- callback states restored from a checkpoint (test_trainer_callback.py) ---------------------------
_STATEFUL_RUN = {
    "load_best_model_at_end": True,
    "save_strategy": "steps",
    "eval_strategy": "steps",
    "save_steps": 2,
    "eval_steps": 2,
    "max_steps": 2,
}


def _callback_classes(impl):
    """test_trainer_callback's MyTestTrainerCallback (no state) and MyTestExportableCallback, for ``impl``.

    The exportable one mixes in transformers' ExportableState on both sides: a ported script keeps that
    import (trainbus reads a callback's ``state()``)."""
    from transformers.trainer_callback import ExportableState

    class Plain(impl.TrainerCallback):
        def __init__(self, my_test_state="test"):
            self.my_test_state = my_test_state

    class Exportable(impl.TrainerCallback, ExportableState):
        def __init__(self, my_test_state="test"):
            self.my_test_state = my_test_state

        def state(self):
            return {"args": {"my_test_state": self.my_test_state}}

    return Plain, Exportable


def _first_then_restored(impl, d, first, fresh, **extra):
    """Train 2 steps with the ``first`` callbacks, then resume from checkpoint-2 with ``fresh`` ones."""
    regression_trainer(impl, d, trainer_kwargs={"callbacks": first}, **_STATEFUL_RUN).train()
    trainer = regression_trainer(
        impl, d, trainer_kwargs={"callbacks": fresh}, restore_callback_states_from_checkpoint=True, **_STATEFUL_RUN
    )
    trainer.train(resume_from_checkpoint=str(d / "checkpoint-2"))
    return trainer


def test_stateless_kept_stateful_restored__mirrors_test_stateful_mixed_callbacks(tmp_path):
    # early_stopping_patience_counter is left out: transformers evaluates once more when a resume starts
    # at max_steps (counter 1), trainbus does not (counter 0); see test_metric_never_computed
    def scenario(impl, d):
        Plain, _ = _callback_classes(impl)
        first = [Plain(my_test_state="another value"), impl.EarlyStoppingCallback(5, 0.2)]
        trainer = _first_then_restored(impl, d, first, [impl.EarlyStoppingCallback(), Plain()])
        mine = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, (impl.EarlyStoppingCallback, Plain))]
        return [
            (
                type(cb).__name__,
                getattr(cb, "my_test_state", None),
                getattr(cb, "early_stopping_patience", None),
                getattr(cb, "early_stopping_threshold", None),
            )
            for cb in mine
        ]

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb
    # no state(): not restored; HF's order: a restored callback is removed and added again at the end
    assert tb == [("Plain", "test", None, None), ("EarlyStoppingCallback", None, 5, 0.2)]


def test_duplicates_restored_in_order__mirrors_test_stateful_duplicate_callbacks(tmp_path):
    def scenario(impl, d):
        _, Exportable = _callback_classes(impl)
        first = [Exportable("first"), Exportable("second")]
        trainer = _first_then_restored(impl, d, first, [Exportable(), Exportable()])
        return [cb.my_test_state for cb in trainer.callback_handler.callbacks if isinstance(cb, Exportable)]

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb == ["first", "second"]


def test_missing_stateful_callback_warned__mirrors_test_missing_stateful_callback(tmp_path):
    # HF patches its trainer module's logger.warning; here each implementation's logger that warns
    import transformers.trainer

    import trainbus.plugins.facade.callbacks

    hf_logger_in_trainbus = trainbus.plugins.facade.callbacks.hf_trainer_logger  # transformers.trainer's, by name
    loggers = {"transformers": transformers.trainer.logger, "trainbus": hf_logger_in_trainbus}

    def scenario(impl, d):
        regression_trainer(
            impl, d, trainer_kwargs={"callbacks": [impl.EarlyStoppingCallback()]}, **_STATEFUL_RUN
        ).train()
        trainer = regression_trainer(impl, d, restore_callback_states_from_checkpoint=True, **_STATEFUL_RUN)
        with mock.patch.object(loggers[impl.name], "warning") as warn:
            trainer.train(resume_from_checkpoint=str(d / "checkpoint-2"))
        return any("EarlyStoppingCallback" in " ".join(map(str, call.args)) for call in warn.call_args_list)

    hf, tb = run_both(scenario, tmp_path)
    assert hf is tb is True
