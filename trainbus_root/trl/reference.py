"""The DPO reference policy as a plugin: a frozen model, the policy with its adapter switched off, or
log-probabilities computed once before training (``precompute_ref_log_probs``).

``ReferencePolicy.log_probs(batch)`` gives each sequence's summed completion log-probability under the
reference, computed as TRL computes it (its fused LM head, no gradient, gradient checkpointing off for that
forward). With a peft policy and no reference model the reference is the base model (adapters disabled),
or the frozen copy of a pretrained adapter named "ref" (TRL's convention).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import Plugin

from . import setup

if TYPE_CHECKING:
    from trainbus.engine import Engine

#: the batch keys that are not model inputs (TRL's ``_non_model_keys``)
NON_MODEL_KEYS = frozenset({"completion_mask", "ref_chosen_logps", "ref_rejected_logps"})


def model_inputs(batch: Any) -> dict[str, Any]:
    """A preference batch as TRL calls the model: the completion tokens as labels, no cache, the fused head."""
    inputs = {k: v for k, v in batch.items() if k not in NON_MODEL_KEYS}
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    return {**inputs, "use_cache": False, "labels": labels, "fused_lm_head": True}


def sequence_log_probs(per_token: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Each row's summed completion log-probability (the fused head's are 0 off the completion)."""
    return per_token[:, -(completion_mask.size(1) - 1) :].sum(dim=1)


class ReferencePolicy(Plugin):  # type: ignore[misc]  # mypy reads trainbus.* as Any
    """Reference log-probabilities for DPO. Holds no state: the reference never changes.

    Args:
        ref_model: a frozen causal LM (its fused head added), or None (the policy with adapters off).
        gradient_checkpointing_kwargs: the run's, so the policy's checkpointing is switched off and back.
    """

    def __init__(self, ref_model: Any, gradient_checkpointing_kwargs: Any = None) -> None:
        self.ref_model = ref_model
        self.checkpointing_kwargs = gradient_checkpointing_kwargs
        self._engine: Any = None

    def attach(self, engine: Engine) -> None:
        self._engine = engine
        if self.ref_model is not None:
            self.ref_model.to(engine.device)

    def log_probs(self, batch: Any, policy: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen, rejected)`` summed completion log-probabilities: read from the batch when precomputed."""
        if "ref_chosen_logps" in batch:
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        policy = policy if policy is not None else self._engine.model
        model, switch = self._reference_for(policy)
        from trl.models.utils import disable_gradient_checkpointing

        with torch.no_grad(), disable_gradient_checkpointing(policy, self.checkpointing_kwargs), switch:
            per_token = model(**model_inputs(batch)).log_probs
        chosen, rejected = sequence_log_probs(per_token, batch["completion_mask"]).chunk(2, dim=0)
        return chosen, rejected

    def _reference_for(self, policy: Any) -> tuple[Any, Any]:
        if self.ref_model is not None:
            return self.ref_model, contextlib.nullcontext()
        if not setup.is_peft(policy):
            raise ValueError("DPO without a ref_model needs a peft policy (its base is the reference)")
        from trl.trainer.utils import use_adapter

        return policy, use_adapter(policy, adapter_name="ref" if "ref" in policy.peft_config else None)


def precompute(dataset: Any, collator: Any, batch_size: int, reference: ReferencePolicy, policy: Any) -> Any:
    """``dataset`` with TRL's ``ref_chosen_logps`` / ``ref_rejected_logps`` columns (float32), computed in order."""
    from datasets import Dataset, Features, Value, concatenate_datasets

    device = next(policy.parameters()).device
    chosen, rejected = [], []
    for start in range(0, len(dataset), batch_size):
        rows = [dataset[i] for i in range(start, min(start + batch_size, len(dataset)))]
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in collator(rows).items()}
        c, r = reference.log_probs(batch, policy)
        chosen.append(c.float().cpu())
        rejected.append(r.float().cpu())
    features = Features({"ref_chosen_logps": Value("float32"), "ref_rejected_logps": Value("float32")})
    columns = Dataset.from_dict(
        {"ref_chosen_logps": torch.cat(chosen).tolist(), "ref_rejected_logps": torch.cat(rejected).tolist()},
        features=features,
    )
    return concatenate_datasets([dataset, columns], axis=1)
