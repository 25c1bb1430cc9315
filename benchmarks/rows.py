"""Benchmark rows beyond the bare engine: plugin stacks and the facade, each against its own baseline.

``extra_runs(batches)`` returns ``{name: (run, baseline_name)}``; a baseline_name of None marks a
run that only serves as the baseline of others (a raw loop doing the same extra work).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from benchmarks.common import CLASSES, FEATURES, HIDDEN, ClassifierWithLoss, make_model, make_optimizer
from trainbus.engine import Engine

Run = Callable[[], None]
ACCUMULATION = 4


def _raw_stack(batches: list[Any]) -> Run:
    """A hand-written loop with accumulation (k=4), clipping at 1.0 and a linear schedule.

    Doing the same work as the plugins: each micro-batch's loss is weighted by its share of the
    window's items (labels that are not -100), the normalisation that makes accumulation exact,
    counted on the host before the batch would move to a device (numpy: no tensor, no copy) and
    applied as the multiply a loop dividing by k does.
    """
    model = make_model()
    optimizer = make_optimizer(model)
    loss_fn = torch.nn.CrossEntropyLoss()
    params = list(model.parameters())
    total = -(-len(batches) // ACCUMULATION)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / total))

    def run() -> None:
        model.train()
        for start in range(0, len(batches), ACCUMULATION):
            window = batches[start : start + ACCUMULATION]
            counts = [int(np.count_nonzero(y.numpy() != -100)) for _, y in window]
            total = sum(counts)
            for (x, y), count in zip(window, counts):
                loss = loss_fn(model(x), y) * (count / total)  # every micro-batch here has items
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def _engine_stack(batches: list[Any]) -> Run:
    from trainbus.plugins.optimization.accumulation import GradientAccumulation
    from trainbus.plugins.optimization.clipping import GradientClipping
    from trainbus.plugins.optimization.schedulers import LRScheduler

    model = make_model()
    plugins = [GradientAccumulation(ACCUMULATION), GradientClipping(1.0), LRScheduler("linear")]
    engine = Engine(
        model,
        make_optimizer(model),
        train_data=batches,
        max_epochs=1,
        loss_fn=torch.nn.CrossEntropyLoss(),
        plugins=plugins,
    )

    def run() -> None:
        engine.state.epochs_completed = engine.state.global_step = 0
        engine.fit()

    return run


def _dataset(batches: list[Any]) -> list[dict[str, torch.Tensor]]:
    return [{"x": x[i], "labels": y[i]} for x, y in batches for i in range(x.shape[0])]


def _raw_facade_baseline(batches: list[Any]) -> Run:
    """What the facade's defaults do, by hand: DataLoader + collation, weight-decay parameter groups
    (biases apart, as HF makes them), clipping at 1.0, a linear schedule."""
    model = ClassifierWithLoss(make_model())
    decay = [p for name, p in model.named_parameters() if not name.endswith("bias")]
    no_decay = [p for name, p in model.named_parameters() if name.endswith("bias")]
    groups = [{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, fused=True)
    data = _dataset(batches)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / len(loader)))

    def run() -> None:
        model.train()
        for batch in loader:
            model(**batch)["loss"].backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def _trainer_run(trainer_cls: Any, args_cls: Any, batches: list[Any]) -> Run:
    out = tempfile.mkdtemp(prefix="trainbus-bench-")
    args = args_cls(
        output_dir=out,
        per_device_train_batch_size=8,
        num_train_epochs=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        learning_rate=1e-3,
        logging_steps=500,
    )
    trainer = trainer_cls(model=ClassifierWithLoss(make_model()), args=args, train_dataset=_dataset(batches))
    return lambda: trainer.train()


def extra_runs(batches: list[Any]) -> dict[str, tuple[Run, str | None]]:
    runs: dict[str, tuple[Run, str | None]] = {"raw + accumulation + clipping + schedule": (_raw_stack(batches), None)}
    runs["engine + accumulation + clipping + schedule"] = (
        _engine_stack(batches),
        "raw + accumulation + clipping + schedule",
    )
    runs["raw + DataLoader + clipping + schedule"] = (_raw_facade_baseline(batches), None)
    try:
        from trainbus.plugins.facade.arguments import TrainingArguments
        from trainbus.plugins.facade.trainer import Trainer
    except ImportError:  # the facade is optional for this benchmark
        return runs
    runs["trainbus Trainer (defaults)"] = (
        _trainer_run(Trainer, TrainingArguments, batches),
        "raw + DataLoader + clipping + schedule",
    )
    try:
        import transformers
    except ImportError:
        return runs
    runs["transformers Trainer (defaults)"] = (
        _trainer_run(transformers.Trainer, transformers.TrainingArguments, batches),
        "raw + DataLoader + clipping + schedule",
    )
    return runs


__all__ = ["CLASSES", "FEATURES", "HIDDEN", "extra_runs"]
