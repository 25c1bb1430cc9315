"""Label smoothing (HF LabelSmoother semantics) and NEFTune (noise alpha / sqrt(L * d), training only)."""

from __future__ import annotations

import doctest
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from trainbus.engine import ConfigError, Engine, Event
from trainbus.plugins.optimization import regularization
from trainbus.plugins.optimization.regularization import LabelSmoothing, NEFTune, label_smoothed_loss


@st.composite
def logits_and_labels(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    classes = draw(st.integers(2, 6))
    shape = draw(st.sampled_from([(5,), (3, 4), (2, 3, 2)]))
    logits = 3 * torch.randn(*shape, classes, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, classes, shape, generator=generator)
    labels[torch.rand(shape, generator=generator) < draw(st.floats(0, 0.9))] = -100
    labels.view(-1)[0] = 1  # at least one active label: a mean over none is 0/0 for HF too
    return logits, labels


@given(logits_and_labels(), st.floats(0.0, 0.99))
def test_matches_hf_label_smoother_and_torch(case: tuple[torch.Tensor, torch.Tensor], epsilon: float) -> None:
    from transformers.trainer_pt_utils import LabelSmoother

    logits, labels = case
    ours = label_smoothed_loss(logits, labels, epsilon)
    hf = LabelSmoother(epsilon=epsilon)({"logits": logits}, labels)
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=1e-6)  # HF sums the smoothing term in float32
    flat = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), label_smoothing=epsilon)
    torch.testing.assert_close(ours, flat.to(ours.dtype), rtol=1e-6, atol=1e-6)


@given(logits_and_labels(), st.floats(0.0, 0.5))
def test_shifted_labels_match_hf(case: tuple[torch.Tensor, torch.Tensor], epsilon: float) -> None:
    from transformers.trainer_pt_utils import LabelSmoother

    logits, labels = case
    if labels.dim() < 2 or (labels[..., 1:] != -100).sum() == 0:
        labels = torch.ones(2, 3, dtype=torch.long)
        logits = torch.randn(2, 3, 4, dtype=torch.float64)
    ours = label_smoothed_loss(logits, labels, epsilon, shift_labels=True)
    hf = LabelSmoother(epsilon=epsilon)({"logits": logits}, labels, shift_labels=True)
    torch.testing.assert_close(ours, hf, rtol=1e-6, atol=1e-6)


class DictModel(torch.nn.Module):
    """An HF-style model: takes ``labels`` and computes its own (unsmoothed) loss when given them."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.got_labels: list[bool] = []

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, Any]:
        self.got_labels.append(labels is not None)
        logits = self.linear(x)
        out: dict[str, Any] = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def test_plugin_smooths_train_and_eval_loss_and_keeps_labels_from_the_model() -> None:
    torch.manual_seed(0)
    model = DictModel()
    batch = {"x": torch.randn(6, 4), "labels": torch.tensor([0, 1, 2, -100, 1, 0])}
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        train_data=[batch],
        max_epochs=1,
        plugins=[LabelSmoothing(0.2)],
    )
    losses: list[torch.Tensor] = []
    engine.on(Event.LOSS, lambda ev: losses.append(ev.loss.detach()))
    engine.fit()
    expected = F.cross_entropy(model.linear(batch["x"]), batch["labels"], label_smoothing=0.2)
    torch.testing.assert_close(losses[0], expected)
    assert model.got_labels == [False]  # HF pops the labels before forward too
    eval_loss, _, _ = engine.hooks.prediction_step(
        model, batch, engine.hooks.forward, engine.hooks.compute_loss, ("labels",)
    )
    torch.testing.assert_close(eval_loss, expected.detach())


def test_causal_lm_models_get_shifted_labels() -> None:
    class TinyForCausalLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(5, 5)

        def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"logits": self.embed(input_ids)}

    model = TinyForCausalLM()
    ids = torch.tensor([[1, 2, 3, 4]])
    batch = {"input_ids": ids, "labels": ids.clone()}
    engine = Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        train_data=[batch],
        max_epochs=1,
        plugins=[LabelSmoothing(0.1)],
    )
    loss = engine.hooks.compute_loss(engine.hooks.forward(model, batch), batch)
    torch.testing.assert_close(loss, label_smoothed_loss(model.embed(ids), ids, 0.1, shift_labels=True))


def test_bad_epsilon() -> None:
    for bad in (-0.1, 1.0, "0.1"):
        with pytest.raises(ConfigError, match="epsilon must be in"):
            LabelSmoothing(bad)  # type: ignore[arg-type]


class EmbeddingModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.head = torch.nn.Linear(6, 2)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(input_ids).mean(dim=1))


@given(st.floats(0.1, 20.0), st.integers(1, 6), st.integers(1, 3))
def test_neftune_noise_is_bounded_and_training_only(alpha: float, length: int, batch: int) -> None:
    model = EmbeddingModel()
    engine = Engine(model, plugins=[NEFTune(alpha)])
    ids = torch.randint(0, 10, (batch, length))
    clean = model.embed.weight[ids]
    noisy = model.embed(ids)
    bound = alpha / math.sqrt(length * 6)
    noise = (noisy - clean).abs()
    assert noise.max() <= bound + 1e-6 and noise.max() > 0
    model.eval()
    torch.testing.assert_close(model.embed(ids), clean)  # evaluation sees clean embeddings
    model.train()
    engine.pop_plugin(NEFTune)
    torch.testing.assert_close(model.embed(ids), clean)  # detached: the hook is gone


def test_neftune_in_a_training_run_with_an_hf_model() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8, num_labels=2
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    batch = {"input_ids": torch.randint(0, 30, (2, 5)), "labels": torch.tensor([0, 1])}
    engine = Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=[batch] * 2, max_epochs=1, plugins=[NEFTune(5.0)]
    )
    seen: list[torch.Tensor] = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, i, out: seen.append(out.detach()))
    engine.fit()
    handle.remove()
    # the recording hook runs after NEFTune's: what the model saw differs from the clean lookup
    clean = model.get_input_embeddings().weight[batch["input_ids"]]
    assert len(seen) == 2 and not torch.allclose(seen[-1], clean.detach())


def test_neftune_needs_embeddings() -> None:
    with pytest.raises(ConfigError, match="get_input_embeddings"):
        Engine(torch.nn.Linear(2, 2), plugins=[NEFTune(5.0)])
    with pytest.raises(ConfigError, match="alpha"):
        NEFTune(0.0)


def test_doctests() -> None:
    assert doctest.testmod(regularization).failed == 0
