"""The custom-training recipes of examples/recipes: each learns, and each one's mechanism is pinned.

Run from the repository root (``python -m pytest``), which puts the root on sys.path so that
``examples.recipes`` imports.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from examples.recipes import adversarial, contrastive, distillation, multitask
from trainbus.engine import Engine, Event, Priority
from trainbus.plugins import GradientAccumulation


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def grads_at_step(engine: Engine) -> dict[str, torch.Tensor]:
    """The gradients as the optimizer will see them (first BEFORE_OPTIMIZER_STEP handler), by name."""
    grads: dict[str, torch.Tensor] = {}

    def grab(ev: Any) -> None:
        if not grads:
            grads.update({n: p.grad.clone() for n, p in ev.engine.model.named_parameters() if p.grad is not None})

    engine.on(Event.BEFORE_OPTIMIZER_STEP, grab, priority=Priority.FIRST + 1)
    return grads


# -- knowledge distillation ----------------------------------------------------------------------
def test_distillation_learns() -> None:
    result = distillation.main()
    assert mean(result["losses"][-8:]) < 0.6 * mean(result["losses"][:8])
    assert result["teacher_accuracy"] > 0.85 and result["student_accuracy"] > 0.55


def distillation_engine(student: torch.nn.Module, batches: list[Any], plugins: list[Any]) -> Engine:
    return Engine(
        student, torch.optim.SGD(student.parameters(), lr=0.5), train_data=batches, max_epochs=1,
        loss_fn=torch.nn.CrossEntropyLoss(), plugins=plugins,
    )  # fmt: skip


def test_distillation_with_alpha_one_is_plain_cross_entropy_and_the_teacher_never_changes() -> None:
    torch.manual_seed(1)
    x, y = distillation.make_data(64)
    batches = [(x[:32], y[:32]), (x[32:], y[32:])]
    teacher = distillation.mlp(16)
    teacher_before = copy.deepcopy(teacher.state_dict())
    student = distillation.mlp(8)
    plain = copy.deepcopy(student)

    distilled_engine = distillation_engine(student, batches, [distillation.Distillation(teacher, 3.0, alpha=1.0)])
    teacher.train()  # whatever happens between construction and fit, the teacher runs in eval mode
    teacher_modes: list[bool] = []
    distilled_engine.on(Event.LOSS, lambda ev: teacher_modes.append(teacher.training))
    distilled = grads_at_step(distilled_engine)
    plain_engine = distillation_engine(plain, batches, [])
    reference = grads_at_step(plain_engine)
    distilled_engine.fit()
    plain_engine.fit()

    assert distilled.keys() == reference.keys() and len(reference) == 4
    for name in reference:  # the first step's gradients: the soft term, weighted 0, adds nothing
        torch.testing.assert_close(distilled[name], reference[name], rtol=0, atol=0)
    for p, q in zip(student.parameters(), plain.parameters()):  # and so every step
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert teacher_modes == [False, False]
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, teacher_before[name]), name
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())


def test_distillation_mixes_the_losses_before_accumulation_normalises_them() -> None:
    torch.manual_seed(2)
    x, y = distillation.make_data(32)
    batches = [(x[:16], y[:16]), (x[16:], y[16:])]  # one window of two equal micro-batches: weight 1/2 each
    teacher, student = distillation.mlp(16), distillation.mlp(8)
    plugins = [distillation.Distillation(teacher, temperature=3.0, alpha=0.25), GradientAccumulation(2)]
    engine = distillation_engine(student, batches, plugins)
    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    engine.on(
        Event.LOSS, lambda ev: seen.append((ev.loss.detach(), ev.outputs.detach(), ev.batch)), priority=Priority.LAST
    )
    engine.fit()

    assert len(seen) == 2
    for loss, student_logits, (inputs, labels) in seen:
        with torch.no_grad():
            t, s = teacher(inputs) / 3.0, student_logits / 3.0
        kl = (F.softmax(t, -1) * (F.log_softmax(t, -1) - F.log_softmax(s, -1))).sum(-1).mean()
        expected = 0.5 * (0.25 * F.cross_entropy(student_logits, labels) + 0.75 * 9.0 * kl)
        torch.testing.assert_close(loss, expected)


# -- multi-task ----------------------------------------------------------------------------------
@pytest.mark.parametrize("weights", ["uncertainty", {"cls": 1.0, "reg": 0.1}])
def test_multitask_learns_both_tasks(weights: Any) -> None:
    result = multitask.main(weights=weights)
    for task in ("cls", "reg"):
        assert mean(result[task][-12:]) < 0.6 * mean(result[task][:12]), task
    if weights == "uncertainty":  # the log-variances were trained, apart: the tasks' losses differ in scale
        assert result["log_vars"][0] < -0.2 and result["log_vars"][1] > 0.1


def multitask_engine(weights: Any, steps: int = 3) -> tuple[Engine, multitask.TaskWeighting]:
    torch.manual_seed(3)
    model = multitask.TwoHeads()
    data = torch.utils.data.DataLoader(multitask.make_data(64), batch_size=16)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.05), train_data=data, max_steps=steps)
    weighting = multitask.TaskWeighting({"cls": F.cross_entropy, "reg": F.mse_loss}, weights)
    engine.add_plugin(weighting)
    return engine, weighting


def test_multitask_loss_is_the_weighted_sum_of_the_head_losses() -> None:
    engine, _ = multitask_engine({"cls": 0.7, "reg": 0.2})
    checked: list[int] = []

    def check(ev: Any) -> None:
        labels = ev.batch[1]
        head = F.cross_entropy(ev.outputs["cls"], labels["cls"]), F.mse_loss(ev.outputs["reg"], labels["reg"])
        torch.testing.assert_close(ev.loss, 0.7 * head[0] + 0.2 * head[1], rtol=0, atol=0)
        torch.testing.assert_close(ev.engine.step_outputs["loss_cls"], head[0], rtol=0, atol=0)
        checked.append(1)

    engine.on(Event.LOSS, check)
    engine.fit()
    assert len(checked) == 3


def test_uncertainty_weighting_trains_its_log_variances_through_the_optimizer() -> None:
    engine, weighting = multitask_engine("uncertainty")
    assert weighting.log_vars is not None
    assert any(p is weighting.log_vars for group in engine.optimizer.param_groups for p in group["params"])
    log_vars, head_losses, log_var_grads = [], [], []

    def check(ev: Any) -> None:
        s = weighting.log_vars.detach().clone()
        labels = ev.batch[1]
        head = torch.stack(
            [F.cross_entropy(ev.outputs["cls"], labels["cls"]), F.mse_loss(ev.outputs["reg"], labels["reg"])]
        ).detach()
        torch.testing.assert_close(ev.loss.detach(), (torch.exp(-s) * head + s).sum())
        log_vars.append(s)
        head_losses.append(head)

    engine.on(Event.LOSS, check)
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: log_var_grads.append(weighting.log_vars.grad.clone()))
    engine.fit()

    assert len(log_vars) == len(log_var_grads) == 3
    assert torch.equal(log_vars[0], torch.zeros(2))
    # d/ds [exp(-s) L + s] = 1 - exp(-s) L, which is 1 - L at s = 0; one SGD step then moves s by -lr * that
    torch.testing.assert_close(log_var_grads[0], 1 - head_losses[0])
    torch.testing.assert_close(log_vars[1], -0.05 * (1 - head_losses[0]))
    assert set(weighting.state_dict()) == {"log_vars"}


# -- contrastive ---------------------------------------------------------------------------------
def test_contrastive_learns() -> None:
    result = contrastive.main()
    assert mean(result["losses"][-8:]) < 0.3 * mean(result["losses"][:8])
    assert result["accuracy_before"] < 0.2 and result["accuracy_after"] > 0.8


def info_nce_by_hand(a: list[list[float]], b: list[list[float]], temperature: float) -> float:
    """Symmetric InfoNCE with Python floats: cosine similarities, -log softmax of the diagonal, both ways."""

    def unit(v: list[float]) -> list[float]:
        norm = math.sqrt(sum(x * x for x in v))
        return [x / norm for x in v]

    ua, ub = [unit(v) for v in a], [unit(v) for v in b]
    sim = [[sum(p * q for p, q in zip(u, v)) / temperature for v in ub] for u in ua]
    n = len(sim)
    rows = [-sim[i][i] + math.log(sum(math.exp(sim[i][j]) for j in range(n))) for i in range(n)]
    cols = [-sim[j][j] + math.log(sum(math.exp(sim[i][j]) for i in range(n))) for j in range(n)]
    return (sum(rows) / n + sum(cols) / n) / 2


def test_info_nce_equals_the_hand_computed_loss() -> None:
    # orthonormal pairs: cos = 1 on the diagonal, 0 elsewhere, so loss = log(1 + (n - 1) exp(-1/T))
    eye = torch.eye(3)
    assert contrastive.info_nce(eye, 2 * eye, 0.5).item() == pytest.approx(math.log(1 + 2 * math.exp(-2.0)))
    a = torch.tensor([[1.0, 2.0], [-1.0, 0.5], [0.3, -2.0]])
    b = torch.tensor([[0.5, 1.0], [1.0, 1.0], [-0.2, -1.0]])
    assert contrastive.info_nce(a, b, 0.2).item() == pytest.approx(info_nce_by_hand(a.tolist(), b.tolist(), 0.2))
    assert contrastive.info_nce(a, b, 0.2).item() != pytest.approx(contrastive.info_nce(b, a.flip(0), 0.2).item())


def test_the_engine_trains_on_the_info_nce_of_the_model_outputs() -> None:
    torch.manual_seed(4)
    model = contrastive.TwoTowers()
    data = torch.utils.data.DataLoader(contrastive.make_pairs(12), batch_size=4)
    engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_epochs=1)
    engine.add_plugin(contrastive.InfoNCE(temperature=0.25))
    seen: list[tuple[float, float]] = []
    engine.on(
        Event.LOSS,
        lambda ev: seen.append(
            (ev.loss.item(), info_nce_by_hand(ev.outputs[0].tolist(), ev.outputs[1].tolist(), 0.25))
        ),
    )
    engine.fit()
    assert len(seen) == 3
    for loss, by_hand in seen:
        assert loss == pytest.approx(by_hand, rel=1e-5)


# -- adversarial (FGM) ---------------------------------------------------------------------------
def test_fgm_learns() -> None:
    result = adversarial.main()
    assert mean(result["losses"][-8:]) < 0.3 * mean(result["losses"][:8])
    assert result["accuracy"] > 0.9


def fgm_by_hand(model: torch.nn.Module, batches: list[Any], epsilon: float) -> dict[str, torch.Tensor]:
    """One window of FGM written out: clean backward, perturb, adversarial backward, restore.

    Micro-batches have equal sizes, so accumulation weights each loss by 1 / len(batches).
    """
    weight = model.embedding.weight
    for ids, labels in batches:
        (F.cross_entropy(model(ids), labels) / len(batches)).backward()
        saved = weight.detach().clone()
        with torch.no_grad():
            weight.add_(epsilon * weight.grad / weight.grad.norm())
        (F.cross_entropy(model(ids), labels) / len(batches)).backward()
        with torch.no_grad():
            weight.copy_(saved)
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def clean_and_adversarial_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, epsilon: float):
    """The two gradients of one micro-batch, each computed on its own copy of the model."""
    clean_model, adversarial_model = copy.deepcopy(model), copy.deepcopy(model)
    clean = torch.autograd.grad(F.cross_entropy(clean_model(ids), labels), list(clean_model.parameters()))
    g = clean[0]  # the embedding comes first in BagOfEmbeddings
    with torch.no_grad():
        adversarial_model.embedding.weight.add_(epsilon * g / g.norm())
    adversarial = torch.autograd.grad(
        F.cross_entropy(adversarial_model(ids), labels), list(adversarial_model.parameters())
    )
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, clean)), dict(zip(names, adversarial))


@pytest.mark.parametrize("window", [1, 2])
def test_fgm_gradients_and_weights_match_the_perturbation_applied_by_hand(window: int) -> None:
    torch.manual_seed(5)
    ids, labels = adversarial.make_data(16).tensors
    batches = [(ids[:8], labels[:8]), (ids[8:], labels[8:])][:window]
    model = adversarial.BagOfEmbeddings()
    fresh, before = copy.deepcopy(model), copy.deepcopy(model.state_dict())
    plugins = [adversarial.FGM(epsilon=0.5), GradientAccumulation(window)]
    engine = Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.3), train_data=batches, max_steps=1,
        loss_fn=torch.nn.CrossEntropyLoss(), plugins=plugins,
    )  # fmt: skip
    grads = grads_at_step(engine)
    at_step: list[torch.Tensor] = []
    engine.on(Event.BEFORE_OPTIMIZER_STEP, lambda ev: at_step.append(model.embedding.weight.detach().clone()))
    engine.fit()

    expected = fgm_by_hand(copy.deepcopy(fresh), batches, 0.5)
    assert grads.keys() == expected.keys() == before.keys()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=1e-6, atol=1e-7)
    if window == 1:  # the gradient is the clean one plus the adversarial one, and the latter is not zero
        clean, adv = clean_and_adversarial_grads(fresh, *batches[0], epsilon=0.5)
        for name in grads:
            torch.testing.assert_close(grads[name], clean[name] + adv[name], rtol=1e-6, atol=1e-7)
            assert adv[name].abs().max() > 1e-4
    # the optimizer saw the restored embedding, and the step changed it by -lr * grad only
    assert torch.equal(at_step[0], before["embedding.weight"])
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name] - 0.3 * expected[name], rtol=1e-6, atol=1e-7)


def test_fgm_restores_the_embedding_when_the_adversarial_pass_fails() -> None:
    class FailsOnSecondForward(adversarial.BagOfEmbeddings):
        calls = 0
        perturbed = False

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.calls == 2:
                self.perturbed = not torch.equal(self.embedding.weight, saved)
                raise RuntimeError("adversarial forward failed")
            return super().forward(ids)

    torch.manual_seed(6)
    model = FailsOnSecondForward()
    saved = model.embedding.weight.detach().clone()
    ids, labels = adversarial.make_data(8).tensors
    engine = Engine(
        model, torch.optim.SGD(model.parameters(), lr=0.3), train_data=[(ids, labels)], max_steps=1,
        loss_fn=torch.nn.CrossEntropyLoss(), plugins=[adversarial.FGM(epsilon=0.5)],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="adversarial forward failed") as info:
        engine.fit()
    assert info.value.trainbus_handler == "FGM.attack"  # type: ignore[attr-defined]
    assert model.perturbed  # the failure came while the embedding was perturbed ...
    assert torch.equal(model.embedding.weight, saved)  # ... and it was put back
    assert model.embedding.weight.grad is None  # the failed window left no gradient behind
