"""TRL's DPO losses as a trainbus plugin on the forward and loss hooks, with TRL's DPO metrics.

A batch is TRL's ``DataCollatorForPreference`` output: the chosen completions, then the rejected ones, each
after its prompt. The forward hook runs the policy through the fused LM head; the loss hook sums each
sequence's completion log-probability, takes the reference's from the ``ReferencePolicy`` plugin, and returns
the mean over the micro-batch's pairs of TRL's per-pair loss (summed over ``loss_type`` with
``loss_weights``). trainbus's ``GradientAccumulation`` weighs micro-batches by their rows (two per pair), so a
step's loss is the mean over every pair of its window; TRL (``loss_is_scaled_for_ga = False``) divides each
micro-batch's mean by the number of micro-batches, which is the same only when they hold as many pairs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from trainbus.engine import Plugin

from .metrics import TRLMetrics
from .reference import ReferencePolicy, model_inputs, sequence_log_probs

if TYPE_CHECKING:
    from trainbus.engine import Engine

#: the DPO loss types trainbus.trl implements (TRL has more: they are refused when the trainer is made)
LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def pair_losses(loss_type: str, beta: float, delta: torch.Tensor, chosen_scores: torch.Tensor,
                rejected_scores: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """One loss per pair. IPO divides each completion's score by its length (TRL's normalisation)."""
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":
        chosen_mask, rejected_mask = completion_mask.chunk(2, dim=0)
        chosen = chosen_scores / chosen_mask.sum(dim=1).clamp(min=1.0)
        rejected = rejected_scores / rejected_mask.sum(dim=1).clamp(min=1.0)
        return (chosen - rejected - 1 / (2 * beta)) ** 2
    raise ValueError(f"DPO loss_type must be among {LOSS_TYPES}, got {loss_type!r}")


class DPOLoss(Plugin):  # type: ignore[misc]  # mypy reads trainbus.* as Any
    """TRL's DPO loss (``loss_type`` / ``loss_weights`` / ``beta``) and its metrics.

    Args:
        metrics: the ``TRLMetrics`` plugin that logs ``rewards/*``, ``logps/*``, ``logits/*``, ...
        reference: the ``ReferencePolicy`` plugin.
        beta, loss_types, loss_weights: ``DPOConfig``'s.
    """

    def __init__(self, metrics: TRLMetrics, reference: ReferencePolicy, beta: float, loss_types: list[str],
                 loss_weights: list[float] | None = None) -> None:  # fmt: skip
        unknown = [t for t in loss_types if t not in LOSS_TYPES]
        if unknown:
            raise ValueError(f"DPO loss_type {unknown} is not supported by trainbus.trl; supported: {LOSS_TYPES}")
        self.metrics, self.reference, self.beta = metrics, reference, beta
        self.loss_types = list(loss_types)
        self.loss_weights = list(loss_weights) if loss_weights is not None else [1.0] * len(self.loss_types)
        self._engine: Any = None

    def attach(self, engine: Engine) -> None:
        self._engine = engine
        self.wrap_hook(engine, "forward", lambda inner: lambda model, batch: inner(model, model_inputs(batch)))
        self.wrap_hook(engine, "compute_loss", lambda inner: self.compute_loss)

    def compute_loss(self, outputs: Any, batch: Any) -> torch.Tensor:
        completion_mask = batch["completion_mask"]
        shift_mask = completion_mask[..., 1:]
        seq_len = shift_mask.size(1)
        chosen_logps, rejected_logps = sequence_log_probs(outputs.log_probs, completion_mask).chunk(2, dim=0)
        ref_chosen, ref_rejected = self.reference.log_probs(batch)
        chosen_ratio, rejected_ratio = chosen_logps - ref_chosen, rejected_logps - ref_rejected
        delta = chosen_ratio - rejected_ratio
        loss: Any = 0.0
        for loss_type, weight in zip(self.loss_types, self.loss_weights, strict=True):
            per_pair = pair_losses(loss_type, self.beta, delta, chosen_ratio, rejected_ratio, completion_mask)
            loss = loss + per_pair.mean() * weight
        self._record(outputs, shift_mask, seq_len, (chosen_ratio, rejected_ratio), (chosen_logps, rejected_logps))
        return loss  # type: ignore[no-any-return]

    def _record(self, outputs: Any, mask: torch.Tensor, seq_len: int, ratios: tuple[torch.Tensor, torch.Tensor],
                logps: tuple[torch.Tensor, torch.Tensor]) -> None:  # fmt: skip
        """TRL's DPO metrics of this batch, as sums and counts (read at the logging point)."""
        add, mode = self.metrics.add, self.metrics.mode()
        add(mode, "entropy", (outputs.entropy[:, -seq_len:].detach() * mask).sum(), mask.sum())
        chosen_mask, rejected_mask = mask.chunk(2, dim=0)
        chosen_logits, rejected_logits = outputs.mean_logits[:, -seq_len:].chunk(2, dim=0)
        add(mode, "logits/chosen", chosen_logits[chosen_mask.bool()].sum(), chosen_mask.sum())
        add(mode, "logits/rejected", rejected_logits[rejected_mask.bool()].sum(), rejected_mask.sum())
        chosen_top1, _ = outputs.is_top1[:, -seq_len:].chunk(2, dim=0)
        add(mode, "mean_token_accuracy", (chosen_top1 & chosen_mask.bool()).sum(), chosen_mask.sum())
        chosen_rewards, rejected_rewards = (self.beta * r.detach() for r in ratios)
        pairs = chosen_rewards.numel()
        add(mode, "rewards/chosen", chosen_rewards.sum(), pairs)
        add(mode, "rewards/rejected", rejected_rewards.sum(), pairs)
        add(mode, "rewards/accuracies", (chosen_rewards > rejected_rewards).float().sum(), pairs)
        add(mode, "rewards/margins", (chosen_rewards - rejected_rewards).sum(), pairs)
        add(mode, "logps/chosen", logps[0].detach().sum(), pairs)
        add(mode, "logps/rejected", logps[1].detach().sum(), pairs)
