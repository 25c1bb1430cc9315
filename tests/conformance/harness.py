"""The differential harness of the conformance scripts: run a script under transformers.Trainer and under trainbus
with the same seed and arguments, and list every difference between the two runs.

A script (``run_*.py`` next to this file) is written as transformers' example scripts are; its
``main(argv, trainer_module)`` imports ``Trainer`` and ``TrainingArguments`` from ``trainer_module``
("transformers" or "trainbus", see ``implementation``) and nothing else differs. It returns what a
test compares (the trainer, train / eval / predict results); the files it wrote are read back from
its output_dir.

What must match (``differences`` returns one line per mismatch, ``assert_same`` fails listing all):

* every ``log_history`` record, key by key: losses (``loss``, ``eval_loss``, ``train_loss``) within
  ``LOSS_RTOL``, ``grad_norm`` within ``GRAD_RTOL``, ``learning_rate``, ``epoch``, metrics, ``total_flos``;
  the timing keys (``*_runtime``, ``*_per_second``) only by name;
* ``train()``'s ``TrainOutput.metrics``, ``evaluate()``'s metrics and ``predict()``'s predictions,
  label_ids and metrics;
* the files of output_dir: every file transformers writes, by relative path, except its pickles
  (``PICKLES``: trainbus writes none); where transformers writes ``training_args.bin``, trainbus must
  write the JSON equivalent ``training_args.json``. Files trainbus writes beyond those (its manifests,
  optimizer state as safetensors, ...) are allowed and listed by ``extra_files``. Of the common
  files, the weights (``*.safetensors`` of a model folder) must match tensor by tensor, ``config.json``
  / ``generation_config.json`` / the processing class's JSON files as JSON, the ``*_results.json``
  files and ``trainer_state.json`` as metrics.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import json
import math
import os
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the Hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hf_release  # tests/hf_release.py: what the installed transformers release does
import numpy as np

IMPLEMENTATIONS = ("transformers", "trainbus")

LOSS_RTOL = 1e-5  # the tolerance on every logged loss
GRAD_RTOL = 1e-4  # a norm over all parameters sums float32 squares in another order
METRIC_RTOL = 1e-5
PREDICTION_ATOL = 1e-5
WEIGHT_ATOL = 1e-5
TIMING_SUFFIXES = ("_runtime", "_per_second")
#: transformers' pickled files; trainbus writes none (safetensors and JSON instead)
PICKLES = frozenset({"training_args.bin", "optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt"})
#: where transformers pickles the arguments, trainbus writes them as JSON under this name
ARGS_JSON = "training_args.json"


# -- the implementation under test ------------------------------------------------------------------
def implementation(name: str) -> tuple[type, type]:
    """``(Trainer, TrainingArguments)`` of ``name``: the one import a port changes."""
    if name == "transformers":
        from transformers import Trainer, TrainingArguments
    elif name == "trainbus":
        from trainbus.plugins import Trainer, TrainingArguments
    else:
        raise ValueError(f"trainer_module must be one of {IMPLEMENTATIONS}, got {name!r}")
    return Trainer, TrainingArguments


# -- data the tests write ------------------------------------------------------------------------------
NOUNS = ["cat", "dog", "bird", "house", "tree", "river", "car", "book", "garden", "window", "teacher", "mountain"]
VERBS = ["sees", "likes", "finds", "paints", "watches", "follows", "builds", "reads"]
GOOD = ["good", "happy", "bright", "lovely", "wonderful"]
BAD = ["bad", "sad", "dark", "awful", "terrible"]
OTHER = ["the", "a", "this", "very", "quite", "near", "under", "and"]
TAGS = ["O", "NOUN", "VERB", "ADJ"]


def sentences(n: int, seed: int, min_words: int = 3, max_words: int = 11) -> list[dict[str, Any]]:
    """``n`` synthetic sentences of uneven length: text, a sentiment label, and one tag per word."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.randrange(2)
        words, tags = [], []
        for _ in range(rng.randint(min_words, max_words)):
            kind = rng.choice(("noun", "verb", "adj", "other", "other"))
            if kind == "noun":
                words.append(rng.choice(NOUNS)), tags.append("NOUN")
            elif kind == "verb":
                words.append(rng.choice(VERBS)), tags.append("VERB")
            elif kind == "adj":
                words.append(rng.choice(GOOD if (rng.random() < 0.8) == bool(label) else BAD)), tags.append("ADJ")
            else:
                words.append(rng.choice(OTHER)), tags.append("O")
        rows.append({"text": " ".join(words), "label": label, "tokens": words, "tags": tags})
    return rows


def write_json_lines(path: Path, rows: Iterable[Mapping[str, Any]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dict(row)) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return str(path)


def write_tokenizer(directory: Path, texts: Iterable[str], vocab_size: int = 120, bert_template: bool = True) -> str:
    """A WordPiece tokenizer trained on ``texts``, saved as a transformers fast tokenizer in ``directory``.

    The vocabulary is small, so rarer words split into several pieces (uneven -100 in token
    classification). ``bert_template`` adds [CLS] ... [SEP]; the language-model tokenizer adds nothing.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=specials)
    tokenizer.train_from_iterator(list(texts), trainer)
    if bert_template:
        cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
        )
    tokenizer.decoder = decoders.WordPiece()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]", bos_token="[CLS]", eos_token="[SEP]",
    )  # fmt: skip
    fast.save_pretrained(str(directory))
    return str(directory)


# -- running a script ----------------------------------------------------------------------------------
@dataclass
class Run:
    """What one script run produced, read back for comparison."""

    implementation: str
    output_dir: Path
    log_history: list[dict[str, Any]]
    train_metrics: dict[str, Any]
    eval_metrics: dict[str, Any]
    predictions: Any
    label_ids: Any
    predict_metrics: dict[str, Any]
    files: set[str] = field(default_factory=set)
    stdout: str = ""


def files_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def run_script(main: Callable[..., dict[str, Any]], argv: Sequence[str], implementation_name: str) -> Run:
    """Run ``main(argv, implementation_name)`` and collect its results and files (stdout captured)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = main(list(argv), implementation_name)
    trainer = result["trainer"]
    output_dir = Path(trainer.args.output_dir)
    predicted = result.get("predict")
    return Run(
        implementation=implementation_name,
        output_dir=output_dir,
        log_history=copy.deepcopy(list(trainer.state.log_history)),
        train_metrics=dict(result.get("train") or {}),
        eval_metrics=dict(result.get("eval") or {}),
        predictions=None if predicted is None else predicted.predictions,
        label_ids=None if predicted is None else predicted.label_ids,
        predict_metrics={} if predicted is None else dict(predicted.metrics or {}),
        files=files_under(output_dir),
        stdout=out.getvalue(),
    )


def run_both(main: Callable[..., dict[str, Any]], argv_for: Callable[[str], Sequence[str]]) -> tuple[Run, Run]:
    """The script under transformers, then under trainbus; ``argv_for(name)`` gives each its own output_dir."""
    return tuple(run_script(main, argv_for(name), name) for name in IMPLEMENTATIONS)  # type: ignore[return-value]


def common_argv(output_dir: Path, **overrides: Any) -> list[str]:
    """The training arguments every script shares (CPU, seed 42, no tqdm, no trackers), plus ``overrides``."""
    args: dict[str, Any] = {
        "output_dir": str(output_dir),
        "seed": 42,
        "use_cpu": True,
        "report_to": "none",
        "disable_tqdm": True,
        "logging_steps": 1,
        "num_train_epochs": 2,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 5,
        "learning_rate": 5e-3,
        "eval_strategy": "epoch",
        "save_strategy": "epoch",
        "save_total_limit": 1,
        "do_train": True,
        "do_eval": True,
        "do_predict": True,
    }
    args.update(overrides)
    argv = []
    for key, value in args.items():
        argv += [f"--{key}", str(value)]
    return argv


# -- comparing two runs ----------------------------------------------------------------------------------
def _is_timing(key: str) -> bool:
    return key.endswith(TIMING_SUFFIXES)


def _rtol_for(key: str) -> float:
    if key == "grad_norm":
        return GRAD_RTOL
    return LOSS_RTOL if key.endswith("loss") else METRIC_RTOL


def compare_values(where: str, expected: Any, actual: Any, rtol: float, atol: float = 0.0) -> list[str]:
    """``[]`` when equal (numbers within rtol / atol, arrays elementwise); else one line saying both values."""
    if isinstance(expected, Mapping) and isinstance(actual, Mapping):
        return compare_metrics(where, expected, actual)
    if isinstance(expected, list | tuple) and isinstance(actual, list | tuple) and not _numeric(expected):
        if len(expected) != len(actual):
            return [f"{where}: {len(expected)} items under transformers, {len(actual)} under trainbus"]
        pairs = enumerate(zip(expected, actual))
        return [d for i, (e, a) in pairs for d in compare_values(f"{where}[{i}]", e, a, rtol, atol)]
    if isinstance(expected, bool | str | type(None)) or isinstance(actual, bool | str | type(None)):
        return [] if expected == actual else [f"{where}: transformers {expected!r}, trainbus {actual!r}"]
    e, a = np.asarray(expected), np.asarray(actual)
    if e.shape != a.shape:
        return [f"{where}: shape {e.shape} under transformers, {a.shape} under trainbus"]
    if e.dtype.kind in "fc" or a.dtype.kind in "fc":
        close = np.isclose(a.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True)
        if close.all():
            return []
        if e.ndim == 0:
            diff = abs(float(a) - float(e)) / max(abs(float(e)), 1e-300)
            return [f"{where}: transformers {float(e)!r}, trainbus {float(a)!r} (rel. diff {diff:.3g})"]
        worst = np.unravel_index(np.argmax(np.abs(a - e)), e.shape)
        return [
            f"{where}: {int((~close).sum())} of {e.size} values differ, worst at {tuple(int(i) for i in worst)}: "
            f"transformers {float(e[worst])!r}, trainbus {float(a[worst])!r}"
        ]
    if not np.array_equal(e, a):
        return [f"{where}: {int((e != a).sum())} of {e.size} values differ (transformers {e.ravel()[:8]}, "
                f"trainbus {a.ravel()[:8]})"]  # fmt: skip
    return []


def _numeric(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def compare_metrics(
    where: str, expected: Mapping[str, Any], actual: Mapping[str, Any], ignore: Iterable[str] = ()
) -> list[str]:
    """Same keys (timing keys by name only), and values within their key's tolerance; ``ignore``: keys left out."""
    ignored = set(ignore)
    expected = {k: v for k, v in expected.items() if k not in ignored}
    actual = {k: v for k, v in actual.items() if k not in ignored}
    found = []
    missing, extra = sorted(set(expected) - set(actual)), sorted(set(actual) - set(expected))
    if missing:
        found.append(f"{where}: keys only transformers has: {missing}")
    if extra:
        found.append(f"{where}: keys only trainbus has: {extra}")
    for key in sorted(set(expected) & set(actual)):
        if _is_timing(key):
            continue
        atol = hf_release.loss_tolerance(expected[key]) if key == "loss" else 0.0  # 4.x logs it rounded
        found += compare_values(f"{where}[{key!r}]", expected[key], actual[key], _rtol_for(key), atol)
    return found


def compare_log_history(
    expected: list[dict[str, Any]], actual: list[dict[str, Any]], ignore: Iterable[str] = ()
) -> list[str]:
    found = []
    if len(expected) != len(actual):
        found.append(f"log_history: {len(expected)} records under transformers, {len(actual)} under trainbus")
    for i, (e, a) in enumerate(zip(expected, actual)):
        found += compare_metrics(f"log_history[{i}] (step {e.get('step')})", e, a, ignore)
    return found


#: transformers 4.x rounds the logged step loss to 4 decimals (5 logs it whole, as trainbus does)
TRANSFORMERS_ROUNDS_LOSS = hf_release.ROUNDS_LOGGED_LOSS


def compare_predictions(hf: Run, tb: Run) -> list[str]:
    found = compare_values("predict().predictions", hf.predictions, tb.predictions, 1e-4, PREDICTION_ATOL)
    found += compare_values("predict().label_ids", hf.label_ids, tb.label_ids, 0.0)
    return found + compare_metrics("predict().metrics", hf.predict_metrics, tb.predict_metrics)


def expected_files(hf_files: Iterable[str]) -> set[str]:
    """The files trainbus must write, from those transformers wrote: its pickles out, JSON arguments in."""
    expected = set()
    for name in hf_files:
        base = name.rsplit("/", 1)[-1]
        if base == "training_args.bin":
            expected.add(name[: -len(base)] + ARGS_JSON)
        elif base not in PICKLES:
            expected.add(name)
    return expected


def extra_files(hf: Run, tb: Run) -> set[str]:
    """Files only trainbus writes (allowed: its manifests, safetensors optimizer state, ...)."""
    return tb.files - expected_files(hf.files)


def compare_files(hf: Run, tb: Run, ignore: tuple[str, ...] = ()) -> list[str]:
    """Every file transformers writes (less its pickles) under trainbus too, with the same content."""
    found = []
    missing = sorted(expected_files(hf.files) - tb.files)
    if missing:
        found.append(f"files: missing under trainbus: {missing}")
    for name in sorted(hf.files & tb.files):
        found += compare_file(name, hf.output_dir / name, tb.output_dir / name, ignore)
    return found


#: JSON files whose content is environment, not results (versions, paths) or timing
_VOLATILE_JSON_KEYS = frozenset({"transformers_version", "_name_or_path", "name_or_path"})


def compare_file(name: str, expected: Path, actual: Path, ignore: tuple[str, ...] = ()) -> list[str]:
    base = name.rsplit("/", 1)[-1]
    if base.endswith(".safetensors"):
        from safetensors.numpy import load_file

        e, a = load_file(str(expected)), load_file(str(actual))
        if set(e) != set(a):  # save_pretrained renames (ViT) or drops tied copies: compare the loaded models
            return compare_loaded_models(name, expected.parent, actual.parent)
        if set(e) != set(a):
            return [f"{name}: tensors only transformers has {sorted(set(e) - set(a))}, "
                    f"only trainbus has {sorted(set(a) - set(e))}"]  # fmt: skip
        found = []
        for key in sorted(e):
            kept = _with_gradient(key, e[key])
            found += compare_values(f"{name}[{key}]", e[key][kept], a[key][kept], 1e-4, WEIGHT_ATOL)
        return found
    if base == "trainer_state.json":
        e, a = json.loads(expected.read_text()), json.loads(actual.read_text())
        found = compare_log_history(e.get("log_history", []), a.get("log_history", []), ignore)
        for key in ("global_step", "max_steps", "num_train_epochs", "epoch", "total_flos", "best_metric"):
            if key in e:
                found += compare_values(f"{name}[{key!r}]", e[key], a.get(key), METRIC_RTOL)
        return [f"{name}: {d}" if not d.startswith(name) else d for d in found]
    if base.endswith("_results.json"):
        return compare_metrics(name, json.loads(expected.read_text()), json.loads(actual.read_text()), ignore)
    if base.endswith(".json"):
        e, a = _without_volatile(json.loads(expected.read_text())), _without_volatile(json.loads(actual.read_text()))
        return [] if e == a else [f"{name}: differs: {_json_diff(e, a)}"]
    return []


def compare_loaded_models(name: str, expected_dir: Path, actual_dir: Path) -> list[str]:
    """Both folders loaded with the class their config.json names (from_pretrained), weights compared by name."""
    import transformers

    models = []
    for directory in (expected_dir, actual_dir):
        config = transformers.AutoConfig.from_pretrained(directory)
        architecture = getattr(transformers, (config.architectures or [""])[0], None)
        if architecture is None:
            return [f"{name}: {directory} does not name a transformers architecture in config.json"]
        models.append(architecture.from_pretrained(directory).state_dict())
    e, a = models
    found = []
    for key in sorted(e):
        kept = _with_gradient(key, e[key].numpy())
        found += compare_values(f"{name}[{key}]", e[key].numpy()[kept], a[key].numpy()[kept], 1e-4, WEIGHT_ATOL)
    return found


def _with_gradient(name: str, tensor: np.ndarray) -> Any:
    """The elements of a weight that get a gradient: not an attention key bias.

    Softmax is invariant to the key bias, so its exact gradient is 0 and only rounding noise reaches
    it, which Adam turns into steps of any sign: two correct runs disagree there by up to the
    learning rate. GPT-2 keeps it as the middle third of ``c_attn.bias``.
    """
    if re.search(r"(\bkey|k_proj)\.bias$", name):
        return np.zeros(tensor.shape, dtype=bool)
    kept = np.ones(tensor.shape, dtype=bool)
    if name.endswith("attn.c_attn.bias"):
        third = tensor.shape[-1] // 3
        kept[..., third : 2 * third] = False
    return kept


def _without_volatile(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_volatile(v) for k, v in value.items() if k not in _VOLATILE_JSON_KEYS}
    return value


def _json_diff(e: Any, a: Any) -> str:
    if isinstance(e, dict) and isinstance(a, dict):
        keys = sorted(set(e) | set(a))
        return "; ".join(f"{k}: transformers {e.get(k)!r}, trainbus {a.get(k)!r}" for k in keys if e.get(k) != a.get(k))
    return f"transformers {e!r}, trainbus {a!r}"


def differences(hf: Run, tb: Run, ignore: Iterable[str] = (), files: bool = True) -> list[str]:
    """Every difference between the two runs that matters, one line each (empty: conformant).

    ``ignore``: metric / log keys left out (e.g. ``epoch`` against a reference run with another batch
    size); ``files=False`` leaves output_dir out.
    """
    ignore = tuple(ignore)
    found = compare_log_history(hf.log_history, tb.log_history, ignore)
    found += compare_metrics("train().metrics", hf.train_metrics, tb.train_metrics, ignore)
    found += compare_metrics("evaluate()", hf.eval_metrics, tb.eval_metrics, ignore)
    found += compare_predictions(hf, tb)
    return found + (compare_files(hf, tb, ignore) if files else [])


def assert_same(hf: Run, tb: Run, ignore: Iterable[str] = (), files: bool = True) -> None:
    found = differences(hf, tb, ignore, files)
    assert not found, f"{len(found)} differences from transformers.Trainer:\n" + "\n".join(found)


def logged(run: Run, key: str = "loss") -> list[float]:
    """The values of ``key`` in the run's log records, in order."""
    return [float(r[key]) for r in run.log_history if key in r]


def check_losses_logged(run: Run) -> None:
    """The comparison compares something: a run that logged no loss proves nothing."""
    losses = [r["loss"] for r in run.log_history if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses), f"{run.implementation}: no finite logged loss"


def set_dropout(config: Any, probability: float) -> None:
    """Every dropout probability a transformers config has, set to ``probability``."""
    for name, value in config.to_dict().items():
        if ("dropout" in name or name.endswith("_pdrop")) and (isinstance(value, float) or value is None):
            setattr(config, name, probability)


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    mask = labels != -100
    return float((predictions[mask] == labels[mask]).mean()) if mask.any() else 0.0
