"""Knowledge distillation as a Plugin: a frozen teacher's softened logits guide a student.

An HF script subclasses ``Trainer`` and overrides ``compute_loss``. Here ``Distillation`` replaces the
loss at ``Event.LOSS``: the engine has already computed the student's hard-label loss (``loss_fn``,
or the model's own loss), and the handler runs the teacher on the same batch under ``no_grad`` and
makes the loss

    alpha * hard + (1 - alpha) * T**2 * KL(softmax(teacher / T) || softmax(student / T))

(T**2 keeps the soft term's gradients on the scale of the hard one; Hinton et al., 2015). The
teacher is frozen and stays in eval mode. LOSS fires in training only, so ``evaluate()`` reports the
student's plain loss. Run: ``python -m examples.recipes.distillation``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainbus.engine import ConfigError, Engine, Event, LossEvent, Plugin, Priority
from trainbus.hooks import model_output


def distillation_loss(
    student: torch.Tensor, teacher: torch.Tensor, hard: torch.Tensor, temperature: float, alpha: float
) -> torch.Tensor:
    """``alpha * hard + (1 - alpha) * T**2 * KL(teacher_T || student_T)``, KL averaged over the batch."""
    log_p_student = F.log_softmax(student / temperature, dim=-1)
    log_p_teacher = F.log_softmax(teacher / temperature, dim=-1)
    soft = F.kl_div(log_p_student, log_p_teacher, log_target=True, reduction="batchmean")
    return alpha * hard + (1 - alpha) * temperature**2 * soft


class Distillation(Plugin):
    """Mix the hard-label loss with the KL to a frozen teacher (``alpha`` weights the hard loss)."""

    # LOSS handlers run in descending priority: this one must replace the loss before
    # GradientAccumulation (PRODUCER) normalises it and before loggers (CONSUMER) read it
    priority = Priority.PRODUCER + 10

    def __init__(self, teacher: torch.nn.Module, temperature: float = 2.0, alpha: float = 0.5) -> None:
        if not temperature > 0 or not 0.0 <= alpha <= 1.0:
            raise ConfigError(f"need temperature > 0 and 0 <= alpha <= 1, got {temperature=}, {alpha=}")
        self.teacher = teacher.eval().requires_grad_(False)
        self.temperature, self.alpha = float(temperature), float(alpha)

    def attach(self, engine: Engine) -> None:
        self.teacher.to(engine.device)
        self.on(engine, Event.TRAIN_START, lambda ev: self.teacher.eval())  # whatever happened since
        self.on(engine, Event.LOSS, self.mix)

    def mix(self, event: LossEvent) -> None:
        with torch.no_grad():  # the engine's forward hook: the same batch layout (and autocast, if any)
            teacher_logits = model_output(event.engine.hooks.forward(self.teacher, event.batch))
        student_logits = model_output(event.outputs)
        event.loss = distillation_loss(student_logits, teacher_logits, event.loss, self.temperature, self.alpha)


def make_data(n: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Three classes with a non-linear boundary, which a wide MLP learns better than a narrow one."""
    x = torch.randn(n, 8, generator=torch.Generator().manual_seed(seed))
    return x, (x[:, 0] * x[:, 1] > 0).long() + (x[:, 2] > 0.5).long()


def mlp(width: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 3))


def train(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, plugins=()) -> list[float]:
    """Train with Adam and cross-entropy; returns the loss of every step (what was backpropagated)."""
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    engine = Engine(
        model, torch.optim.Adam(model.parameters(), lr=1e-2), train_data=data, max_epochs=epochs,
        loss_fn=torch.nn.CrossEntropyLoss(), plugins=plugins,
    )  # fmt: skip
    losses: list[torch.Tensor] = []
    engine.on(Event.LOSS, lambda ev: losses.append(ev.loss.detach()), priority=Priority.CONSUMER)
    engine.fit()
    return [float(v) for v in losses]  # read once, after training: no host sync per step


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model.eval()(x).argmax(-1) == y).float().mean())


def main(epochs: int = 8, temperature: float = 2.0, alpha: float = 0.5) -> dict[str, object]:
    torch.manual_seed(0)
    x, y = make_data()
    teacher, student = mlp(64), mlp(8)
    train(teacher, x, y, epochs=12)  # a plain run: the teacher learns the labels first
    losses = train(student, x, y, epochs, [Distillation(teacher, temperature, alpha)])
    teacher_acc, student_acc = accuracy(teacher, x, y), accuracy(student, x, y)
    start, end = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    print(f"distillation: loss {start:.3f} -> {end:.3f}, accuracy teacher {teacher_acc:.2f} student {student_acc:.2f}")
    return {"losses": losses, "teacher_accuracy": teacher_acc, "student_accuracy": student_acc}


if __name__ == "__main__":
    main()
