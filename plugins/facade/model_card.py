"""A model card: ``README.md`` next to the saved model (HF's ``Trainer.create_model_card``, without the hub).

Its YAML metadata is what transformers' ``TrainingSummary.to_model_card`` writes, key for key
(``library_name``, ``language``, ``license``, ``base_model``, ``tags``, ``datasets``, ``metrics``,
``model-index``), from the same nine keywords and with the same defaults (the data set's builder,
the model's ``_name_or_path`` and task, the last evaluation); the Hub is never asked for a license.
The text holds the run's results (the final evaluation, a table of the logged training and
evaluation values), the training curves (``training_curves.png``, drawn when matplotlib is there),
the data sizes, the arguments that differ from their defaults, and the versions of trainbus, torch
and the libraries the model comes from.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainbus.engine import ConfigError

from ..observability.plots import FIGURE, curves, plot_history

_TIMING = ("_runtime", "_samples_per_second", "_steps_per_second")
#: the keywords of transformers' ``Trainer.create_model_card``, in its order
CARD_KEYWORDS = (
    "language", "license", "tags", "model_name", "finetuned_from", "tasks", "dataset_tags", "dataset", "dataset_args",
)  # fmt: skip
_TEXT_ONLY = ("license", "model_name", "finetuned_from")  # the others: a str or a list of str
GENERATED = "generated_from_trainer"  # the tag the Hub knows Trainer-made cards by
_LOCAL_BUILDERS = ("csv", "json", "pandas", "parquet", "text")  # a data set of local files names no Hub data set
#: the Hub's metric ids a result key may name (``Accuracy``, ``F1``, ...)
_METRIC_IDS = ("accuracy", "bleu", "f1", "matthews_correlation", "pearsonr", "precision", "recall", "rouge",
               "sacrebleu", "spearmanr", "wer")  # fmt: skip
_NOT_RESULTS = ("runtime", "samples_per_second", "steps_per_second", "epoch", "step")


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _size(dataset: Any) -> str:
    try:
        return str(len(dataset))
    except TypeError:
        return "unknown (an iterable data set)"


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def results_table(history: Sequence[Mapping[str, Any]]) -> list[str]:
    """HF's "Training results" table: one row per evaluation (the training loss logged before it)."""
    rows: list[list[str]] = []
    last_loss: Any = "No log"
    keys: list[str] = []
    for record in history:
        if "loss" in record:
            last_loss = record["loss"]
        metrics = {k: v for k, v in record.items() if k.startswith("eval_") and not k.endswith(_TIMING)}
        if not metrics:
            continue
        keys += [k for k in metrics if k not in keys]
        rows.append([_number(last_loss), _number(record.get("epoch", "")), str(record.get("step", "")),
                     *(_number(metrics.get(k, "")) for k in keys)])  # fmt: skip
    if not rows:
        return []
    header = ["Training Loss", "Epoch", "Step", *(k.removeprefix("eval_").replace("_", " ").title() for k in keys)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row + [""] * (len(header) - len(row))) + " |" for row in rows]
    return lines


def check_card_keywords(card: Mapping[str, Any]) -> None:
    """A TypeError naming the keywords ``create_model_card`` does not take, or a value of the wrong type."""
    unknown = [key for key in card if key not in CARD_KEYWORDS]
    if unknown:
        names = ", ".join(repr(key) for key in unknown)
        several = "s" if len(unknown) > 1 else ""
        raise TypeError(
            f"create_model_card() got {'an ' if not several else ''}unexpected keyword argument{several} {names}; "
            f"it takes {', '.join(CARD_KEYWORDS)}"
        )
    for key, value in card.items():
        listed = isinstance(value, list | tuple) and key not in _TEXT_ONLY
        strings = listed and all(isinstance(v, str) or v is None for v in value)
        if value is not None and not isinstance(value, str) and not strings:
            kind = "a str" if key in _TEXT_ONLY else "a str or a list of str"
            raise TypeError(f"create_model_card({key}=...) must be {kind} or None, got {value!r}")


def _listed(value: Any) -> list[Any]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)


def _named(value: Any) -> list[Any]:
    """A str or list as a list without Nones (HF leaves a metadata key out when nothing remains)."""
    return [v for v in _listed(value) if v is not None]


def _hf_dataset(data: Any) -> bool:
    datasets = sys.modules.get("datasets")  # a datasets object means the library is imported already
    return datasets is not None and isinstance(data, datasets.Dataset | datasets.IterableDataset)


def _task_of(model: Any) -> str | None:
    """The pipeline task of a transformers model class (by its class name, the last match, as HF's)."""
    if "transformers" not in sys.modules:
        return None  # not a transformers model
    try:
        from transformers.modelcard import TASK_MAPPING
    except ImportError:
        return None
    found = None
    for task, mapping in TASK_MAPPING.items():
        names = [n for v in mapping.values() for n in (v if isinstance(v, list | tuple) else (v,))]
        if type(model).__name__ in names:
            found = task
    return found


def _task_names() -> dict[str, str]:
    try:
        from transformers.modelcard import TASK_TAG_TO_NAME_MAPPING
    except ImportError:
        return {}
    return dict(TASK_TAG_TO_NAME_MAPPING)


def eval_results(history: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The results a card reports, chosen and named as transformers' ``parse_log_history`` does.

    After training (a ``train_runtime`` record): the last evaluation but the first record, its keys
    without ``eval_`` and capitalised word by word (``eval_f1_macro`` -> ``F1 Macro``). Without
    training: the last evaluation's record as logged.
    """
    trained = any("train_runtime" in r for r in history)
    last = next((i for i in range(len(history) - 1, -1, -1) if "eval_loss" in history[i]), None)
    if last is None or (trained and last == 0):
        return None
    if not trained:
        return dict(history[last])
    named = {}
    for key, value in history[last].items():
        key = key.removeprefix("eval_")
        if key not in _NOT_RESULTS:
            named[" ".join(part.capitalize() for part in key.split("_"))] = value
    return named


def _metric_tags(results: Mapping[str, Any] | None) -> dict[str, str]:
    """Metric id -> the result's name, for the results named like a Hub metric."""
    tags = {}
    for key in results or {}:
        if key.lower().replace(" ", "_") in _METRIC_IDS:
            tags[key.lower().replace(" ", "_")] = key
        elif key.lower() == "rouge1":
            tags["rouge"] = key
    return tags


def card_fields(trainer: Any, root: Path, card: Mapping[str, Any], old_tags: Any = None) -> dict[str, Any]:
    """The nine keywords with transformers' defaults filled in (``TrainingSummary.from_trainer``'s rules)."""
    fields = {key: card.get(key) for key in CARD_KEYWORDS}
    fields["dataset_metadata"] = None
    data = trainer.eval_dataset if trainer.eval_dataset is not None else trainer.train_dataset
    builder = getattr(data, "builder_name", None)
    if _hf_dataset(data) and builder not in _LOCAL_BUILDERS:
        fields["dataset_metadata"] = [{"config": data.config_name, "split": str(data.split)}]
        fields["dataset_tags"] = [builder] if fields["dataset_tags"] is None else fields["dataset_tags"]
        fields["dataset_args"] = [data.config_name] if fields["dataset_args"] is None else fields["dataset_args"]
    if fields["dataset"] is None:
        fields["dataset"] = fields["dataset_tags"]
    model = _plain(trainer.model)
    origin = getattr(getattr(model, "config", None), "_name_or_path", None)
    if fields["finetuned_from"] is None and isinstance(origin, str) and not os.path.isdir(origin):
        fields["finetuned_from"] = origin  # a Hub name; a local folder names nothing others can find
    if fields["tasks"] is None:
        fields["tasks"] = _task_of(model)
    if fields["model_name"] is None:
        fields["model_name"] = root.name
    fields["model_name"] = fields["model_name"] or fields["finetuned_from"]  # an output_dir such as "."
    tags = card.get("tags")
    if tags is not None and old_tags:  # HF: the README's tags join the ones given
        tags = _listed(tags)
        tags += [tag for tag in _listed(old_tags) if tag not in tags]
    fields["tags"] = _listed(tags) + ([GENERATED] if GENERATED not in _listed(tags) else [])
    return fields


def card_metadata(fields: Mapping[str, Any], results: Mapping[str, Any] | None, library: str) -> dict[str, Any]:
    """The card's YAML metadata, with transformers' keys in its order (``TrainingSummary.create_metadata``)."""
    metrics = _metric_tags(results)
    metadata: dict[str, Any] = {"library_name": library}
    for key, value in (("language", _named(fields["language"])), ("license", fields["license"]),
                       ("base_model", fields["finetuned_from"] or None), ("tags", _named(fields["tags"])),
                       ("datasets", _named(fields["dataset_tags"])), ("metrics", list(metrics))):  # fmt: skip
        if value is not None and value != []:
            metadata[key] = value
    metadata["model-index"] = [{"name": fields["model_name"], "results": _index_results(fields, results, metrics)}]
    return metadata


def _index_results(fields: Mapping[str, Any], results: Any, metrics: dict[str, str]) -> list[dict[str, Any]]:
    """model-index results: one per task and data set, only complete ones (the Hub rejects the others)."""
    tags = _listed(fields["dataset_tags"])
    extra = _listed(fields["dataset_args"])
    extra += [None] * (len(tags) - len(extra))
    names, args = dict(zip(tags, _listed(fields["dataset"]))), dict(zip(tags, extra))
    described = dict(zip(tags, _listed(fields["dataset_metadata"])))
    known = _task_names()
    tasks = {task: known[task] for task in _listed(fields["tasks"]) if task in known}
    found = []
    for task in tasks:
        for tag in names:
            if tag is None or not metrics:
                continue
            dataset = {"name": names[tag], "type": tag, **described.get(tag, {})}
            if args[tag] is not None:
                dataset["args"] = args[tag]
            measured = [{"name": name, "type": kind, "value": results[name]} for kind, name in metrics.items()]
            found.append({"task": {"name": tasks[task], "type": task}, "dataset": dataset, "metrics": measured})
    return found


def _yaml(metadata: dict[str, Any]) -> str:
    plain = json.loads(json.dumps(metadata, default=lambda v: v.item() if hasattr(v, "item") else str(v)))
    try:
        import yaml
    except ImportError:  # JSON is YAML too
        return "".join(f"{key}: {json.dumps(value)}\n" for key, value in plain.items())
    return str(yaml.safe_dump(plain, sort_keys=False))


def read_front_matter(path: Path) -> dict[str, Any]:
    """The YAML metadata of a model card (``{}`` when there is no card or no readable metadata)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}
    if not text.startswith("---\n") or "\n---\n" not in text[3:]:
        return {}
    block = text[4 : text.index("\n---\n", 3) + 1]
    try:
        import yaml

        data = yaml.safe_load(block)
    except ImportError:
        data = {k: json.loads(v) for k, _, v in (line.partition(": ") for line in block.splitlines()) if v}
    except Exception:  # a hand-edited card that is not YAML: HF would fail to load it, here it is ignored
        return {}
    return data if isinstance(data, dict) else {}


def _library(model: Any) -> str:
    """transformers' library name for its models (peft updates its own cards), trainbus's for the others."""
    packages = {cls.__module__.split(".")[0] for cls in type(model).__mro__}
    return "transformers" if packages & {"transformers", "peft"} else "trainbus"


def _phrase(fields: Mapping[str, Any]) -> str:
    origin = fields["finetuned_from"]
    data = _listed(fields["dataset"])
    if not data:
        on = "an unknown dataset"
    elif len(data) == 1:
        on = f"the {data[0]} dataset"
    else:
        on = ", ".join(f"the {d}" for d in data[:-1]) + f" and the {data[-1]} datasets"
    if origin:
        return f"is a fine-tuned version of [{origin}](https://huggingface.co/{origin}) on {on}"
    return f"was trained from scratch on {on}"


def write_model_card(trainer: Any, output_dir: str | Path | None = None, /, **card: Any) -> Path:
    """Write ``README.md`` describing ``trainer``'s run into ``output_dir`` (default ``args.output_dir``).

    ``card`` takes transformers' ``create_model_card`` keywords (``CARD_KEYWORDS``: language,
    license, tags, model_name, finetuned_from, tasks, dataset_tags, dataset, dataset_args); any other
    is a TypeError naming it. A card already there gives its tags to the ones passed and, when peft
    wrote it, is updated by peft afterwards, as in transformers.
    """
    check_card_keywords(card)
    args = trainer.args
    root = Path(output_dir or args.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = root / "README.md"
    old = read_front_matter(path)
    history = list(trainer.state.log_history)
    model = _plain(trainer.model)
    fields = card_fields(trainer, root, card, old.get("tags"))
    metadata = card_metadata(fields, eval_results(history), _library(model))
    lines = ["---", _yaml(metadata).rstrip("\n"), "---", "", f"# {fields['model_name']}", ""]
    lines += [f"This model ({type(model).__name__}) {_phrase(fields)}, made with trainbus.", ""]
    final = next((r for r in reversed(history) if any(k.startswith("eval_") for k in r)), None)
    if final is not None:
        lines += ["It achieves the following results on the evaluation set:", ""]
        lines += [f"- {k.removeprefix('eval_').replace('_', ' ').title()}: {_number(v)}"
                  for k, v in final.items() if k.startswith("eval_") and not k.endswith(_TIMING)]  # fmt: skip
        lines.append("")
    lines += ["## Training data", "", f"- training samples: {_size(trainer.train_dataset)}"]
    if trainer.eval_dataset is not None:
        lines.append(f"- evaluation samples: {_size(trainer.eval_dataset)}")
    lines += ["", "## Training procedure", "", "### Training hyperparameters", ""]
    defaults = type(args)()
    changed = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)
               if f.name != "output_dir" and getattr(args, f.name) != getattr(defaults, f.name)}  # fmt: skip
    lines += [f"- {k}: {getattr(v, 'value', v)}" for k, v in changed.items()] or ["- the defaults"]
    total = args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps
    lines.append(f"- total train batch size: {total}")
    lines += _results_and_versions(history, root)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    update = getattr(model, "create_or_update_model_card", None)
    if old.get("library_name") == "peft" and callable(update):
        update(str(root))  # HF: peft puts its own metadata back (library_name, base_model, ...)
    return path


def _results_and_versions(history: list[dict[str, Any]], root: Path) -> list[str]:
    """The card's training results table, its curves (drawn into ``root`` when matplotlib is there), versions."""
    lines: list[str] = []
    table = results_table(history)
    if table:
        lines += ["", "### Training results", "", *table]
    if curves(history):
        figure = root / FIGURE
        try:
            if not figure.exists():
                plot_history(history, figure)
            lines += ["", "### Training curves", "", f"![training curves]({FIGURE})"]
        except ConfigError:
            pass  # no matplotlib: the card goes without the picture
    lines += ["", "### Framework versions", ""]
    for package in ("trainbus", "torch", "transformers", "peft", "accelerate", "datasets"):
        version = _version(package)
        if version is not None:
            lines.append(f"- {package} {version}")
    return lines


def _plain(model: Any) -> Any:
    return getattr(model, "module", model)


__all__ = ["CARD_KEYWORDS", "check_card_keywords", "eval_results", "read_front_matter", "results_table",
           "write_model_card"]  # fmt: skip
