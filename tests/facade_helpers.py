"""Tiny models and datasets shared by the facade tests (Trainer, callbacks, logging, data)."""

from __future__ import annotations

from typing import Any

import torch

from trainbus.plugins.facade.arguments import TrainingArguments


class Regressor(torch.nn.Module):
    """A plain module with an HF-style forward: returns a dict with loss (when labels) and logits."""

    def __init__(self, features: int = 2) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(features, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        out = self.lin(x).squeeze(-1)
        result = {"logits": out}
        if labels is not None:
            result["loss"] = torch.nn.functional.mse_loss(out, labels)
        return result


def regression_data(n: int, seed: int = 0, features: int = 2) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(n, features, generator=g)
    return [{"x": xs[i], "labels": xs[i].sum() * 0.5} for i in range(n)]


def tiny_bert(num_labels: int = 2) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        num_labels=num_labels,
    )
    return BertForSequenceClassification(config)


def token_data(n: int, seed: int = 0, length: int = 8) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(1, 100, (length,), generator=g),
            "attention_mask": torch.ones(length, dtype=torch.long),
            "label": i % 2,
        }
        for i in range(n)
    ]


def accuracy(p: Any) -> dict[str, float]:
    return {"accuracy": float((p.predictions.argmax(-1) == p.label_ids).mean())}


def quiet_args(output_dir: Any, **kwargs: Any) -> TrainingArguments:
    """TrainingArguments for tests: no bars, no saving unless asked, CPU."""
    defaults: dict[str, Any] = {
        "disable_tqdm": True,
        "save_strategy": "no",
        "use_cpu": True,
        "report_to": "none",
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
    }
    defaults.update(kwargs)
    return TrainingArguments(str(output_dir), **defaults)


HF_EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_substep_end",
    "on_step_end",
    "on_evaluate",
    "on_predict",
    "on_save",
    "on_log",
    "on_prediction_step",
)


class RecordingCallback:
    """A duck-typed HF callback that records every event name (and the kwargs keys)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.kwargs: dict[str, set[str]] = {}

    def __getattr__(self, name: str) -> Any:
        if name not in HF_EVENTS:
            raise AttributeError(name)

        def record(args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.names.append(name)
            self.kwargs.setdefault(name, set()).update(kwargs)

        return record
