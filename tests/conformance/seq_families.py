"""What the summarization, translation and CTC speech-recognition conformance tests share.

* data the tests write: documents and their summaries, English and its Pig Latin, and spoken letters
  (one sine tone per letter, numpy-made waveforms) with their transcripts;
* tokenizers trained here: a byte-level BPE with BART's special tokens, a metaspace BPE with T5's,
  and a character vocab.json for ``Wav2Vec2CTCTokenizer``;
* the metrics the scripts compute on decoded text (a ROUGE-like overlap, a BLEU-like n-gram
  precision, word and character error rates), written here so nothing is downloaded;
* a check on the output folders: every model folder loads with ``from_pretrained`` with no missing
  key (the resume comparison is families.resume_differences, shared with the other families).
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from harness import BAD, GOOD, NOUNS, Run, sentences


# -- data ------------------------------------------------------------------------------------------------
def summaries(n: int, seed: int) -> list[dict[str, str]]:
    """Sentences of 6 to 14 words; the summary is their mood (more good or more bad adjectives, else plain)
    and their first noun: a tiny model learns the mood within a hundred steps, so its summaries differ."""
    rows = []
    for row in sentences(n, seed, min_words=6, max_words=14):
        balance = sum((w in GOOD) - (w in BAD) for w in row["tokens"])
        mood = "good" if balance > 0 else "bad" if balance < 0 else "plain"
        nouns = [w for w in row["tokens"] if w in NOUNS] or ["nothing"]
        rows.append({"text": row["text"], "summary": f"{mood} {nouns[0]}"})
    return rows


def pig_latin(word: str) -> str:
    return word[1:] + word[0] + "ay"


def translations(n: int, seed: int, source: str = "en", target: str = "pig") -> list[dict[str, Any]]:
    """``{"translation": {source: ..., target: ...}}`` rows, as the translation example reads them."""
    return [
        {"translation": {source: row["text"], target: " ".join(pig_latin(w) for w in row["tokens"])}}
        for row in sentences(n, seed, min_words=3, max_words=8)
    ]


LETTERS = "abcdefgh"
SAMPLING_RATE = 16_000
SAMPLES_PER_LETTER = 64
SAMPLES_PER_SPACE = 32


def utterances(n: int, seed: int) -> list[dict[str, Any]]:
    """Spoken words of 2 to 4 letters (1 to 3 words): each letter a sine tone of its own pitch, a short
    silence between words, noise on top. ``audio`` holds the waveform as the datasets Audio feature does."""
    rng = random.Random(seed)
    noise = np.random.default_rng(seed)
    t = np.arange(SAMPLES_PER_LETTER) / SAMPLING_RATE
    rows = []
    for _ in range(n):
        words = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(1, 3))]
        pieces = []
        for i, word in enumerate(words):
            if i:
                pieces.append(np.zeros(SAMPLES_PER_SPACE))
            pieces += [0.5 * np.sin(2 * np.pi * (500 + 180 * LETTERS.index(c)) * t) for c in word]
        wave = np.concatenate(pieces) + noise.normal(0.0, 0.02, sum(len(p) for p in pieces))
        rows.append({
            "audio": {"array": [round(float(x), 5) for x in wave], "sampling_rate": SAMPLING_RATE},
            "text": " ".join(words).upper(),  # the example lower-cases the transcripts itself
        })  # fmt: skip
    return rows


def write_json_lines(path: Path, rows: Iterable[Any]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return str(path)


def write_splits(directory: Path, rows: Sequence[Any], sizes: dict[str, int]) -> dict[str, str]:
    """``{"train_file": ..., "validation_file": ..., "test_file": ...}``: consecutive slices of ``rows``."""
    files, start = {}, 0
    for split, size in sizes.items():
        files[f"{split}_file"] = write_json_lines(directory / f"{split}.json", rows[start : start + size])
        start += size
    assert start <= len(rows), f"{len(rows)} rows for splits of {sizes}"
    return files


# -- tokenizers ------------------------------------------------------------------------------------------
def write_bart_tokenizer(directory: Path, texts: Iterable[str], vocab_size: int = 200) -> str:
    """A byte-level BPE trained on ``texts`` with BART's special tokens (<s>=0, <pad>=1, </s>=2, <unk>=3,
    <mask>=4) and its template ``<s> A </s>``. Its alphabet is the bytes ``texts`` use, so ``vocab_size``
    leaves room for merges: frequent words become one token, rarer ones several."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials)
    tokenizer.train_from_iterator(list(texts), trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
        mask_token="<mask>",
    )  # fmt: skip
    assert [fast.convert_tokens_to_ids(t) for t in specials] == list(range(5))
    fast.save_pretrained(str(directory))
    return str(directory)


def write_t5_tokenizer(directory: Path, texts: Iterable[str], vocab_size: int = 250) -> str:
    """A BPE over sentencepiece's metaspace pre-tokenizer, trained on ``texts``, with T5's special tokens
    (<pad>=0, </s>=1, <unk>=2) and ``</s>`` appended. (BPE rather than T5's unigram: tokenizers' unigram
    trainer is not deterministic from run to run, its BPE trainer is.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.train_from_iterator(
        list(texts), trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"])
    )
    tokenizer.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tokenizer.decoder = decoders.Metaspace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    assert (fast.pad_token_id, fast.eos_token_id, fast.unk_token_id) == (0, 1, 2)
    fast.save_pretrained(str(directory))
    return str(directory)


# -- metrics on decoded text -------------------------------------------------------------------------------
def _ngrams(words: Sequence[str], n: int) -> Counter[tuple[str, ...]]:
    return Counter(tuple(words[i : i + n]) for i in range(len(words) - n + 1))


def _f1(overlap: int, predicted: int, reference: int) -> float:
    if overlap == 0:
        return 0.0
    precision, recall = overlap / predicted, overlap / reference
    return 2 * precision * recall / (precision + recall)


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        previous = 0
        for j, y in enumerate(b, 1):
            previous, row[j] = row[j], previous + 1 if x == y else max(row[j], row[j - 1])
    return row[-1]


def rouge_like(predictions: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Mean ROUGE-1 / ROUGE-2 / ROUGE-L F1 over the pairs, in percent (words split on whitespace, lower-cased)."""
    scores: dict[str, list[float]] = {"rouge1": [], "rouge2": [], "rougeL": []}
    for prediction, reference in zip(predictions, references, strict=True):
        p, r = prediction.lower().split(), reference.lower().split()
        for n, key in ((1, "rouge1"), (2, "rouge2")):
            pn, rn = _ngrams(p, n), _ngrams(r, n)
            scores[key].append(_f1(sum((pn & rn).values()), sum(pn.values()), sum(rn.values())))
        scores["rougeL"].append(_f1(_lcs(p, r), len(p), len(r)))
    return {k: 100.0 * float(np.mean(v)) if v else 0.0 for k, v in scores.items()}


def bleu_like(predictions: Sequence[str], references: Sequence[str], max_n: int = 4) -> float:
    """Corpus BLEU in percent: clipped n-gram precisions (n = 1..4, add-one smoothed above unigrams),
    their geometric mean, times the brevity penalty."""
    matches, totals = [0] * max_n, [0] * max_n
    predicted_length = reference_length = 0
    for prediction, reference in zip(predictions, references, strict=True):
        p, r = prediction.split(), reference.split()
        predicted_length, reference_length = predicted_length + len(p), reference_length + len(r)
        for n in range(1, max_n + 1):
            pn, rn = _ngrams(p, n), _ngrams(r, n)
            matches[n - 1] += sum((pn & rn).values())
            totals[n - 1] += sum(pn.values())
    if predicted_length == 0 or matches[0] == 0:
        return 0.0
    log_precision = math.log(matches[0] / totals[0])
    log_precision += sum(math.log((matches[i] + 1) / (totals[i] + 1)) for i in range(1, max_n))
    brevity = min(0.0, 1.0 - reference_length / predicted_length)
    return 100.0 * math.exp(brevity + log_precision / max_n)


def chrf_like(predictions: Sequence[str], references: Sequence[str], max_n: int = 3) -> float:
    """Character n-gram F1 in percent (n = 1..3, spaces dropped, corpus counts): partial credit for
    words that are nearly right, where a word-level score is still 0."""
    scores = []
    for n in range(1, max_n + 1):
        overlap = predicted = reference = 0
        for prediction, target in zip(predictions, references, strict=True):
            pn, rn = _ngrams(prediction.replace(" ", ""), n), _ngrams(target.replace(" ", ""), n)
            overlap += sum((pn & rn).values())
            predicted, reference = predicted + pn.total(), reference + rn.total()
        scores.append(_f1(overlap, predicted, reference))
    return 100.0 * float(np.mean(scores))


def edit_distance(a: Sequence[Any], b: Sequence[Any]) -> int:
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        previous, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (x != y))
    return row[-1]


def error_rate(predictions: Sequence[str], references: Sequence[str], unit: Callable[[str], Sequence[Any]]) -> float:
    """Edits over reference units, summed over the corpus (WER with ``str.split``, CER with ``list``)."""
    edits = sum(edit_distance(unit(p), unit(r)) for p, r in zip(predictions, references, strict=True))
    return edits / max(1, sum(len(unit(r)) for r in references))


# -- checks on the output folders ----------------------------------------------------------------------------
def model_folders(run: Run) -> list[Path]:
    """output_dir and each checkpoint folder in it: every folder a model was saved to."""
    return [run.output_dir, *sorted(p for p in run.output_dir.glob("checkpoint-*") if p.is_dir())]


def loading_problems(run: Run, model_class: Any) -> list[str]:
    """``model_class.from_pretrained`` on each model folder: any missing, unexpected or mismatched key."""
    found = []
    for folder in model_folders(run):
        _, info = model_class.from_pretrained(folder, output_loading_info=True)
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
            if info.get(kind):
                found.append(f"{run.implementation} {folder.name}: {kind} {sorted(map(str, info[kind]))[:6]}")
    return found
