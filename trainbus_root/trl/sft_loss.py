"""TRL's SFT loss as a trainbus plugin on the forward and loss hooks.

The forward goes through TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, which the trainer
adds to the model): the per-token log-probabilities of the next-token labels, their entropy and whether
each label is the top-1 prediction, without the full logits. The loss of a micro-batch is the mean negative
log-likelihood over its own predicted tokens (labels not -100 after the shift); trainbus's
``GradientAccumulation`` then weighs each micro-batch by its share of the window's predicted tokens, so the
step's loss and gradient are those of the mean over every token of the window (TRL divides the token sum by
the ``num_items_in_batch`` transformers counted: the same where that count is right).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import Plugin

from .metrics import TRLMetrics

if TYPE_CHECKING:
    from trainbus.engine import Engine

#: TRL's SFT loss types: negative log-likelihood, and DFT (each token's NLL weighted by its detached probability)
LOSS_TYPES = ("nll", "dft")


def fused_inputs(batch: Any) -> dict[str, Any]:
    """The batch as TRL calls the model: no KV cache, the fused LM head's outputs."""
    return {**batch, "use_cache": False, "fused_lm_head": True}


class SFTLoss(Plugin):  # type: ignore[misc]  # mypy reads trainbus.* as Any
    """The SFT loss and TRL's token metrics (``entropy``, ``mean_token_accuracy``) from the fused head's outputs.

    Args:
        metrics: the ``TRLMetrics`` plugin that logs the metrics.
        loss_type: "nll" (TRL's default) or "dft".
    """

    def __init__(self, metrics: TRLMetrics, loss_type: str = "nll") -> None:
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"SFT loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        self.metrics = metrics
        self.loss_type = loss_type

    def attach(self, engine: Engine) -> None:
        # the forward keeps whatever wraps it (autocast, NEFTune): only the batch it passes on changes
        self.wrap_hook(engine, "forward", lambda inner: lambda model, batch: inner(model, fused_inputs(batch)))
        self.wrap_hook(engine, "compute_loss", lambda inner: self.compute_loss)

    def compute_loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        log_probs = outputs.log_probs  # zero where the label is -100
        per_token = -log_probs
        if self.loss_type == "dft":  # https://huggingface.co/papers/2508.05629
            per_token = per_token * log_probs.exp().detach()
        valid = outputs.label_mask.sum()
        loss: torch.Tensor = per_token.sum() / valid.clamp(min=1)  # a batch without predicted tokens: 0, not 0/0
        mode = self.metrics.mode()
        self.metrics.add(mode, "entropy", outputs.entropy.detach().sum(), valid)
        self.metrics.add(mode, "mean_token_accuracy", outputs.is_top1.sum(), valid)
        return loss
