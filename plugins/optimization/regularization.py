"""Regularization plugins: label smoothing (a loss wrapper) and NEFTune (noisy input embeddings)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import ConfigTypeError, check_flag
from trainbus.hooks import get_labels, model_output

if TYPE_CHECKING:
    from trainbus.engine import Engine, TrainEndEvent, TrainStartEvent

IGNORE_INDEX = -100


def label_smoothed_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    epsilon: float,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: bool = False,
) -> torch.Tensor:
    """HF ``LabelSmoother``: ``(1 - eps) * nll + eps * mean(-log p over classes)``, averaged over active labels.

    Labels equal to ``ignore_index`` count for nothing. With ``shift_labels`` (causal LMs) logit ``t``
    predicts label ``t + 1``. For a mean over the active labels this equals
    ``F.cross_entropy(..., label_smoothing=eps, ignore_index=ignore_index)``.
    """
    if labels.is_floating_point() or labels.is_complex():  # a dtype read, no sync; gather's own error is cryptic
        raise ConfigError(
            f"label smoothing needs class indices as labels (an integer tensor), got {labels.dtype} "
            "labels; set label_smoothing_factor=0 for regression or soft (probability) labels"
        )
    if shift_labels:
        logits = logits[..., :-1, :].contiguous()
        labels = labels[..., 1:].contiguous()
    log_probs = -torch.nn.functional.log_softmax(logits, dim=-1)
    if labels.dim() == log_probs.dim() - 1:
        labels = labels.unsqueeze(-1)
    padding = labels.eq(ignore_index)
    # gather cannot take -100; padded positions are masked out below anyway
    nll = log_probs.gather(dim=-1, index=labels.clamp(min=0))
    smoothed = log_probs.sum(dim=-1, keepdim=True, dtype=torch.float32)
    nll = nll.masked_fill(padding, 0.0)
    smoothed = smoothed.masked_fill(padding, 0.0)
    active = padding.numel() - padding.long().sum()
    # divided before weighted, in HF's order: the gradients agree to the last bit
    nll_loss, smoothed_loss = nll.sum() / active, smoothed.sum() / (active * log_probs.shape[-1])
    return (1 - epsilon) * nll_loss + epsilon * smoothed_loss


def is_causal_lm(model: torch.nn.Module) -> bool:
    """HF shifts labels for causal language models; we recognise them by class name."""
    inner = getattr(model, "module", model)  # DDP
    name = type(inner).__name__
    return name.endswith("ForCausalLM") or name.endswith("LMHeadModel")


class LabelSmoothing(Plugin):
    """Replace the loss by a label-smoothed cross-entropy (HF ``label_smoothing_factor``).

    Wraps ``compute_loss``: the loss becomes ``label_smoothed_loss(logits, labels, epsilon)``
    with -100 labels ignored, in training and in evaluation as in HF. As HF does, the labels are
    taken out of dict batches before ``forward`` so a model does not compute its own loss too.

    Args:
        epsilon: the smoothing factor in [0, 1).
        shift_labels: shift labels by one (causal LM); None: detect from the model's class name.

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(4, 3)
        >>> data = [(torch.randn(8, 4), torch.randint(0, 3, (8,)))]
        >>> engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_epochs=1,
        ...                 loss_fn=torch.nn.CrossEntropyLoss(), plugins=[LabelSmoothing(0.1)])
        >>> engine.fit().global_step
        1
    """

    def __init__(
        self, epsilon: float = 0.1, *, shift_labels: bool | None = None, ignore_index: int = IGNORE_INDEX
    ) -> None:
        if isinstance(epsilon, bool) or not isinstance(epsilon, int | float) or not 0.0 <= epsilon < 1.0:
            raise ConfigError(f"label smoothing epsilon must be in [0, 1), got {epsilon!r}")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise ConfigTypeError(f"ignore_index must be an int (the label to skip, e.g. -100), got {ignore_index!r}")
        check_flag("shift_labels", shift_labels, allow_none=True)
        self.epsilon = float(epsilon)
        self.shift_labels = shift_labels
        self.ignore_index = ignore_index

    def attach(self, engine: Engine) -> None:
        shift = is_causal_lm(engine.model) if self.shift_labels is None else self.shift_labels
        label_names = engine.label_names

        def smoothed_forward(inner: Callable[..., Any]) -> Callable[..., Any]:
            def forward_without_labels(model: torch.nn.Module, batch: Any) -> Any:
                if isinstance(batch, Mapping) and any(k in batch for k in label_names):
                    batch = {k: v for k, v in batch.items() if k not in label_names}
                return inner(model, batch)

            return forward_without_labels

        def smoothed_loss(inner: Callable[..., Any]) -> Callable[..., Any]:
            def label_smoothed(outputs: Any, batch: Any) -> torch.Tensor:
                labels = get_labels(batch, label_names)
                if not isinstance(labels, torch.Tensor):
                    loss: torch.Tensor = inner(outputs, batch)  # no labels: nothing to smooth
                    return loss
                logits = model_output(outputs)
                return label_smoothed_loss(logits, labels, self.epsilon, self.ignore_index, shift)

            return label_smoothed

        self.wrap_hook(engine, "forward", smoothed_forward)
        self.wrap_hook(engine, "compute_loss", smoothed_loss)


def _input_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "module", model)  # DDP / accelerate wrappers
    getter = getattr(inner, "get_input_embeddings", None)
    embeddings = getter() if callable(getter) else None
    if not isinstance(embeddings, torch.nn.Module):
        raise ConfigError(
            f"NEFTune needs the input embeddings: {type(inner).__name__} has no get_input_embeddings(); "
            "pass NEFTune(alpha, embeddings=model.my_embedding)"
        )
    return embeddings


class NEFTune(Plugin):
    """Uniform noise on the input embeddings while training (HF ``neftune_noise_alpha``).

    Adds ``U(-m, m)`` with ``m = alpha / sqrt(L * d)`` (L: sequence length, d: embedding width) to the
    output of ``model.get_input_embeddings()`` when that module is in training mode; evaluation
    and prediction see clean embeddings.

    The forward hook is on the embeddings from ``attach`` and from every TRAIN_START, and is removed at
    TRAIN_END, also when training raises (HF's ``_deactivate_neftune`` at the end of ``train()``): after
    a run the model is left as it came, and a model saved or used after ``train()`` adds no noise.

    Args:
        alpha: noise scale (the NEFTune paper uses 5 to 15).
        embeddings: the embedding module; default ``model.get_input_embeddings()``.

    Example:
        >>> import torch
        >>> emb = torch.nn.Embedding(10, 4)
        >>> model = torch.nn.Sequential(emb)
        >>> from trainbus.engine import Engine
        >>> engine = Engine(model, plugins=[NEFTune(5.0, embeddings=emb)])
        >>> ids = torch.zeros(1, 3, dtype=torch.long)
        >>> bool((model(ids) != emb.weight[0]).any()), bool((model.eval()(ids) == emb.weight[0]).all())
        (True, True)
    """

    def __init__(self, alpha: float = 5.0, *, embeddings: torch.nn.Module | None = None) -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0 or math.isinf(alpha):
            raise ConfigError(f"NEFTune alpha must be a finite number > 0, got {alpha!r}")
        if embeddings is not None and not isinstance(embeddings, torch.nn.Module):
            raise ConfigTypeError(
                f"embeddings must be a torch.nn.Module (the input embeddings to add noise to) or None (the model's "
                f"get_input_embeddings()), got {embeddings!r} ({type(embeddings).__name__})"
            )
        self.alpha = float(alpha)
        self.embeddings = embeddings
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._hooked: torch.nn.Module | None = None  # the module the hook is on

    def attach(self, engine: Engine) -> None:
        self._activate(engine)
        self.on(engine, Event.TRAIN_START, self.train_start)
        # last, and also when training raised (cleanup): HF removes the hook as train() ends
        self.on(engine, Event.TRAIN_END, self.train_end, priority=Priority.LAST, cleanup=True)

    def detach(self, engine: Engine) -> None:
        self._deactivate()
        super().detach(engine)

    def train_start(self, ev: TrainStartEvent) -> None:
        self._activate(ev.engine)  # again after an earlier run's end removed it (HF activates in train())

    def train_end(self, ev: TrainEndEvent) -> None:
        self._deactivate()

    def _activate(self, engine: Engine) -> None:
        module = self.embeddings if self.embeddings is not None else _input_embeddings(engine.model)
        if self._hook is not None and self._hooked is module:
            return
        self._deactivate()  # on another module: the model was replaced (model_init at train())
        self._hook = module.register_forward_hook(self._noise)
        self._hooked = module

    def _deactivate(self) -> None:
        if self._hook is not None:
            self._hook.remove()
        self._hook = None
        self._hooked = None

    def _noise(self, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not module.training:
            return None
        # HF's neftune_post_forward_hook: dims = L * d of the (batch, L, d) embeddings
        dims = output.size(-2) * output.size(-1) if output.dim() >= 2 else output.numel()
        magnitude = self.alpha / math.sqrt(dims)
        return output + torch.zeros_like(output).uniform_(-magnitude, magnitude)
