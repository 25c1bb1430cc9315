"""The question-answering Trainer subclass and post-processing, as transformers' examples/pytorch/question-answering
``trainer_qa.py`` and ``utils_qa.py`` are written (our own code, the same surface).

The subclass overrides ``evaluate`` and ``predict``: it runs ``evaluation_loop`` with ``compute_metrics``
set to None for the call, turns the start / end logits of the features into answer texts of the
examples, computes the metrics itself, logs them with ``self.log`` and calls
``self.callback_handler.on_evaluate``, keeping the control it returns. During training the Trainer's
own evaluation calls this ``evaluate``: its metrics are the ones ``metric_for_best_model`` reads.
``question_answering_trainer(Trainer)`` builds the class on the Trainer under test, as a port that
changes trainer_qa.py's import would.
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import string
import time
from typing import Any

import numpy as np
from transformers.trainer_utils import PredictionOutput, speed_metrics


def question_answering_trainer(base: type) -> type:
    """``QuestionAnsweringTrainer`` subclassing ``base`` (transformers' or trainbus's ``Trainer``)."""

    class QuestionAnsweringTrainer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, eval_examples: Any = None, post_process_function: Any = None, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.eval_examples = eval_examples
            self.post_process_function = post_process_function

        def _loop_without_metrics(self, dataloader: Any, description: str, ignore_keys: Any, prefix: str) -> Any:
            compute_metrics, self.compute_metrics = self.compute_metrics, None  # the metrics are computed below
            use_legacy = getattr(self.args, "use_legacy_prediction_loop", False)  # gone in transformers 5
            loop = self.prediction_loop if use_legacy else self.evaluation_loop
            start = time.time()
            try:
                output = loop(
                    dataloader, description=description, ignore_keys=ignore_keys, metric_key_prefix=prefix,
                    prediction_loss_only=True if compute_metrics is None else None,  # no predictions without metrics
                )  # fmt: skip
            finally:
                self.compute_metrics = compute_metrics
            start += output.metrics.get(f"{prefix}_jit_compilation_time", 0.0)
            batches = math.ceil(output.num_samples / (self.args.eval_batch_size * self.args.world_size))
            output.metrics.update(speed_metrics(prefix, start, num_samples=output.num_samples, num_steps=batches))
            return output

        def evaluate(
            self, eval_dataset: Any = None, eval_examples: Any = None, ignore_keys: Any = None,
            metric_key_prefix: str = "eval",
        ) -> dict[str, float]:  # fmt: skip
            self._memory_tracker.start()
            eval_dataset = self.eval_dataset if eval_dataset is None else eval_dataset
            eval_examples = self.eval_examples if eval_examples is None else eval_examples
            dataloader = self.get_eval_dataloader(eval_dataset)
            output = self._loop_without_metrics(dataloader, "Evaluation", ignore_keys, metric_key_prefix)
            if self.post_process_function is not None and self.compute_metrics is not None and self.args.should_save:
                predictions = self.post_process_function(eval_examples, eval_dataset, output.predictions)
                metrics = with_prefix(self.compute_metrics(predictions), metric_key_prefix)
                metrics.update(output.metrics)
            else:
                metrics = output.metrics
            if self.args.should_log:
                self.log(metrics)
            self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
            self._memory_tracker.stop_and_update_metrics(metrics)
            return metrics

        def predict(
            self, predict_dataset: Any, predict_examples: Any, ignore_keys: Any = None, metric_key_prefix: str = "test"
        ) -> Any:
            dataloader = self.get_test_dataloader(predict_dataset)
            output = self._loop_without_metrics(dataloader, "Prediction", ignore_keys, metric_key_prefix)
            if self.post_process_function is None or self.compute_metrics is None:
                return output
            predictions = self.post_process_function(predict_examples, predict_dataset, output.predictions, "predict")
            metrics = with_prefix(self.compute_metrics(predictions), metric_key_prefix)
            metrics.update(output.metrics)
            return PredictionOutput(predictions.predictions, predictions.label_ids, metrics)

    return QuestionAnsweringTrainer


def with_prefix(metrics: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {key if key.startswith(f"{prefix}_") else f"{prefix}_{key}": value for key, value in metrics.items()}


def postprocess_qa_predictions(
    examples: Any, features: Any, predictions: tuple[np.ndarray, np.ndarray], n_best_size: int = 5,
    max_answer_length: int = 8, output_dir: str | None = None, prefix: str | None = None,
) -> dict[str, str]:  # fmt: skip
    """The best answer text of each example: over its features, the span (start <= end, at most
    ``max_answer_length`` tokens, inside the context) with the highest start + end logit among the
    ``n_best_size`` best starts and ends. Logits past a feature's length are the loop's -100 padding."""
    start_logits, end_logits = predictions
    if len(start_logits) != len(features):
        raise ValueError(f"{len(start_logits)} predictions for {len(features)} features")
    features_of = collections.defaultdict(list)
    for i, example_id in enumerate(features["example_id"]):
        features_of[example_id].append(i)
    offset_mappings = features["offset_mapping"]
    answers = {}
    for example in examples:
        candidates = []
        for i in features_of[example["id"]]:
            offsets = offset_mappings[i]
            best_starts = np.argsort(start_logits[i], kind="stable")[::-1][:n_best_size]
            best_ends = np.argsort(end_logits[i], kind="stable")[::-1][:n_best_size]
            for s in best_starts:
                for e in best_ends:
                    if s >= len(offsets) or e >= len(offsets) or not offsets[s] or not offsets[e]:
                        continue  # padding, the question or a special token
                    if e < s or e - s + 1 > max_answer_length:
                        continue
                    score = float(start_logits[i][s] + end_logits[i][e])
                    candidates.append((score, offsets[s][0], offsets[e][1]))
        candidates.sort(key=lambda c: -c[0])
        answers[example["id"]] = example["context"][candidates[0][1] : candidates[0][2]] if candidates else ""
    if output_dir is not None:
        os.makedirs(output_dir, exist_ok=True)
        name = "predictions.json" if prefix is None else f"{prefix}_predictions.json"
        with open(os.path.join(output_dir, name), "w", encoding="utf-8") as f:
            json.dump(answers, f, indent=2)
    return answers


# -- SQuAD's metric (exact match and token F1 over normalised answers), in percent ---------------------
def normalize_answer(text: str) -> str:
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def token_f1(prediction: str, truth: str) -> float:
    predicted, expected = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = sum((collections.Counter(predicted) & collections.Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)


def squad_metrics(predictions: list[dict[str, Any]], references: list[dict[str, Any]]) -> dict[str, float]:
    truths = {r["id"]: r["answers"]["text"] for r in references}
    exact, f1 = [], []
    for p in predictions:
        answers = truths[p["id"]]
        exact.append(max(float(normalize_answer(p["prediction_text"]) == normalize_answer(a)) for a in answers))
        f1.append(max(token_f1(p["prediction_text"], a) for a in answers))
    return {"exact_match": 100.0 * float(np.mean(exact)), "f1": 100.0 * float(np.mean(f1))}
