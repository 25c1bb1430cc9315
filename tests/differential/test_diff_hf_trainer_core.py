"""Scenarios of transformers' own tests/trainer files (test_trainer_data.py, test_training_args.py) that failed on
trainbus when run as shipped with only the imports swapped (issue 34 item 4): eval loaders by set name and kept
with persistent workers, the loaders' ``total_batch_size``, and TrainingArguments' derived values (hub_strategy,
the default compile backend, pin memory on CPU, ``to_dict`` of a dtype field).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_diff import RegressionConfig, RegressionData, RegressionPreTrainedModel, run_both


def _trainer(impl, d, eval_dataset, **kwargs):
    model = RegressionPreTrainedModel(RegressionConfig())
    return impl.Trainer(model, impl.args(d, **kwargs), train_dataset=RegressionData(), eval_dataset=eval_dataset)


@pytest.mark.parametrize("persistent", [False, True])
def test_eval_loader_by_name_and_kept__mirrors_test_get_eval_dataloader_with_persistent_workers(tmp_path, persistent):
    """Also test_get_eval_dataloader_without_persistent_workers: a name picks that set of the Trainer's dict; with
    persistent workers the loader made first for a name (or for "eval") comes back, else a new one each call."""

    def scenario(impl, d):
        first, second = RegressionData(length=16), RegressionData(length=24)
        extra = {"dataloader_num_workers": 2} if persistent else {}
        named = _trainer(impl, d, {"first": first, "second": second}, dataloader_persistent_workers=persistent, **extra)
        a, b = named.get_eval_dataloader("first"), named.get_eval_dataloader("first")
        c = named.get_eval_dataloader("second")
        single_set = RegressionData(length=8)
        single = _trainer(impl, d, single_set, dataloader_persistent_workers=persistent, **extra)
        default, given = single.get_eval_dataloader(), single.get_eval_dataloader(single_set)
        return {
            "first_is_first": a.dataset is first,
            "second_is_second": c.dataset is second,
            "kept": a is b,
            "lengths": (len(a), len(c)),
            "default_and_given_same": default is given,
            "given_dataset": given.dataset is single_set,
        }

    hf, tb = run_both(scenario, tmp_path)
    assert hf["first_is_first"] and hf["kept"] is persistent  # the scenario pins something on transformers
    assert tb == hf


def test_unknown_eval_set_name_is_a_clear_error(tmp_path):
    """trainbus's own check (transformers raises a bare KeyError): the name and the known names are in the message."""

    def scenario(impl, d):
        trainer = _trainer(impl, d, {"first": RegressionData(length=8)})
        with pytest.raises((KeyError, ValueError)) as info:
            trainer.get_eval_dataloader("secnd")
        return str(info.value)

    _, tb = run_both(scenario, tmp_path)
    assert "'secnd'" in tb and "first" in tb


def test_loaders_tell_total_batch_size__mirrors_test_train_and_eval_dataloaders(tmp_path):
    """accelerate's prepared loaders carry ``total_batch_size`` (the batch over all processes); one process here."""

    def scenario(impl, d):
        trainer = _trainer(impl, d, RegressionData(length=74), per_device_train_batch_size=16,
                           per_device_eval_batch_size=32)  # fmt: skip
        return trainer.get_train_dataloader().total_batch_size, trainer.get_eval_dataloader().total_batch_size

    hf, tb = run_both(scenario, tmp_path)
    assert hf == (16, 32)
    assert tb == hf


def test_derived_argument_values__mirrors_test_training_args(tmp_path):
    """test_enum_coercions (hub_strategy), test_torch_compile_auto_enable (the default backend),
    test_use_cpu_disables_pin_memory, test_dtype_to_json (a subclass's torch.dtype field in to_dict)."""

    def scenario(impl, d):
        @dataclasses.dataclass
        class WithDtype(impl.TrainingArguments):
            dtype: torch.dtype = dataclasses.field(default=torch.float32)

        hub = impl.TrainingArguments(str(d), hub_strategy="end", report_to="none")
        compiled = impl.TrainingArguments(str(d), torch_compile=True, report_to="none")
        cpu = impl.TrainingArguments(str(d), use_cpu=True, report_to="none")
        dtypes = [WithDtype(str(d), dtype=dt).to_dict()["dtype"] for dt in (torch.bfloat16, torch.int64)]
        with pytest.raises(ValueError):
            impl.TrainingArguments(str(d), hub_strategy="sometimes")
        return {
            "hub": (hub.hub_strategy == "end", hub.to_dict()["hub_strategy"]),
            "backend": compiled.torch_compile_backend,
            "pin": cpu.dataloader_pin_memory,
            "dtypes": dtypes,
        }

    hf, tb = run_both(scenario, tmp_path)
    assert hf == {"hub": (True, "end"), "backend": "inductor", "pin": False, "dtypes": ["bfloat16", "int64"]}
    assert tb == hf


# -- optimizers: transformers' tests/trainer/test_trainer_optimizers.py::TrainerOptimizerChoiceTest --------------
BNB_NAMES = ["adamw_bnb_8bit", "paged_adamw_32bit", "lion_32bit", "paged_lion_8bit", "ademamix", "rmsprop_bnb"]


def _choice(impl, d, optim):
    args = impl.TrainingArguments(str(d), optim=optim, report_to="none")
    cls, kwargs = impl.Trainer.get_optimizer_cls_and_kwargs(args)
    return args, cls, kwargs


@pytest.mark.parametrize("name", ["adamw_torch", "adafactor", "sgd"])
def test_optim_as_transformers_enum_member__mirrors_test_optim_supported(tmp_path, name):
    """transformers' test passes ``optim=OptimizerNames.X`` (its enum): the same class, the same keyword arguments,
    and a trained model equal to transformers'."""
    from transformers.training_args import OptimizerNames

    def scenario(impl, d):
        args, cls, kwargs = _choice(impl, d, OptimizerNames(name))
        model = RegressionPreTrainedModel(RegressionConfig())
        trainer = impl.Trainer(
            model, impl.args(d, optim=OptimizerNames(name), max_steps=3), train_dataset=RegressionData()
        )
        trainer.train()
        return args.optim == OptimizerNames(name), cls, kwargs, (model.a.item(), model.b.item())

    hf, tb = run_both(scenario, tmp_path)
    assert hf[0] and tb[0]
    assert tb[1] is hf[1] and tb[2] == hf[2]
    assert tb[3] == pytest.approx(hf[3], rel=1e-6)


@pytest.mark.parametrize("name", BNB_NAMES)
def test_bitsandbytes_stand_in__mirrors_test_bnb_optimizer(tmp_path, name):
    """A stand-in module in sys.modules (no ``__spec__``) is what the optimizer class comes from, as in transformers."""
    from unittest import mock

    pytest.importorskip("bitsandbytes")
    from transformers.utils import is_bitsandbytes_available

    assert is_bitsandbytes_available()  # asked (and cached) before the patch, as transformers' test module does

    def scenario(impl, d):
        stand_in = mock.Mock()
        with mock.patch.dict("sys.modules", {"bitsandbytes": stand_in, "bitsandbytes.optim": stand_in.optim}):
            _, cls, kwargs = _choice(impl, d, name)
        owner = next(n for n in ("AdamW", "Lion", "AdEMAMix", "RMSprop") if cls is getattr(stand_in.optim, n))
        return owner, {k: kwargs[k] for k in ("lr", "betas") if k in kwargs}

    hf, tb = run_both(scenario, tmp_path)
    assert tb == hf


@pytest.mark.parametrize("name", BNB_NAMES)
def test_bitsandbytes_optim_missing__mirrors_test_bnb_not_available(tmp_path, name):
    """``bitsandbytes.optim`` set to None in sys.modules: asking for the class raises an ImportError (transformers
    5.x) or a ValueError (4.57); trainbus's error is both, so a script catching either release's sees it."""
    from unittest import mock

    pytest.importorskip("bitsandbytes")

    def scenario(impl, d):
        args = impl.TrainingArguments(str(d), optim=name, report_to="none")
        with mock.patch.dict("sys.modules", {"bitsandbytes.optim": None}), pytest.raises(Exception) as info:
            impl.Trainer.get_optimizer_cls_and_kwargs(args)
        return info.value

    hf, tb = run_both(scenario, tmp_path)
    assert isinstance(hf, ImportError | ValueError), repr(hf)
    assert isinstance(tb, ImportError) and isinstance(tb, ValueError), repr(tb)


def test_save_best_without_metric__mirrors_test_metric_for_best_model_behavior(tmp_path):
    """save_strategy="best" with no metric_for_best_model: a ValueError in transformers' words (its test matches
    them), whether it comes from the arguments (trainbus) or the Trainer (transformers)."""

    def scenario(impl, d):
        with pytest.raises(ValueError) as info:
            kwargs = {"eval_strategy": "epoch", "save_strategy": "best"}
            _trainer(impl, d, RegressionData(length=8), **kwargs)
        return str(info.value)

    hf, tb = run_both(scenario, tmp_path)
    words = "`args.metric_for_best_model` must be provided when using 'best' save_strategy"
    assert words in hf
    assert words in tb
