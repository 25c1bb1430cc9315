"""The model card: README.md next to the saved model, with results, curves, data sizes, arguments, versions;
its YAML metadata as transformers' create_model_card writes it (a differential check on the same run)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from facade_helpers import Regressor, accuracy, quiet_args, regression_data, tiny_bert, token_data

from trainbus.plugins import Trainer
from trainbus.plugins.facade.model_card import eval_results, read_front_matter, results_table, write_model_card


def test_model_card_describes_the_run(tmp_path: Path) -> None:
    args = quiet_args(tmp_path, max_steps=6, logging_steps=2, eval_strategy="steps", eval_steps=3,
                      learning_rate=0.05, gradient_accumulation_steps=2)  # fmt: skip
    trainer = Trainer(Regressor(), args, train_dataset=regression_data(24), eval_dataset=regression_data(8))
    trainer.train()
    trainer.save_model()
    assert not (tmp_path / "README.md").exists()  # save_model writes no card, as transformers' (create_model_card does)
    trainer.create_model_card()
    saved_card = (tmp_path / "README.md").read_text()
    rows = [line for line in saved_card.splitlines() if line.startswith("| ") and "Training Loss" not in line]
    evals = [r for r in trainer.state.log_history if "eval_loss" in r]
    losses = [r for r in trainer.state.log_history if "loss" in r]
    assert len(rows) == len(evals) == 2
    for row, record in zip(rows, evals):  # each row: the loss logged before that evaluation, and its metrics
        cells = [c.strip() for c in row.strip("|").split("|")]
        before = [r["loss"] for r in losses if r["step"] <= record["step"]][-1]
        assert cells == [f"{before:.4g}", f"{record['epoch']:.4g}", str(record["step"]), f"{record['eval_loss']:.4g}"]
    card = write_model_card(trainer, model_name="tiny-regressor", license="apache-2.0", tags=["regression"],
                            finetuned_from="nothing/scratch")  # fmt: skip
    text = card.read_text()
    assert card == tmp_path / "README.md"
    assert read_front_matter(card) == {
        "library_name": "trainbus",  # a plain torch module: not transformers' to load
        "license": "apache-2.0",
        "base_model": "nothing/scratch",
        "tags": ["regression", "generated_from_trainer"],
        "model-index": [{"name": "tiny-regressor", "results": []}],
    }
    assert "# tiny-regressor" in text
    origin = "fine-tuned version of [nothing/scratch](https://huggingface.co/nothing/scratch) on an unknown dataset"
    assert f"This model (Regressor) is a {origin}, made with trainbus." in text
    final = [r for r in trainer.state.log_history if "eval_loss" in r][-1]
    assert f"- Loss: {final['eval_loss']:.4g}" in text
    assert "- training samples: 24" in text and "- evaluation samples: 8" in text
    assert "- learning_rate: 0.05" in text and "- gradient_accumulation_steps: 2" in text
    assert "- total train batch size: 8" in text
    assert "| Training Loss | Epoch | Step | Loss |" in text and text.count("\n| ") >= 3
    assert "![training curves](training_curves.png)" in text and (tmp_path / "training_curves.png").is_file()
    # the installed package's version (a CUDA wheel's torch.__version__ may carry a "+cu128" its metadata lacks)
    torch_version = importlib.metadata.version("torch")
    assert f"\n- torch {torch_version}\n" in text and "- trainbus " in text
    assert torch_version.split("+")[0] == torch.__version__.split("+")[0]
    assert (tmp_path / "model.safetensors").is_file()  # the card sits next to the saved model


def test_results_table_rows_follow_the_evaluations() -> None:
    history = [
        {"loss": 2.0, "epoch": 0.5, "step": 1},
        {"eval_loss": 1.5, "eval_accuracy": 0.25, "eval_runtime": 0.1, "epoch": 0.5, "step": 1},
        {"eval_loss": 1.0, "eval_accuracy": 0.5, "epoch": 1.0, "step": 2},
    ]
    assert results_table(history) == [
        "| Training Loss | Epoch | Step | Loss | Accuracy |",
        "|---|---|---|---|---|",
        "| 2 | 0.5 | 1 | 1.5 | 0.25 |",  # floats to 4 significant digits
        "| 2 | 1 | 2 | 1 | 0.5 |",
    ]
    assert results_table([{"loss": 1.0, "step": 1}]) == []


# -- the metadata, against transformers.Trainer.create_model_card on the same run -------------------------
def _glue_like(n: int, split: str) -> Any:
    """A datasets.Dataset that says it is GLUE's mrpc (its builder and config), made here, not downloaded."""
    datasets = pytest.importorskip("datasets")
    g = torch.Generator().manual_seed(1 if split == "train" else 2)
    rows = {"input_ids": torch.randint(1, 100, (n, 8), generator=g).tolist(), "attention_mask": [[1] * 8] * n,
            "label": [i % 2 for i in range(n)]}  # fmt: skip
    return datasets.Dataset.from_dict(rows, info=datasets.DatasetInfo(builder_name="glue", config_name="mrpc"),
                                      split=split)  # fmt: skip


def _cards(tmp_path: Path, calls: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Train a tiny BERT under each implementation, then call create_model_card(**kwargs) for each of calls;
    the metadata of each README written."""
    transformers = pytest.importorskip("transformers")
    import trainbus.plugins as trainbus_plugins

    metadata: dict[str, list[dict[str, Any]]] = {}
    for impl in (transformers, trainbus_plugins):
        out = tmp_path / impl.__name__ / "tiny-bert-mrpc"
        args = impl.TrainingArguments(str(out), num_train_epochs=1, per_device_train_batch_size=4, learning_rate=0.01,
                                      per_device_eval_batch_size=4, eval_strategy="epoch", save_strategy="no",
                                      use_cpu=True, report_to="none", disable_tqdm=True, seed=3)  # fmt: skip
        trainer = impl.Trainer(tiny_bert(), args, train_dataset=_glue_like(16, "train"),
                               eval_dataset=_glue_like(8, "validation"), compute_metrics=accuracy)  # fmt: skip
        trainer.train()
        trainer.evaluate()
        out.mkdir(parents=True, exist_ok=True)
        metadata[impl.__name__] = []
        for kwargs in calls:
            trainer.create_model_card(**{k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()})
            metadata[impl.__name__].append(yaml.safe_load((out / "README.md").read_text().split("---\n")[1]))
    return metadata


def _rounded(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return round(value, 5) if isinstance(value, float) else value


def test_the_metadata_is_transformers_for_every_keyword_and_default(tmp_path: Path) -> None:
    every = {"language": "en", "license": "apache-2.0", "tags": ["tiny", "test"], "model_name": "tiny-bert",
             "finetuned_from": "google-bert/bert-base-uncased", "tasks": "text-classification",
             "dataset_tags": ["glue", "nyu-mll/glue"], "dataset": ["GLUE MRPC", "GLUE again"],
             "dataset_args": "mrpc"}  # fmt: skip
    calls = [
        {},  # every default: the data set's builder, the model's task, the output_dir's name
        every,
        {"tags": "extra", "language": ["en", "fr"], "tasks": ["text-classification", "fill-mask"]},  # + the README's
        {"dataset": "my data", "tasks": "no-such-task", "license": "mit"},
    ]
    cards = _cards(tmp_path, calls)
    hf, tb = cards["transformers"], cards["trainbus.plugins"]
    for call, expected, actual in zip(calls, hf, tb):
        assert list(actual) == list(expected), call  # the same keys in the same order
        assert _rounded(actual) == _rounded(expected), call
    # what the comparison covers: every keyword and every default made it into the metadata
    assert tb[0]["datasets"] == ["glue"] and tb[0]["tags"] == ["generated_from_trainer"]
    (result,) = tb[0]["model-index"][0]["results"]
    assert result["task"] == {"name": "Text Classification", "type": "text-classification"}
    assert result["dataset"] == {"name": "glue", "type": "glue", "config": "mrpc", "split": "validation",
                                 "args": "mrpc"}  # fmt: skip
    assert result["metrics"][0]["type"] == "accuracy" and tb[0]["model-index"][0]["name"] == "tiny-bert-mrpc"
    assert {k: tb[1][k] for k in ("language", "license", "base_model", "tags", "datasets", "metrics")} == {
        "language": ["en"], "license": "apache-2.0", "base_model": "google-bert/bert-base-uncased",
        "tags": ["tiny", "test", "generated_from_trainer"], "datasets": ["glue", "nyu-mll/glue"],
        "metrics": ["accuracy"],
    }  # fmt: skip
    assert [r["dataset"].get("args") for r in tb[1]["model-index"][0]["results"]] == ["mrpc", None]
    assert tb[2]["tags"] == ["extra", "tiny", "test", "generated_from_trainer"]  # the card's tags were kept
    assert len(tb[2]["model-index"][0]["results"]) == 2  # one per task
    assert tb[3]["license"] == "mit" and tb[3]["model-index"][0]["results"] == []  # an unknown task: no result


def test_the_card_text_names_the_keywords(tmp_path: Path) -> None:
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=2), train_dataset=regression_data(8))
    trainer.train()
    trainer.create_model_card(finetuned_from="org/base", dataset=["a", "b", "c"], model_name="m", tags="t")
    text = (tmp_path / "README.md").read_text()
    assert "# m\n" in text and "[org/base](https://huggingface.co/org/base) on the a, the b and the c datasets" in text
    trainer.create_model_card(dataset="only")
    text = (tmp_path / "README.md").read_text()
    assert f"# {tmp_path.name}\n" in text and "was trained from scratch on the only dataset" in text


def test_unknown_keywords_and_bad_values_are_type_errors_as_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    trainer = Trainer(Regressor(), quiet_args(tmp_path, max_steps=1), train_dataset=regression_data(4))
    hf_args = transformers.TrainingArguments(str(tmp_path / "hf"), use_cpu=True, report_to="none")
    hf = transformers.Trainer(tiny_bert(), hf_args)
    for bad in ({"output_dir": "x"}, {"languag": "en"}):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(bad))}'"):
            hf.create_model_card(**bad)
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(bad))}'; it takes language"):
            trainer.create_model_card(**bad)
    with pytest.raises(TypeError, match="unexpected keyword arguments 'a', 'b'"):
        trainer.create_model_card(a=1, b=2, license="mit")
    for key, value in (("tags", 3), ("license", ["mit"]), ("dataset", ["ok", 1]), ("model_name", b"x")):
        message = rf"create_model_card\({key}=...\) must be a str.* got {re.escape(repr(value))}"
        with pytest.raises(TypeError, match=message):
            trainer.create_model_card(**{key: value})
    assert not (tmp_path / "README.md").exists()  # nothing written


def test_eval_results_are_chosen_and_named_as_transformers_does() -> None:
    from transformers.modelcard import parse_log_history

    histories = [
        [
            {"loss": 1.0, "step": 1},
            {"eval_loss": 0.5, "eval_f1_macro": 0.25, "eval_runtime": 1.0, "epoch": 1.0, "step": 1},
            {"train_runtime": 2.0, "step": 1},
        ],
        [{"eval_loss": 0.5, "eval_accuracy": 1.0, "step": 0}],  # no training: the record as logged
        [{"eval_loss": 0.5, "step": 0}, {"train_runtime": 2.0, "step": 1}],  # HF's rule: never the first record
        [{"loss": 1.0, "step": 1}, {"train_runtime": 2.0}],
        [],
    ]
    for history in histories:
        assert eval_results(history) == parse_log_history(history)[2], history
    assert eval_results(histories[0]) == {"Loss": 0.5, "F1 Macro": 0.25}


def test_a_peft_models_card_is_updated_by_peft_as_in_transformers(tmp_path: Path) -> None:
    """save_model writes peft's card; create_model_card then writes its own and lets peft update it."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import trainbus.plugins as trainbus_plugins

    metadata, texts = [], []
    for impl in (transformers, trainbus_plugins):
        lora = peft.LoraConfig(r=2, target_modules=["query", "value"], task_type="SEQ_CLS")
        out = tmp_path / impl.__name__
        args = impl.TrainingArguments(str(out), max_steps=2, per_device_train_batch_size=4, save_strategy="no",
                                      use_cpu=True, report_to="none", disable_tqdm=True)  # fmt: skip
        trainer = impl.Trainer(peft.get_peft_model(tiny_bert(), lora), args, train_dataset=token_data(8))
        trainer.train()
        trainer.save_model()
        trainer.create_model_card(tags="x", model_name="lora")
        texts.append((out / "README.md").read_text())
        metadata.append(read_front_matter(out / "README.md"))
    assert metadata[1] == metadata[0] and metadata[1]["library_name"] == "peft"
    assert "made with trainbus" in texts[1]
