"""Multi-task learning: a shared trunk with two heads, and a Plugin that weights the task losses.

The model returns one output per task (``{"cls": logits, "reg": values}``) and the batch carries
one label per task (``(x, {"cls": ..., "reg": ...})``). ``TaskWeighting`` wraps the ``compute_loss``
hook with the weighted sum of per-task losses, either with fixed weights or with the uncertainty
weighting of Kendall, Gal & Cipolla (2018): ``sum_i exp(-s_i) * L_i + s_i`` with learnable
log-variances ``s_i``, which the plugin adds to the engine's optimizer (a new parameter group) so
they train with the model. The latest task losses are published in ``engine.step_outputs``
(``loss_cls``, ``loss_reg``) as device tensors. Run: ``python -m examples.recipes.multitask``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from trainbus.engine import ConfigError, Engine, Event, Plugin, Priority
from trainbus.hooks import get_labels


class TaskWeighting(Plugin):
    """Loss = sum of ``weights[task] * loss_fns[task](outputs[task], labels[task])``.

    ``weights="uncertainty"`` learns the weights instead (one log-variance per task, starting at 0).
    """

    def __init__(self, loss_fns: Mapping[str, Callable[..., torch.Tensor]], weights: Any = None) -> None:
        self.loss_fns = dict(loss_fns)
        self.uncertainty = weights == "uncertainty"
        self.weights = {t: 1.0 for t in self.loss_fns} if weights is None or self.uncertainty else dict(weights)
        if set(self.weights) != set(self.loss_fns):
            raise ConfigError(f"weights {sorted(self.weights)} must name the tasks {sorted(self.loss_fns)}")
        self.log_vars = torch.nn.Parameter(torch.zeros(len(self.loss_fns))) if self.uncertainty else None

    def attach(self, engine: Engine) -> None:
        if self.log_vars is not None:
            if engine.optimizer is None:
                raise ConfigError("uncertainty weighting trains log-variances: give the Engine its optimizer first")
            self.log_vars.data = self.log_vars.data.to(engine.device)
            if not any(p is self.log_vars for g in engine.optimizer.param_groups for p in g["params"]):
                engine.optimizer.add_param_group({"params": [self.log_vars], "weight_decay": 0.0})
        # the inner compute_loss (the model's own loss) is replaced, not called
        self.wrap_hook(engine, "compute_loss", lambda inner: lambda outputs, batch: self.loss(engine, outputs, batch))

    def task_losses(self, outputs: Mapping[str, Any], labels: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return {task: fn(outputs[task], labels[task]) for task, fn in self.loss_fns.items()}

    def loss(self, engine: Engine, outputs: Mapping[str, Any], batch: Any) -> torch.Tensor:
        losses = self.task_losses(outputs, get_labels(batch, engine.label_names))
        if torch.is_grad_enabled():  # training, not evaluate(): publish the task losses for loggers
            engine.step_outputs.update({f"loss_{task}": value.detach() for task, value in losses.items()})
        if self.log_vars is None:
            return sum(self.weights[t] * value for t, value in losses.items())  # type: ignore[return-value]
        stacked = torch.stack(list(losses.values()))
        return (torch.exp(-self.log_vars) * stacked + self.log_vars).sum()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.log_vars is None else {"log_vars": self.log_vars.detach().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.log_vars is not None:
            self.log_vars.data.copy_(state["log_vars"])


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU())
        self.cls, self.reg = torch.nn.Linear(32, 3), torch.nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        return {"cls": self.cls(h), "reg": self.reg(h).squeeze(-1)}


def make_data(n: int = 384, seed: int = 0) -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """Samples ``(x, {"cls": 3-class label, "reg": target on another scale})``; a DataLoader collates them."""
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    cls, reg = (x[:, 0] > 0).long() + (x[:, 1] > 0).long(), 3 * x[:, 2] - 2 * x[:, 3] * x[:, 0]
    return [(x[i], {"cls": cls[i], "reg": reg[i]}) for i in range(n)]


def main(epochs: int = 10, weights: Any = "uncertainty") -> dict[str, Any]:
    torch.manual_seed(0)
    model = TwoHeads()
    data = torch.utils.data.DataLoader(make_data(), batch_size=32, shuffle=True)
    engine = Engine(model, torch.optim.Adam(model.parameters(), lr=1e-2), train_data=data, max_epochs=epochs)
    weighting = TaskWeighting({"cls": F.cross_entropy, "reg": F.mse_loss}, weights)
    engine.add_plugin(weighting)  # after the optimizer exists: it adds the log-variances to it
    steps: list[dict[str, torch.Tensor]] = []
    engine.on(Event.STEP_END, lambda ev: steps.append(dict(ev.engine.step_outputs)), priority=Priority.CONSUMER)
    engine.fit()
    result: dict[str, Any] = {task: [float(step[f"loss_{task}"]) for step in steps] for task in ("cls", "reg")}
    result["log_vars"] = None if weighting.log_vars is None else weighting.log_vars.detach().tolist()
    start, end = ({k: sum(result[k][s]) / 12 for k in ("cls", "reg")} for s in (slice(12), slice(-12, None)))
    print(
        f"multitask ({weights or 'equal weights'}): cls loss {start['cls']:.3f} -> {end['cls']:.3f}, "
        f"reg loss {start['reg']:.3f} -> {end['reg']:.3f}, log-variances {result['log_vars']}"
    )
    return result


if __name__ == "__main__":
    main()
