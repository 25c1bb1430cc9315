"""Scheduler and optimizer scenarios of transformers' test_trainer.py: the learning rates a schedule gives,
the optimizer a name builds, weight-decay groups."""

from __future__ import annotations

import pytest
import torch
from hf_diff import RegressionData, RegressionModel, regression_trainer, run_both


def _lrs(trainer, steps):
    out = []
    for _ in range(steps):
        out.append(trainer.optimizer.param_groups[0]["lr"])
        trainer.lr_scheduler.step()
    return out


SCHEDULES = {
    "polynomial_kwargs": ("polynomial", {"power": 5.0, "lr_end": 1e-5}),  # test_lr_scheduler_kwargs
    "cosine_with_min_lr": ("cosine_with_min_lr", {"min_lr": 1e-5}),  # test_cosine_with_min_lr_scheduler
    # test_cosine_with_min_lr_schedule_with_warmup_lr_rate
    "cosine_warmup_with_min_lr": ("cosine_warmup_with_min_lr", {"min_lr": 1e-5, "warmup_lr_rate": 0.1}),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_values__mirrors_test_lr_scheduler_kwargs_and_cosine_with_min_lr(tmp_path, name):
    kind, kwargs = SCHEDULES[name]

    def scenario(impl, d):
        args = impl.args(d, lr_scheduler_type=kind, lr_scheduler_kwargs=kwargs, learning_rate=0.2, warmup_steps=2)
        trainer = impl.Trainer(RegressionModel(), args, train_dataset=RegressionData())
        trainer.create_optimizer_and_scheduler(num_training_steps=10)
        return _lrs(trainer, 11)

    hf, tb = run_both(scenario, tmp_path)
    assert tb == pytest.approx(hf, rel=1e-12)
    if name == "cosine_with_min_lr":
        assert tb[10] == pytest.approx(1e-5)


def test_plateau_schedule__mirrors_test_reduce_lr_on_plateau(tmp_path):
    def scenario(impl, d):
        class LogsLR(impl.Trainer):
            def log(self, logs, start_time=None):
                if hasattr(self.lr_scheduler, "_last_lr"):  # the test's subclass: the plateau's own lr
                    logs["learning_rate"] = self.lr_scheduler._last_lr[0]
                super().log(logs, start_time)

        args = impl.args(
            d,
            lr_scheduler_type="reduce_lr_on_plateau",
            eval_strategy="epoch",
            metric_for_best_model="eval_loss",
            num_train_epochs=10,
            learning_rate=0.2,
        )
        trainer = LogsLR(RegressionModel(), args, train_dataset=RegressionData(), eval_dataset=RegressionData())
        trainer.train()
        scheduler = trainer.lr_scheduler
        lrs = [(r.get("eval_loss"), r.get("learning_rate")) for r in trainer.state.log_history if "eval_loss" in r]
        return type(scheduler).__name__, scheduler.patience, lrs

    hf, tb = run_both(scenario, tmp_path)
    assert hf[:2] == tb[:2] == ("ReduceLROnPlateau", 10)
    assert len(hf[2]) == len(tb[2]) == 10
    assert [lr for _, lr in tb[2]] == pytest.approx([lr for _, lr in hf[2]], rel=1e-9)
    assert [loss for loss, _ in tb[2]] == pytest.approx([loss for loss, _ in hf[2]], rel=1e-5)


def test_custom_plateau_kept__mirrors_test_reduce_lr_on_plateau_args(tmp_path):
    def scenario(impl, d):
        model = RegressionModel()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.2, patience=5, cooldown=2)
        args = impl.args(d, eval_strategy="epoch", metric_for_best_model="eval_loss")
        trainer = impl.Trainer(
            model, args, train_dataset=RegressionData(), eval_dataset=RegressionData(), optimizers=(optimizer, plateau)
        )
        trainer.train()
        s = trainer.lr_scheduler
        return s is plateau, (s.factor, s.patience, s.cooldown), optimizer.param_groups[0]["lr"]

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb and tb[:2] == (True, (0.2, 5, 2))


def test_decay_groups__mirrors_test_no_wd_param_group(tmp_path):
    class Layer(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            self.linear1, self.ln1 = torch.nn.Linear(n, n), torch.nn.LayerNorm(n)
            self.linear2, self.ln2 = torch.nn.Linear(n, n), torch.nn.LayerNorm(n)
            self.bias = torch.nn.Parameter(torch.zeros(n))

        def forward(self, x):
            return self.ln2(x + torch.relu(self.linear2(x)) + self.bias)

    def scenario(impl, d):
        model = torch.nn.Sequential(Layer(8), torch.nn.ModuleList([Layer(8), Layer(8)]))
        names = {id(p): n for n, p in model.named_parameters()}
        trainer = impl.Trainer(model=model, args=impl.args(d, weight_decay=0.1))
        trainer.create_optimizer_and_scheduler(10)
        return [([names[id(p)] for p in g["params"]], g["weight_decay"]) for g in trainer.optimizer.param_groups]

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb
    assert tb[0][0] == [f"{m}.linear{i}.weight" for m in ("0", "1.0", "1.1") for i in (1, 2)]


@pytest.mark.parametrize("optim", ["adamw_torch", "adafactor"])
def test_optimizer_from_name__mirrors_test_optim_supported(tmp_path, optim):
    def scenario(impl, d):
        trainer = regression_trainer(impl, d, optim=optim, max_steps=3)
        cls, kwargs = impl.Trainer.get_optimizer_cls_and_kwargs(trainer.args)
        trainer.train()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate wraps it under HF
        return cls, dict(kwargs), type(optimizer).__name__, trainer

    (hf_cls, hf_kw, hf_type, hf), (tb_cls, tb_kw, tb_type, tb) = run_both(scenario, tmp_path)
    assert hf_cls is tb_cls and hf_kw == tb_kw and hf_type == tb_type
    assert hf.model.a.item() == pytest.approx(tb.model.a.item(), rel=1e-6)
