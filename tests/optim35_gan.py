"""A GAN on a bare Engine with two named optimizers and a step function (#35 item 2), shared by its tests."""

from __future__ import annotations

from typing import Any

import torch

from trainbus.engine import Engine

BCE = torch.nn.BCEWithLogitsLoss()
REAL = torch.randn(40, 2, generator=torch.Generator().manual_seed(1)) * 0.5 + 1


def gan(out: str | None = None, *, epochs: int = 3, plugins: tuple[Any, ...] = (), shuffle: bool = True) -> Engine:
    torch.manual_seed(0)
    g = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    d = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(REAL), batch_size=8, shuffle=shuffle)

    def gan_step(engine: Any, batch: Any) -> dict[str, torch.Tensor]:
        (x,) = batch
        fake = g(torch.randn(len(x), 4))
        loss_d = BCE(d(x), torch.ones(len(x), 1)) + BCE(d(fake.detach()), torch.zeros(len(x), 1))
        engine.step_optimizer("d", loss_d)
        loss_g = BCE(d(fake), torch.ones(len(x), 1))
        engine.step_optimizer("g", loss_g)
        return {"loss_d": loss_d, "loss_g": loss_g}

    extra = list(plugins)
    if out is not None:
        from trainbus.plugins import Checkpointing

        extra.append(Checkpointing(out, save_strategy="steps", save_steps=3))
    optimizers = {"d": torch.optim.Adam(d.parameters(), 1e-2), "g": torch.optim.Adam(g.parameters(), 1e-2)}
    return Engine(torch.nn.ModuleDict({"g": g, "d": d}), optimizers, train_data=loader, max_epochs=epochs,
                  step=gan_step, plugins=extra)  # fmt: skip
