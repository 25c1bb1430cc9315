"""Full half-precision evaluation: the model runs in bf16/fp16 outside training, and comes back exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from facade_helpers import Regressor, quiet_args, regression_data

from trainbus.engine import ConfigError, Engine, Event
from trainbus.plugins import EvalCollector, HalfPrecisionEval, Trainer, TrainingArguments


def classifier_engine(*plugins: object) -> Engine:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    g = torch.Generator().manual_seed(1)
    train = [(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(4)]
    return Engine(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        train_data=train,
        eval_data=train[:2],
        max_epochs=1,
        loss_fn=torch.nn.CrossEntropyLoss(),
        plugins=list(plugins),  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(("name", "dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_evaluate_runs_the_model_in_half_and_restores_the_exact_weights(name: str, dtype: torch.dtype) -> None:
    reference = classifier_engine(EvalCollector()).evaluate()
    engine = classifier_engine(EvalCollector(), HalfPrecisionEval(name))
    before = [t.detach().clone() for t in engine.model.state_dict().values()]
    dtypes: list[torch.dtype] = []
    engine.on(Event.EVAL_BATCH_END, lambda ev: dtypes.append(ev.logits.dtype))
    metrics = engine.evaluate()
    assert dtypes == [dtype, dtype]
    assert metrics["eval_loss"] == pytest.approx(reference["eval_loss"], rel=2e-2)
    after = list(engine.model.state_dict().values())
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(after, before))


def test_evaluations_inside_fit_keep_the_fp32_model() -> None:
    engine = classifier_engine(HalfPrecisionEval("bf16"))
    dtypes: list[torch.dtype] = []
    engine.on(Event.EVAL_BATCH_END, lambda ev: dtypes.append(ev.logits.dtype))
    engine.on(Event.STEP_END(every=2), lambda ev: setattr(ev.engine.control, "should_evaluate", True))
    engine.fit()
    assert dtypes == [torch.float32] * 4  # 2 evaluations x 2 batches, all fp32
    engine.evaluate()
    assert dtypes[-1] == torch.bfloat16


def test_an_evaluation_that_raises_never_leaves_a_half_model_to_train() -> None:
    engine = classifier_engine(HalfPrecisionEval("bf16"))

    def fail(ev: object) -> None:
        raise RuntimeError("metric exploded")

    before = [t.detach().clone() for t in engine.model.state_dict().values()]
    handle = engine.on(Event.EVAL_BATCH_END, fail)
    with pytest.raises(Exception, match="metric exploded"):
        engine.evaluate()
    after = list(engine.model.state_dict().values())  # EVAL_END's cleanup ran before the error got here
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(after, before, strict=True))
    handle.remove()
    engine.on(Event.PREDICT_BATCH_END, fail)
    with pytest.raises(Exception, match="metric exploded"):
        engine.predict([(torch.randn(2, 6), torch.zeros(2, dtype=torch.long))])
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())  # PREDICT_END's cleanup ran
    engine.fit()
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())


def test_trainer_bf16_full_eval(tmp_path: Path) -> None:
    trainer = Trainer(
        Regressor(),
        quiet_args(tmp_path, max_steps=4, bf16_full_eval=True),
        train_dataset=regression_data(16),
        eval_dataset=regression_data(8, 1),
    )
    trainer.train()
    metrics = trainer.evaluate()
    out = trainer.predict(regression_data(5, 2))
    assert metrics["eval_loss"] >= 0 and out.predictions.shape == (5,)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


def test_bad_full_eval_settings() -> None:
    with pytest.raises(ConfigError, match="at most one of fp16_full_eval and bf16_full_eval"):
        TrainingArguments("out", fp16_full_eval=True, bf16_full_eval=True)
    with pytest.raises(ConfigError, match="full eval dtype must be 'bf16' or 'fp16', got 'bf61'"):
        HalfPrecisionEval("bf61")


def test_docstring_example_runs() -> None:
    import doctest

    import trainbus.plugins.evaluation.half_eval

    assert doctest.testmod(trainbus.plugins.evaluation.half_eval).failed == 0
