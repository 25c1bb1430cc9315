"""Seq2SeqTrainer / Seq2SeqTrainingArguments against transformers' own, run side by side.

The acceptance is differential: tests/conformance/seq2seq_reverse.py (a tiny T5 learning to reverse
token sequences) runs once under transformers' Seq2SeqTrainer and once under trainbus's, only the
import differing, and every logged number, eval metric and generated prediction must agree. Where
transformers' number is not the quantity it names (eval loss over a partial last batch), an
independent computation shows it and pins trainbus's value.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hf_release
import numpy as np
import pytest
import torch
import transformers

from trainbus.engine import ConfigError
from trainbus.plugins import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainingArguments

SCRIPT = Path(__file__).parent / "conformance" / "seq2seq_reverse.py"
TIMING = ("_runtime", "_per_second")
IMPLEMENTATIONS = ("transformers", "trainbus")
#: train() metrics / all_results.json: transformers 5.24's train metrics carry no total_flos (a shared Trainer
#: matter, reported, not this facade's); it is still compared in every log_history record
TRAIN_ONLY_TRAINBUS = {"total_flos"}


def load_script() -> Any:
    spec = importlib.util.spec_from_file_location("seq2seq_reverse", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def numbers(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a log record or metrics dict that two runs must share (not timings)."""
    return {k: v for k, v in record.items() if isinstance(v, int | float) and not k.endswith(TIMING)}


@dataclasses.dataclass
class Run:
    """One run of the conformance script: what main returned, its log history and its output_dir."""

    results: dict[str, Any]
    log_history: list[dict[str, Any]]
    output_dir: Path


@pytest.fixture(scope="module", params=[0.0, 0.1], ids=["dropout0", "dropout0.1"])
def runs(request: Any, tmp_path_factory: Any) -> tuple[Run, Run]:
    """The conformance script under transformers, then trainbus: same seed, data and arguments."""
    script = load_script()
    base = tmp_path_factory.mktemp(f"seq2seq_{request.param}")
    inputs = script.write_inputs(base / "inputs")
    settings = {
        **inputs, "dropout": request.param, "seed": 42, "use_cpu": True, "report_to": "none", "disable_tqdm": True,
        "logging_steps": 1, "num_train_epochs": 3, "learning_rate": 5e-3, "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4, "eval_strategy": "epoch", "save_strategy": "no", "do_train": True,
        "do_eval": True, "do_predict": True, "predict_with_generate": True, "generation_max_length": 12,
        "num_beams": 2, "predict_max_length": 10,
    }  # fmt: skip
    out = []
    for name in IMPLEMENTATIONS:
        argv = [f"--output_dir={base / name}", f"--cache_dir={base / f'cache-{name}'}"]
        argv += [f"--{k}={v}" for k, v in settings.items()]
        results = script.main(argv, name)
        out.append(Run(results, results["trainer"].state.log_history, base / name))
    return out[0], out[1]


# -- the differential acceptance -----------------------------------------------------------------
def test_every_logged_number_matches_transformers(runs: tuple[Run, Run]) -> None:
    hf, tb = runs
    assert len(tb.log_history) == len(hf.log_history) == 36 + 3 + 1 + 1  # steps, epoch evals, summary, evaluate()
    for theirs, ours in zip(hf.log_history, tb.log_history, strict=True):
        expected, got = numbers(theirs), numbers(ours)
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            rounding = hf_release.loss_tolerance(value) if key == "loss" else 0.0  # 4.x logs round(loss, 4)
            assert got[key] == pytest.approx(value, rel=1e-5, abs=max(rounding, 1e-7)), (key, theirs)
    assert sum("loss" in r for r in tb.log_history) == 36
    evaluations = [r for r in tb.log_history if "eval_loss" in r]
    assert [r["epoch"] for r in evaluations] == [1.0, 2.0, 3.0, 3.0]
    assert all(0.0 < r["eval_gen_len"] <= 12 for r in evaluations)  # generated, generation_max_length=12
    train_theirs, train_ours = numbers(hf.results["train"]), numbers(tb.results["train"])
    assert set(train_ours) - set(train_theirs) <= TRAIN_ONLY_TRAINBUS
    for key, value in train_theirs.items():
        assert train_ours[key] == pytest.approx(value, rel=1e-5), key


def test_eval_metrics_on_generated_ids_match(runs: tuple[Run, Run]) -> None:
    hf, tb = runs
    expected, got = numbers(hf.results["eval"]), numbers(tb.results["eval"])
    assert sorted(got) == sorted(expected) == [
        "epoch", "eval_exact_match", "eval_gen_len", "eval_loss", "eval_samples", "eval_token_accuracy",
    ]  # fmt: skip
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.parametrize("run", ["predict", "predict_default"])
def test_predict_generates_the_same_token_ids(runs: tuple[Run, Run], run: str) -> None:
    hf, tb = runs
    ours, theirs = tb.results[run], hf.results[run]
    np.testing.assert_array_equal(ours.predictions, theirs.predictions)
    np.testing.assert_array_equal(ours.label_ids, theirs.label_ids)
    assert ours.predictions.shape == (9, 20)  # padded with the pad token to generation_config.max_length (20)
    assert (ours.predictions[:, 0] == 0).all()  # each starts with decoder_start_token_id
    if run == "predict":  # max_length=10 reached generate: nothing past it but padding
        assert (ours.predictions[:, 10:] == 0).all()
    else:  # generation_max_length=12
        assert (ours.predictions[:, 12:] == 0).all()
    expected, got = numbers(theirs.metrics), numbers(ours.metrics)
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        if not key.endswith("_loss"):  # the loss over a partial last batch: see the next test
            assert got[key] == pytest.approx(value, rel=1e-5), key


def test_predict_loss_is_the_mean_over_examples(runs: tuple[Run, Run]) -> None:
    """9 test examples in batches of 4, 4, 1: transformers repeats every batch's mean loss by the
    loader's batch size (4), so its loss is the plain mean of batch means; trainbus weights each
    batch by its real size, the mean over examples. The batch losses are recomputed here."""
    hf, tb = runs
    batch_losses, sizes = _batch_losses(tb.output_dir, batch_size=4)
    assert sizes == [4, 4, 1]
    per_example = float(np.average(batch_losses, weights=sizes))
    batch_mean = float(np.mean(batch_losses))
    for run in ("predict", "predict_default"):
        key = "predict_loss" if run == "predict" else "test_loss"
        assert tb.results[run].metrics[key] == pytest.approx(per_example, rel=1e-5)
        assert hf.results[run].metrics[key] == pytest.approx(batch_mean, rel=1e-5)
    assert not math.isclose(per_example, batch_mean, rel_tol=1e-3)  # the data shows the difference


def test_the_saved_model_folder_matches(runs: tuple[Run, Run]) -> None:
    from safetensors.torch import load_file

    hf, tb = runs
    theirs = {p.name for p in hf.output_dir.iterdir()} - {"training_args.bin"}  # trainbus writes no pickle
    ours = {p.name for p in tb.output_dir.iterdir()}
    assert theirs <= ours, sorted(theirs - ours)
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        assert json.loads((tb.output_dir / name).read_text()) == json.loads((hf.output_dir / name).read_text())
    weights_theirs, weights_ours = (load_file(run.output_dir / "model.safetensors") for run in (hf, tb))
    assert sorted(weights_ours) == sorted(weights_theirs)
    for key, tensor in weights_theirs.items():
        torch.testing.assert_close(weights_ours[key], tensor, rtol=0, atol=1e-5)


def _batch_losses(out: Path, batch_size: int) -> tuple[list[float], list[int]]:
    """The saved model's mean loss on each batch of the test split, computed without any trainer."""
    from transformers import AutoTokenizer, DataCollatorForSeq2Seq, T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(out).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    rows = [json.loads(line) for line in (out.parent / "inputs" / "test.json").read_text().splitlines()]
    features = [
        {"input_ids": tokenizer(r["source"])["input_ids"], "labels": tokenizer(r["target"])["input_ids"]} for r in rows
    ]
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    losses, sizes = [], []
    with torch.no_grad():
        for start in range(0, len(features), batch_size):
            batch = collator(features[start : start + batch_size])
            losses.append(float(model(**batch).loss))
            sizes.append(len(batch["labels"]))
    return losses, sizes


# -- generation details, on a stand-in model whose generate is known -------------------------------
class Reverser(torch.nn.Module):
    """A seq2seq stand-in: ``generate`` returns the padded input reversed (its width is the batch's)."""

    main_input_name = "input_ids"

    def __init__(self, max_length: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(12, 12)
        self.config = transformers.PretrainedConfig(pad_token_id=0)
        self.generation_config = transformers.GenerationConfig(max_length=max_length, pad_token_id=0)
        self.calls: list[dict[str, Any]] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.emb(input_ids)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out

    def generate(self, input_ids: torch.Tensor, labels: Any = None, **kwargs: Any) -> torch.Tensor:
        self.calls.append(kwargs)
        return torch.flip(input_ids, [1])


LENGTHS = [2, 5, 3, 3, 6]  # eval batches of 2: widths 5, 3, 6


def reverser_data() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(2, 12, (n,), generator=g).tolist() for n in LENGTHS]
    return [{"input_ids": r, "labels": r[::-1]} for r in rows]


def pad_collate(features: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    width = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), width, dtype=torch.long)
    labels = torch.full((len(features), width), -100, dtype=torch.long)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        labels[i, : len(f["labels"])] = torch.tensor(f["labels"])
    return {"input_ids": ids, "labels": labels}


def run_reverser(
    impl: str, tmp_path: Path, call: Callable[[Any], Any], model: Reverser | None = None, **arguments: Any
) -> tuple[Any, Reverser, list[Any]]:
    """``call(trainer)`` under transformers' or trainbus's Seq2SeqTrainer; what it returned, the model, the
    predictions compute_metrics saw."""
    if impl == "hf":
        trainer_cls, args_cls = transformers.Seq2SeqTrainer, transformers.Seq2SeqTrainingArguments
    else:
        trainer_cls, args_cls = Seq2SeqTrainer, Seq2SeqTrainingArguments
    seen: list[Any] = []

    def compute_metrics(p: Any) -> dict[str, float]:
        seen.append((p.predictions, p.label_ids))
        return {"rows": float(len(p.predictions))}

    model = model or Reverser()
    args = args_cls(
        output_dir=str(tmp_path / impl), per_device_eval_batch_size=2, use_cpu=True, report_to="none",
        disable_tqdm=True, save_strategy="no", **arguments,
    )  # fmt: skip
    data = reverser_data()
    trainer = trainer_cls(model, args, data_collator=pad_collate, eval_dataset=data, compute_metrics=compute_metrics)
    return call(trainer), model, seen


def test_ragged_generated_widths_pad_with_minus_100_as_transformers(tmp_path: Path) -> None:
    """Batches of generated ids wider than the generation max_length keep their width; the collector
    pads across batches with -100, and compute_metrics sees exactly transformers' arrays."""
    results = {
        impl: run_reverser(impl, tmp_path, lambda t: t.predict(reverser_data()), predict_with_generate=True)
        for impl in ("hf", "trainbus")
    }
    (theirs, _, _), (ours, model, _) = results["hf"], results["trainbus"]
    np.testing.assert_array_equal(ours.predictions, theirs.predictions)
    np.testing.assert_array_equal(ours.label_ids, theirs.label_ids)
    assert ours.predictions.shape == (5, 6)
    assert (ours.predictions[2:4, 3:] == -100).all()  # the 3-wide batch, padded by the collector
    first = torch.flip(pad_collate(reverser_data()[:2])["input_ids"], [1]).numpy()
    np.testing.assert_array_equal(ours.predictions[:2, :5], first)  # generate's output, as it was
    assert ours.metrics["test_rows"] == 5.0
    assert model.calls == [{"synced_gpus": False}] * 3  # no generation settings given: none passed


def test_generation_settings_reach_generate_as_in_transformers(tmp_path: Path) -> None:
    """generation_max_length / num_beams fill what evaluate() leaves out; a call's own gen_kwargs win and
    stay in force for later evaluations that pass none (transformers keeps them too)."""

    def calls(trainer: Any) -> list[Any]:
        trainer.evaluate()
        trainer.evaluate(max_new_tokens=4, num_beams=3, foo=1)
        trainer.model.calls.append("then")
        trainer.prediction_step(trainer.model, pad_collate(reverser_data()[:2]), prediction_loss_only=False)
        return trainer.model.calls

    settings = {"predict_with_generate": True, "generation_max_length": 7, "generation_num_beams": 2}
    theirs = run_reverser("hf", tmp_path, calls, **settings)[0]
    ours = run_reverser("trainbus", tmp_path, calls, **settings)[0]
    assert ours == theirs
    assert ours[0] == {"max_length": 7, "num_beams": 2, "synced_gpus": False}
    assert ours[3] == {"max_new_tokens": 4, "num_beams": 3, "foo": 1, "synced_gpus": False}
    assert ours[-1] == ours[3]


def test_evaluation_without_metrics_or_generate_flag_does_not_generate(tmp_path: Path) -> None:
    for impl in ("hf", "trainbus"):
        metrics, model, _ = run_reverser(impl, tmp_path, lambda t: t.evaluate(), predict_with_generate=False)
        assert model.calls == [] and "eval_rows" in metrics
        out, model, _ = run_reverser(impl, tmp_path, lambda t: t.predict(reverser_data()))
        assert model.calls == [] and out.predictions.ndim == 3  # logits, the Trainer's path
    args = Seq2SeqTrainingArguments(str(tmp_path / "x"), predict_with_generate=True, use_cpu=True)
    trainer = Seq2SeqTrainer(Reverser(), args, data_collator=pad_collate, eval_dataset=reverser_data())
    assert "eval_loss" in trainer.evaluate() and trainer.model.calls == []  # loss only: HF does not generate


@pytest.mark.parametrize("form", ["object", "directory", "file"])
def test_generation_config_replaces_the_models(tmp_path: Path, form: str) -> None:
    config = transformers.GenerationConfig(max_length=5, pad_token_id=0, num_beams=1)
    config.save_pretrained(tmp_path / "gen")
    value = {"object": config, "directory": str(tmp_path / "gen"), "file": tmp_path / "gen" / "generation_config.json"}
    outputs = {}
    for impl in ("hf", "trainbus"):
        outputs[impl], model, _ = run_reverser(
            impl, tmp_path, lambda t: t.predict(reverser_data()), predict_with_generate=True,
            generation_config=value[form],
        )  # fmt: skip
        assert model.generation_config.max_length == 5 and model.generation_config is not config
    np.testing.assert_array_equal(outputs["trainbus"].predictions, outputs["hf"].predictions)
    assert outputs["trainbus"].predictions.shape == (5, 6)
    assert (outputs["trainbus"].predictions[2:4, 3:5] == 0).all()  # padded to max_length 5 with the pad token


def test_a_generation_config_that_is_not_there_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither a GenerationConfig json file nor a directory"):
        run_reverser("trainbus", tmp_path, lambda t: t, generation_config=str(tmp_path / "missing"))
    bad = transformers.GenerationConfig(max_length=5)
    bad.temperature = 0.5  # without do_sample: a warning, which strict validation (HF's, here too) refuses
    with pytest.raises(ConfigError, match="Fix these issues"):
        run_reverser("trainbus", tmp_path, lambda t: t, generation_config=bad)


# -- the arguments ---------------------------------------------------------------------------------
def test_seq2seq_arguments_are_training_arguments_with_hf_defaults(tmp_path: Path) -> None:
    args = Seq2SeqTrainingArguments(str(tmp_path), predict_with_generate=True, learning_rate=1e-3, push_to_hub=False)
    assert isinstance(args, TrainingArguments)
    assert (args.predict_with_generate, args.learning_rate, args.sortish_sampler) == (True, 1e-3, False)
    theirs = transformers.Seq2SeqTrainingArguments(str(tmp_path))
    for name in ("sortish_sampler", "predict_with_generate", "generation_max_length", "generation_num_beams"):
        assert getattr(Seq2SeqTrainingArguments(str(tmp_path)), name) == getattr(theirs, name), name
    assert dataclasses.replace(args, generation_num_beams=2).generation_num_beams == 2
    gen = transformers.GenerationConfig(max_length=9)
    data = json.loads(json.dumps(Seq2SeqTrainingArguments(str(tmp_path), generation_config=gen).to_dict()))
    assert data["generation_config"]["max_length"] == 9


def test_seq2seq_arguments_parse_with_hf_argument_parser(tmp_path: Path) -> None:
    parser = transformers.HfArgumentParser(Seq2SeqTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        args=["--output_dir", str(tmp_path), "--predict_with_generate", "--generation_max_length", "7",
              "--generation_config", str(tmp_path / "gen"), "--learning_rate", "0.01"]
    )  # fmt: skip
    assert (args.predict_with_generate, args.generation_max_length, args.learning_rate) == (True, 7, 0.01)
    assert Path(args.generation_config) == tmp_path / "gen"
    config_file = tmp_path / "args.json"
    config_file.write_text(json.dumps({"output_dir": str(tmp_path), "generation_num_beams": 3}))
    (from_json,) = parser.parse_json_file(config_file)
    assert (from_json.generation_num_beams, from_json.predict_with_generate) == (3, False)
    with pytest.raises(ConfigError, match="sortish_sampler"):
        parser.parse_args_into_dataclasses(args=["--output_dir", str(tmp_path), "--sortish_sampler"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"predict_with_generat": True}, "did you mean 'predict_with_generate'"),
        ({"learning_rat": 1e-3}, "did you mean 'learning_rate'"),
        ({"push_to_hub": True}, "trainbus never uploads"),
        ({"sortish_sampler": True}, "train_sampling_strategy='group_by_length'"),
        ({"generation_num_beams": 0}, "generation_num_beams must be a positive int"),
        ({"generation_max_length": 2.5}, "generation_max_length must be"),
        ({"generation_config": 3}, "generation_config must be .*GenerationConfig"),
    ],
)
def test_bad_seq2seq_arguments_fail_early(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Seq2SeqTrainingArguments(str(tmp_path), **kwargs)


def test_seq2seq_trainer_needs_seq2seq_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs Seq2SeqTrainingArguments"):
        Seq2SeqTrainer(Reverser(), TrainingArguments(str(tmp_path), use_cpu=True))
