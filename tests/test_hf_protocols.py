"""Protocols transformers models declare, read as transformers reads them (issue 34 item 3), run under both.

- whether a model's loss honours ``num_items_in_batch``: transformers' rule (loss kwargs, a labels tensor it
  counts), with the division measured where transformers assumes it. A detection model (YOLOS: labels are a
  list of per-image dicts, the loss ignores the count) trains on transformers' loss under accumulation 2;
  it trained on twice that when a source-text guess said its ``self.loss_function(...)`` divided.
- label names and "can this model return a loss": ``find_labels`` gives a CLIP model none, and its batches'
  ``return_loss`` makes evaluate / predict compute the contrastive loss (trainbus reported no eval_loss).
- the evaluation and prediction loaders are read one batch ahead (accelerate's DataLoaderShard), so random
  eval transforms draw the numbers they draw under transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.differential.hf_diff import (
    AlmostAccuracy,
    RegressionData,
    RegressionModel,
    assert_same_arrays,
    assert_same_logs,
    assert_same_metrics,
    assert_same_weights,
    run_both,
)

pytest.importorskip("scipy")  # transformers' Hungarian matcher for detection losses


# -- a detection model: YOLOS from a config (a ViT: no timm backbone) -----------------------------------------
def yolos() -> Any:
    from transformers import YolosConfig, YolosForObjectDetection

    torch.manual_seed(0)
    config = YolosConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                         image_size=[32, 32], patch_size=8, num_detection_tokens=4, num_labels=3,
                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return YolosForObjectDetection(config)


def detection_rows(n: int = 8) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(1)
    rows = []
    for i in range(n):
        boxes = 1 + i % 3
        target = {
            "class_labels": torch.randint(0, 3, (boxes,), generator=g),
            "boxes": torch.rand(boxes, 4, generator=g) * 0.5 + 0.25,
        }
        rows.append({"pixel_values": torch.randn(3, 32, 32, generator=g), "labels": target})
    return rows


def detection_collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """As transformers' object-detection example: images stacked, the targets a list of dicts."""
    return {"pixel_values": torch.stack([r["pixel_values"] for r in rows]), "labels": [r["labels"] for r in rows]}


def test_a_detection_model_trains_on_transformers_loss_under_accumulation(tmp_path: Path) -> None:
    rows = detection_rows()

    def scenario(impl: Any, workdir: Path) -> Any:
        args = impl.args(workdir, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=2,
                         logging_steps=1, save_strategy="no", learning_rate=1e-2, remove_unused_columns=False,
                         train_sampling_strategy="sequential")  # fmt: skip
        trainer = impl.Trainer(model=yolos(), args=args, train_dataset=rows, data_collator=detection_collate)
        trainer.train()
        return trainer

    hf, tb = run_both(scenario, tmp_path)
    assert_same_logs(hf.state.log_history, tb.state.log_history)
    assert_same_weights(hf.model, tb.model)
    # independent: step 1's loss is the mean of its two micro-batches' losses under the initial model (no
    # dropout), the loss each returns itself (transformers passes no count for a list of targets)
    model = yolos()
    first = [model(**detection_collate(rows[i : i + 2])).loss.item() for i in (0, 2)]
    assert hf.state.log_history[0]["loss"] == pytest.approx(sum(first) / 2, rel=1e-5)


# -- a model that returns a loss without labels: CLIP (contrastive image-text) ---------------------------------
def clip() -> Any:
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    text = {"vocab_size": 50, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 8}  # fmt: skip
    vision = {"hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 16, "patch_size": 8}  # fmt: skip
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))


def image_text_rows(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(1, 50, (6,), generator=g),
            "attention_mask": torch.ones(6, dtype=torch.long),
            "pixel_values": torch.randn(3, 16, 16, generator=g),
        }
        for _ in range(n)
    ]


def image_text_collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """As transformers' contrastive image-text example: the batch asks for the loss (``return_loss``)."""
    return {**{k: torch.stack([r[k] for r in rows]) for k in rows[0]}, "return_loss": True}


def contrastive_loss(model: Any, rows: list[dict[str, torch.Tensor]], batch_size: int) -> float:
    """Independent: the mean over batches of (CE(text->image) + CE(image->text)) / 2 on the model's logits."""
    losses = []
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            batch = {k: v for k, v in image_text_collate(rows[i : i + batch_size]).items() if k != "return_loss"}
            logits = model.eval()(**batch).logits_per_text
            target = torch.arange(len(logits))
            ce = torch.nn.functional.cross_entropy
            losses.append(((ce(logits, target) + ce(logits.T, target)) / 2).item())
    return sum(losses) / len(losses)


def test_a_model_returning_a_loss_without_labels_reports_eval_loss(tmp_path: Path) -> None:
    """transformers: label_names from ``find_labels`` (none for CLIP); with none, a batch's ``return_loss`` (else
    ``can_return_loss``) makes prediction_step compute the loss: eval_loss and test_loss are reported."""
    train, evals, tests = image_text_rows(8, 1), image_text_rows(8, 2), image_text_rows(8, 3)

    def scenario(impl: Any, workdir: Path) -> Any:
        args = impl.args(workdir, per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=2,
                         logging_steps=1, save_strategy="no", eval_strategy="steps", eval_steps=2,
                         remove_unused_columns=False, train_sampling_strategy="sequential")  # fmt: skip
        trainer = impl.Trainer(model=clip(), args=args, train_dataset=train, eval_dataset=evals,
                               data_collator=image_text_collate)  # fmt: skip
        trainer.train()
        return trainer, trainer.evaluate(), trainer.predict(tests)

    (hf, hf_eval, hf_pred), (tb, tb_eval, tb_pred) = run_both(scenario, tmp_path)
    assert list(tb.label_names) == hf.label_names == []
    assert_same_logs(hf.state.log_history, tb.state.log_history)  # the scheduled evaluation's eval_loss too
    assert_same_metrics(hf_eval, tb_eval)
    assert_same_metrics(hf_pred.metrics, tb_pred.metrics)
    assert len(hf_pred.predictions) == len(tb_pred.predictions)
    assert_same_arrays(hf_pred.predictions[:4], tb_pred.predictions[:4], atol=1e-5)  # logits, embeddings
    assert hf_pred.label_ids == tb_pred.label_ids == ()
    assert_same_weights(hf.model, tb.model)
    assert tb_eval["eval_loss"] == pytest.approx(contrastive_loss(tb.model, evals, 4), rel=1e-5)
    assert tb_pred.metrics["test_loss"] == pytest.approx(contrastive_loss(tb.model, tests, 4), rel=1e-5)


# -- evaluation and prediction loops read their loader one batch ahead, as accelerate reads it -------------------
class NoisyRegressionData(RegressionData):
    """A random eval transform: each sample's input gets noise drawn from torch's global generator."""

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = super().__getitem__(i)
        item["input_x"] = item["input_x"] + 0.1 * torch.randn(()).item()
        return item


class NoisyForward(RegressionModel):
    """A forward that draws in eval mode too: interleaved with the transform's draws, the order shows."""

    def forward(self, input_x: torch.Tensor, labels: torch.Tensor | None = None, **kwargs: Any) -> Any:
        y = input_x * self.a + self.b + 0.01 * torch.randn(())
        return (y,) if labels is None else (torch.nn.functional.mse_loss(y, labels), y)


def test_random_eval_transforms_draw_as_under_transformers(tmp_path: Path) -> None:
    """The eval loss, accuracy and predictions of scheduled evaluations, evaluate() and predict() agree (they drew
    batch i+1's noise after batch i's forward before: eval_loss 10.667 vs transformers' 10.636 at step 2)."""

    def scenario(impl: Any, workdir: Path) -> Any:
        args = impl.args(workdir, per_device_train_batch_size=8, per_device_eval_batch_size=8, max_steps=4,
                         logging_steps=2, save_strategy="no", eval_strategy="steps", eval_steps=2,
                         learning_rate=0.1)  # fmt: skip
        train, evals = NoisyRegressionData(32, seed=1), NoisyRegressionData(24, seed=2)
        trainer = impl.Trainer(model=NoisyForward(), args=args, train_dataset=train, eval_dataset=evals,
                               compute_metrics=AlmostAccuracy())  # fmt: skip
        trainer.train()
        return trainer, trainer.evaluate(), trainer.predict(NoisyRegressionData(24, seed=3))

    (hf, hf_eval, hf_pred), (tb, tb_eval, tb_pred) = run_both(scenario, tmp_path)
    assert_same_logs(hf.state.log_history, tb.state.log_history)
    assert_same_metrics(hf_eval, tb_eval)
    assert_same_metrics(hf_pred.metrics, tb_pred.metrics)
    assert_same_arrays(hf_pred.predictions, tb_pred.predictions)
    assert_same_arrays(hf_pred.label_ids, tb_pred.label_ids)


# -- an eval batch's loss stands for the dataset rows the loader put in it --------------------------------------
def packed_collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """A padding-free collator: the batch's rows side by side in one row (its first dimension is 1)."""
    return {k: torch.tensor([[float(r[k]) for r in rows]]) for k in ("input_x", "labels")}


def test_packed_eval_batches_weigh_their_rows_as_under_transformers(tmp_path: Path) -> None:
    """8 rows in batches of 3, 3, 2, each packed into one row: transformers weighs the batch means 3, 3, 2 (its
    eval_batch_size copies, the last cut to the rows left); trainbus weighed them 1, 1, 1 (their first dimension)."""
    data = RegressionData(8, seed=4)

    def scenario(impl: Any, workdir: Path) -> Any:
        args = impl.args(workdir, per_device_eval_batch_size=3, report_to="none")
        trainer = impl.Trainer(model=RegressionModel(a=1.0), args=args, data_collator=packed_collate)
        return trainer.evaluate(data), trainer.predict(data).metrics

    (hf_eval, hf_test), (tb_eval, tb_test) = run_both(scenario, tmp_path)
    assert_same_metrics(hf_eval, tb_eval)
    assert_same_metrics(hf_test, tb_test)
    means = [float(((data.x[i : i + 3] - data.ys[0][i : i + 3]) ** 2).mean()) for i in (0, 3, 6)]
    assert tb_eval["eval_loss"] == pytest.approx((3 * means[0] + 3 * means[1] + 2 * means[2]) / 8, rel=1e-6)


# -- a loader's .dataset is the dataset given (columns removed as transformers removes them) ------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_loaders_hold_the_dataset_given(workers: int, tmp_path: Path) -> None:
    """With workers too (trainbus's loaders fetch through a per-batch seeding wrapper, which ``.dataset`` showed)."""
    import datasets

    source = RegressionData(16)
    columns = {"input_x": source.x.tolist(), "labels": source.ys[0].tolist(), "note": ["x"] * 16}

    def scenario(impl: Any, workdir: Path) -> Any:
        found = []
        for make in (lambda: [source[i] for i in range(16)], lambda: RegressionData(16),
                     lambda: datasets.Dataset.from_dict(columns)):  # fmt: skip
            train, evals = make(), make()
            args = impl.args(workdir, per_device_train_batch_size=4, dataloader_num_workers=workers, max_steps=2)
            trainer = impl.Trainer(model=RegressionModel(), args=args, train_dataset=train, eval_dataset=evals)
            loaders = (
                trainer.get_train_dataloader(),
                trainer.get_eval_dataloader(),
                trainer.get_test_dataloader(evals),
            )
            for loader, given in zip(loaders, (train, evals, evals)):
                found.append((loader.dataset is given, type(loader.dataset).__name__,
                              getattr(loader.dataset, "column_names", None)))  # fmt: skip
            found.append(len(next(iter(loaders[0]))["labels"]))
        return found

    hf, tb = run_both(scenario, tmp_path)
    assert tb == hf
    assert tb[0] == (True, "list", None) and tb[-2] == (False, "Dataset", ["input_x", "labels"])
