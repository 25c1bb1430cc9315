"""Adversarial training with FGM (fast gradient method) on the embedding weights, as a Plugin.

HF scripts override ``training_step`` for this. ``FGM`` needs no override: at ``Event.BACKWARD_END``
the clean gradient of the micro-batch is in ``embedding.weight.grad``; the handler adds
``r = epsilon * grad / ||grad||`` to the embedding weights, runs forward + loss + backward again on
the same batch (so ``.grad`` becomes clean + adversarial), and restores the saved weights in a
``finally`` block: the restore happens even when the adversarial pass raises, and before the next
micro-batch or the optimizer step (BEFORE_OPTIMIZER_STEP) can see perturbed weights. The batch and
the loss as ``compute_loss`` returned it are remembered at ``Event.LOSS``.

Loss handlers that rescale the loss (``GradientAccumulation``'s item weights) scale the adversarial
loss by the same factor; a handler that replaces the loss with another quantity does not apply to
it. Under accumulation the direction uses the window's gradient so far, as reference FGM code does.
Run: ``python -m examples.recipes.adversarial``.
"""

from __future__ import annotations

from typing import Any

import torch

from trainbus.engine import BackwardEndEvent, ConfigError, Engine, Event, LossEvent, Plugin, Priority


class FGM(Plugin):
    """Perturb ``embedding.weight`` along its normalised gradient and backpropagate once more."""

    def __init__(self, epsilon: float = 1.0, embedding: torch.nn.Module | None = None) -> None:
        if not epsilon > 0:
            raise ConfigError(f"epsilon must be > 0, got {epsilon!r}")
        self.epsilon, self.embedding = float(epsilon), embedding
        self._batch: Any = None
        self._raw_loss: Any = None

    def attach(self, engine: Engine) -> None:
        if self.embedding is None:
            found = [m for m in engine.model.modules() if isinstance(m, torch.nn.Embedding)]
            if not found:
                raise ConfigError("FGM found no torch.nn.Embedding in the model: pass FGM(embedding=...)")
            self.embedding = found[0]
        self.on(engine, Event.LOSS, self.remember, priority=Priority.FIRST)  # before any handler rescales it
        self.on(engine, Event.BACKWARD_END, self.attack)

    def remember(self, event: LossEvent) -> None:
        self._batch, self._raw_loss = event.batch, event.loss

    def attack(self, event: BackwardEndEvent) -> None:
        assert self.embedding is not None
        weight, engine = self.embedding.weight, event.engine
        batch, raw, self._batch, self._raw_loss = self._batch, self._raw_loss, None, None
        if weight.grad is None:  # the embedding took no part in this micro-batch
            return
        scale = 1.0 if event.loss is raw else (event.loss / raw).detach()  # what LOSS handlers applied
        saved = weight.detach().clone()
        try:
            with torch.no_grad():
                weight.add_(self.epsilon * weight.grad / weight.grad.norm().clamp_min(1e-12))
            outputs = engine.hooks.forward(engine.model, batch)
            adversarial = engine.hooks.compute_loss(outputs, batch) * scale
            del outputs
            engine.hooks.backward(adversarial)  # accumulates into .grad: clean + adversarial
        finally:
            with torch.no_grad():
                weight.copy_(saved)  # bit-exact restore (subtracting r again would round)


class BagOfEmbeddings(torch.nn.Module):
    def __init__(self, vocab: int = 40, dim: int = 16) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Sequential(torch.nn.Linear(dim, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1))


def make_data(n: int = 512, length: int = 12, vocab: int = 40, seed: int = 0) -> torch.utils.data.TensorDataset:
    """Token sequences labelled 1 when most of their tokens come from the lower half of the vocabulary."""
    ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.TensorDataset(ids, ((ids < vocab // 2).sum(1) > length // 2).long())


def main(epochs: int = 8, epsilon: float = 1.0) -> dict[str, Any]:
    torch.manual_seed(0)
    data = make_data()
    model = BagOfEmbeddings()
    engine = Engine(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), max_epochs=epochs, loss_fn=torch.nn.CrossEntropyLoss(),
        train_data=torch.utils.data.DataLoader(data, batch_size=32, shuffle=True), plugins=[FGM(epsilon)],
    )  # fmt: skip
    losses: list[torch.Tensor] = []
    engine.on(Event.LOSS, lambda ev: losses.append(ev.loss.detach()), priority=Priority.CONSUMER)  # the clean loss
    engine.fit()
    ids, labels = data.tensors
    with torch.no_grad():
        accuracy = float((model.eval()(ids).argmax(-1) == labels).float().mean())
    result = {"losses": [float(v) for v in losses], "accuracy": accuracy}
    start, end = sum(result["losses"][:8]) / 8, sum(result["losses"][-8:]) / 8
    print(f"FGM: clean loss {start:.3f} -> {end:.3f}, accuracy {accuracy:.2f}")
    return result


if __name__ == "__main__":
    main()
