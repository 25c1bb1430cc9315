"""TRL's SFT loss as a trainbus plugin on the forward and loss hooks.

The forward goes through TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``, which the trainer
adds to the model): the per-token log-probabilities of the next-token labels, their entropy and whether
each label is the top-1 prediction, without the full logits. The loss of a micro-batch is the mean negative
log-likelihood over the predicted tokens (labels not -100 after the shift) of the whole accumulation window:
the token loss sum divided by the window's count, which trainbus's ``GradientAccumulation`` counts on the host
from the shifted labels and publishes as ``num_items_in_batch`` (the trainer declares the loss prescaled, so
only the across-process factor applies). The step's loss and gradient are those of the mean over every token
of the window, in TRL's arithmetic (its token sum over transformers' ``num_items_in_batch``), where
transformers' count is right; outside training (evaluation) the count is the batch's own.
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
        token_mean_in_eval: also log ``eval_loss_per_token``, the loss over every predicted eval token. The
            trainer asks for it with padding-free batches: transformers weighs each eval batch's loss by its
            batch size, 1 for a padding-free row, so ``eval_loss`` (TRL's) is a plain mean of per-batch means.
    """

    def __init__(self, metrics: TRLMetrics, loss_type: str = "nll", token_mean_in_eval: bool = False) -> None:
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"SFT loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
        self.metrics = metrics
        self.loss_type = loss_type
        self.token_mean_in_eval = token_mean_in_eval
        self._engine: Any = None

    def attach(self, engine: Engine) -> None:
        self._engine = engine
        # the forward keeps whatever wraps it (autocast, NEFTune): only the batch it passes on changes
        self.wrap_hook(engine, "forward", lambda inner: lambda model, batch: inner(model, fused_inputs(batch)))
        self.wrap_hook(engine, "compute_loss", lambda inner: self.compute_loss)

    def compute_loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        log_probs = outputs.log_probs  # zero where the label is -100
        per_token = -log_probs
        if self.loss_type == "dft":  # https://huggingface.co/papers/2508.05629
            per_token = per_token * log_probs.exp().detach()
        valid = outputs.label_mask.sum()
        window = self._engine.step_outputs.get("num_items_in_batch") if self._engine.model.training else None
        count = valid if window is None else torch.as_tensor(window, device=valid.device)
        loss: torch.Tensor = per_token.sum() / count.clamp(min=1)  # no predicted tokens: 0, not 0/0
        mode = self.metrics.mode()
        self.metrics.add(mode, "entropy", outputs.entropy.detach().sum(), valid)
        self.metrics.add(mode, "mean_token_accuracy", outputs.is_top1.sum(), valid)
        if mode == "eval" and self.token_mean_in_eval:
            self.metrics.add(mode, "loss_per_token", per_token.detach().sum(), valid, pooled=True)
        return loss
