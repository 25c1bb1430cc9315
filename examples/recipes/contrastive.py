"""Contrastive learning: CLIP-style symmetric InfoNCE with in-batch negatives, as a Plugin.

Each sample comes as two paired views (here two "modalities": two different noisy projections of
the same latent point). A two-tower model embeds both; in a batch of B pairs, pair i is the positive
of view i and the other B - 1 are its negatives. ``InfoNCE`` wraps the ``compute_loss`` hook with

    logits = normalize(a) @ normalize(b).T / temperature
    loss = (cross_entropy(logits, arange(B)) + cross_entropy(logits.T, arange(B))) / 2

so the batch needs no labels: the "labels" are the diagonal. Run: ``python -m examples.recipes.contrastive``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from trainbus.engine import ConfigError, Engine, Event, Plugin, Priority


def info_nce(a: torch.Tensor, b: torch.Tensor, temperature: float) -> torch.Tensor:
    """Symmetric InfoNCE of paired embeddings ``a[i] <-> b[i]`` (cosine similarities / temperature)."""
    logits = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T / temperature
    targets = torch.arange(logits.shape[0], device=logits.device)
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


class InfoNCE(Plugin):
    """The loss of a model that returns ``(embeddings_a, embeddings_b)`` for a batch of pairs."""

    def __init__(self, temperature: float = 0.1) -> None:
        if not temperature > 0:
            raise ConfigError(f"temperature must be > 0, got {temperature!r}")
        self.temperature = float(temperature)

    def attach(self, engine: Engine) -> None:
        # the inner compute_loss (the model's own loss) is replaced, not called
        self.wrap_hook(engine, "compute_loss", lambda inner: self.loss)

    def loss(self, outputs: tuple[torch.Tensor, torch.Tensor], batch: Any) -> torch.Tensor:
        return info_nce(*outputs, self.temperature)


class TwoTowers(torch.nn.Module):
    """One encoder per view, into a shared 16-dimensional embedding space."""

    def __init__(self, dim_a: int = 12, dim_b: int = 20, dim: int = 16) -> None:
        super().__init__()
        self.tower_a = torch.nn.Sequential(torch.nn.Linear(dim_a, 32), torch.nn.ReLU(), torch.nn.Linear(32, dim))
        self.tower_b = torch.nn.Sequential(torch.nn.Linear(dim_b, 32), torch.nn.ReLU(), torch.nn.Linear(32, dim))

    def forward(self, view_a: torch.Tensor, view_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tower_a(view_a), self.tower_b(view_b)


def make_pairs(n: int = 512, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Pairs of views of a shared 6-dimensional latent point, through two fixed random maps plus noise."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 6, generator=g)
    a = z @ torch.randn(6, 12, generator=g) + 0.1 * torch.randn(n, 12, generator=g)
    b = torch.tanh(z @ torch.randn(6, 20, generator=g)) + 0.1 * torch.randn(n, 20, generator=g)
    return [{"view_a": a[i], "view_b": b[i]} for i in range(n)]  # dict batches: forward is model(**batch)


def retrieval_accuracy(model: TwoTowers, pairs: list[dict[str, torch.Tensor]]) -> float:
    """How often view a's nearest view b (cosine) is its own pair, among all the pairs."""
    with torch.no_grad():
        a, b = model.eval()(torch.stack([p["view_a"] for p in pairs]), torch.stack([p["view_b"] for p in pairs]))
        similarity = F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T
        return float((similarity.argmax(-1) == torch.arange(len(pairs))).float().mean())


def main(epochs: int = 8, temperature: float = 0.1, batch_size: int = 32) -> dict[str, Any]:
    torch.manual_seed(0)
    pairs = make_pairs()
    data = torch.utils.data.DataLoader(pairs, batch_size=batch_size, shuffle=True, drop_last=True)
    model = TwoTowers()
    engine = Engine(model, torch.optim.Adam(model.parameters(), lr=3e-3), train_data=data, max_epochs=epochs)
    engine.add_plugin(InfoNCE(temperature))
    losses: list[torch.Tensor] = []
    engine.on(Event.LOSS, lambda ev: losses.append(ev.loss.detach()), priority=Priority.CONSUMER)
    before = retrieval_accuracy(model, pairs[:128])
    engine.fit()
    result = {"losses": [float(v) for v in losses], "accuracy_before": before}
    result["accuracy_after"] = retrieval_accuracy(model, pairs[:128])
    print(
        f"contrastive: loss {sum(result['losses'][:8]) / 8:.3f} -> {sum(result['losses'][-8:]) / 8:.3f} "
        f"(chance: log {batch_size} = {torch.log(torch.tensor(float(batch_size))):.3f}), "
        f"top-1 retrieval among 128: {before:.2f} -> {result['accuracy_after']:.2f}"
    )
    return result


if __name__ == "__main__":
    main()
