"""Data and checks shared by the conformance scripts of issue #27's families (QA, multiple choice,
multi-label classification, semantic segmentation): the rows each test writes, and the resume check.

The data are synthetic and small, with a signal the tiny models can pick up within a few dozen steps,
so that metrics move between evaluations (a best checkpoint is then a real choice, not a tie).
"""

from __future__ import annotations

import dataclasses
import inspect
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import (
    BAD,
    GOOD,
    IMPLEMENTATIONS,
    NOUNS,
    OTHER,
    TRANSFORMERS_ROUNDS_LOSS,
    VERBS,
    Run,
    compare_file,
    differences,
    expected_files,
    run_script,
    sentences,
)

#: a 2-layer BERT (hidden 32) every text family builds from its config
BERT = "hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=37,max_position_embeddings=64"
COLORS = ["red", "green", "blue", "yellow"]


# -- extractive question answering (SQuAD-shaped rows) ------------------------------------------------
def qa_rows(n: int, seed: int, min_words: int = 4, max_words: int = 18) -> list[dict[str, Any]]:
    """Contexts of uneven length holding two "colour noun" pairs; the question names one noun, the answer is
    its colour (character offset in ``answers``, SQuAD's layout).

    Longer contexts overflow a short ``max_seq_length``, so one example gives several features and
    some features hold no answer (labelled with [CLS], as run_qa.py does).
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        units = [[rng.choice(VERBS + OTHER)] for _ in range(rng.randint(min_words, max_words))]
        nouns, colors = rng.sample(NOUNS, 2), rng.sample(COLORS, 2)
        for noun, color in zip(nouns, colors):
            units.insert(rng.randrange(len(units) + 1), [color, noun])
        words = [word for unit in units for word in unit]
        asked = rng.randrange(2)
        position = next(k for k in range(len(words) - 1) if words[k + 1] == nouns[asked] and words[k] in COLORS)
        context = " ".join(words)
        start = len(" ".join(words[:position])) + (1 if position else 0)
        assert context[start : start + len(colors[asked])] == colors[asked]
        question = rng.choice(["which color is the {} ?", "the {} is which color ?", "  what color has the {} ?"])
        rows.append({"id": f"q{seed}-{i}", "question": question.format(nouns[asked]), "context": context,
                     "answers": {"text": [colors[asked]], "answer_start": [start]}})  # fmt: skip
    return rows


# -- multiple choice (SWAG-shaped rows) -----------------------------------------------------------------
def swag_rows(n: int, seed: int, choices: int = 4) -> list[dict[str, Any]]:
    """``sent1`` a sentence with a sentiment, ``sent2`` the start of its continuation, ``ending0..3``: the one
    whose adjective matches the sentiment is ``label``."""
    rng = random.Random(seed)
    rows = []
    for s in sentences(n, seed=seed + 100, max_words=9):
        label = rng.randrange(choices)
        matching, other = (GOOD, BAD) if s["label"] else (BAD, GOOD)
        row = {"sent1": s["text"], "sent2": rng.choice(["so it was", "and the", "then a"]), "label": label}
        for k in range(choices):
            adjective = rng.choice(matching if k == label else other)
            row[f"ending{k}"] = " ".join([adjective, *rng.sample(NOUNS, rng.randint(1, 3))])
        rows.append(row)
    return rows


# -- multi-label classification --------------------------------------------------------------------------
MULTI_LABELS = ["animal", "bad", "good", "verb"]


def multi_label_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """``text`` and ``label``: the list of the label names that apply (possibly none), as run_classification
    reads a multi-label json file."""
    rows = []
    for s in sentences(n, seed=seed, max_words=9):
        words = set(s["tokens"])
        present = {
            "animal": bool(words & {"cat", "dog", "bird"}),
            "bad": bool(words & set(BAD)),
            "good": bool(words & set(GOOD)),
            "verb": bool(words & set(VERBS)),
        }
        rows.append({"text": s["text"], "label": [name for name in MULTI_LABELS if present[name]]})
    return rows


# -- semantic segmentation ------------------------------------------------------------------------------
SEGMENT_CLASSES = ["background", "square", "disc"]


def write_segmentation_images(directory: Path, n: int, seed: int) -> list[dict[str, str]]:
    """PNG images of uneven size (12 to 20 pixels a side) with a red square and a blue disc on noise, and
    their masks (class per pixel, 255 on a one-pixel border: ignored by the loss, as ADE20k's void)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        height, width = (int(v) for v in rng.integers(12, 21, size=2))
        image = rng.integers(0, 90, size=(height, width, 3)).astype(np.uint8)
        mask = np.zeros((height, width), dtype=np.uint8)
        side = int(rng.integers(3, 7))
        top, left = int(rng.integers(0, height - side)), int(rng.integers(0, width - side))
        mask[top : top + side, left : left + side] = 1
        image[top : top + side, left : left + side, 0] += 150
        radius = float(rng.uniform(2, 4))
        cy, cx = rng.uniform(radius, height - radius), rng.uniform(radius, width - radius)
        yy, xx = np.mgrid[:height, :width]
        disc = (yy - cy) ** 2 + (xx - cx) ** 2 <= radius**2
        mask[disc] = 2
        image[disc, 2] += 150
        mask[0, :], mask[:, 0] = 255, 255
        Image.fromarray(image, "RGB").save(directory / f"{i}.png")
        Image.fromarray(mask, "L").save(directory / f"{i}-mask.png")
        rows.append({"image": str(directory / f"{i}.png"), "label": str(directory / f"{i}-mask.png")})
    return rows


# -- accumulation -----------------------------------------------------------------------------------------
def transformers_sums_micro_batches(model_class: type) -> bool:
    """transformers' rule for ``model_class``: a forward taking ``**kwargs`` (or declaring
    ``accepts_loss_kwargs``) gets ``num_items_in_batch`` and is trusted to divide by it, so the Trainer does
    not divide the loss by the accumulation steps. A model (or a ``compute_loss`` override) that returns
    its own micro-batch mean then trains on, and logs, the sum of the micro-batch means."""
    declared = getattr(model_class, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    params = inspect.signature(model_class.forward).parameters.values()  # type: ignore[attr-defined]
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


# -- resume ---------------------------------------------------------------------------------------------
def resume_differences(
    main: Callable[..., dict[str, Any]], argv: Callable[[str], Sequence[str]], tmp_path: Path, step: int,
    transformers_resumes_exactly: bool = True,
) -> tuple[list[str], dict[str, tuple[Run, Run]]]:  # fmt: skip
    """Each implementation runs the script whole, then again in a fresh output_dir resumed from its own
    ``checkpoint-{step}``. Returns the differences and the runs, ``{name: (full, resumed)}``.

    The differences: the uninterrupted runs (transformers vs trainbus), trainbus's resumed run vs its
    uninterrupted one (it must continue as if never interrupted), and transformers' resumed run vs
    trainbus's with their files. Where transformers' own resume is not exact
    (``transformers_resumes_exactly=False``: the loader draws random numbers, see
    test_semantic_segmentation), its resumed run is no reference: only the files it wrote are required
    (by name), and the contents of those trainbus's resumed run shares with its uninterrupted run must match.

    ``train_loss`` after a resume: transformers averages only the resumed call's steps (5.21+; 5.18 their
    sum over all steps), trainbus the whole run's, as if never interrupted (#23); both pinned here.
    """
    runs = {}
    for name in IMPLEMENTATIONS:
        full = run_script(main, argv(name), name)
        checkpoint = tmp_path / name / f"checkpoint-{step}"
        assert checkpoint.is_dir(), f"{name}: no {checkpoint.name} to resume from"
        resumed = run_script(main, [*argv(f"{name}-resumed"), "--resume_from_checkpoint", str(checkpoint)], name)
        runs[name] = full, resumed
    (hf_full, hf), (tb_full, tb) = runs["transformers"], runs["trainbus"]
    found = [f"uninterrupted: {d}" for d in differences(hf_full, tb_full, files=False)]
    step_losses = [float(r["loss"]) for r in tb_full.log_history if "loss" in r]
    steps = max(int(r["step"]) for r in tb_full.log_history)
    if len(step_losses) == steps:  # logging_steps=1: train_loss is checkable against the step losses
        expected = sum(step_losses) / steps
        if tb.train_metrics["train_loss"] != pytest.approx(expected, rel=1e-6):
            found.append(f"trainbus resumed: train_loss {tb.train_metrics['train_loss']!r}, the uninterrupted "
                         f"run's step losses average {expected!r}")  # fmt: skip
        resumed_part = sum(logged_losses(hf)[step:]) if transformers_resumes_exactly else None
        # transformers 4 logs losses rounded to 4 places: their sum is known to half a unit each
        tolerance = {"abs": 5e-5 * steps / (steps - step)} if TRANSFORMERS_ROUNDS_LOSS else {"rel": 1e-5}
        if resumed_part is not None and hf.train_metrics["train_loss"] not in (
            pytest.approx(resumed_part / (steps - step), **tolerance),
            pytest.approx(resumed_part / steps, **tolerance),
        ):
            found.append(f"transformers resumed: train_loss {hf.train_metrics['train_loss']!r}, not the resumed "
                         f"steps' mean {resumed_part / (steps - step)!r}")  # fmt: skip
    if transformers_resumes_exactly:
        found += [f"resumed: {d}" for d in differences(hf, tb, ignore=["train_loss"])]
    else:
        missing = sorted(expected_files(hf.files) - tb.files)
        found += [f"resumed: files missing under trainbus: {missing}"] if missing else []
        for name in sorted(n for n in tb_full.files & tb.files if n.endswith(CONTINUED_FILES)):
            continued = compare_file(name, tb_full.output_dir / name, tb.output_dir / name, ("train_loss",))
            found += [f"trainbus resumed vs uninterrupted: {d}" for d in continued]
    continued = differences(rounded_like_transformers(tb_full), tb, files=False)
    found += [f"trainbus resumed (as 'trainbus') vs uninterrupted (as 'transformers'): {d}" for d in continued]
    return found, runs


def rounded_like_transformers(run: Run) -> Run:
    """``run`` with its logged losses rounded as transformers 4 rounds them, for the harness, which rounds
    the trainbus side's under 4.x: a trainbus run in the transformers role then compares like for like."""
    if not TRANSFORMERS_ROUNDS_LOSS:
        return run
    history = [{**r, "loss": round(float(r["loss"]), 4)} if "loss" in r else r for r in run.log_history]
    return dataclasses.replace(run, log_history=history)


def listing(found: list[str], shown: int = 40) -> str:
    """The differences for an assertion message: the first ``shown`` and how many more."""
    more = f"\n... and {len(found) - shown} more" if len(found) > shown else ""
    return f"{len(found)} differences:\n" + "\n".join(found[:shown]) + more


#: the files a resumed run shares with its uninterrupted run (not the arguments, which name another
#: output_dir, nor the manifests, which hash the files)
CONTINUED_FILES = ("model.safetensors", "trainer_state.json", "_results.json")


def logged_losses(run: Run) -> list[float]:
    return [float(r["loss"]) for r in run.log_history if "loss" in r]
