"""CTC speech recognition, as transformers' examples/pytorch/speech-recognition/run_speech_recognition_ctc.py.

A wav2vec2 (``AutoModelForCTC``) built from a local config with its feature encoder frozen
(``model.freeze_feature_encoder()``), SpecAugment time masking (numpy's global generator, in the
forward), json lines of waveforms and transcripts, a character vocabulary made from the data
(``vocab.json`` in output_dir -> ``Wav2Vec2CTCTokenizer``), a local ``Wav2Vec2FeatureExtractor``, both
saved and loaded back as one ``Wav2Vec2Processor`` (the trainer's ``processing_class``), the example's
padding collator written anew, ``preprocess_logits_for_metrics`` keeping the argmax, WER and CER of the
decoded text (seq_families), a model card. The example stops at evaluate(); predict() runs on the
eval set. ``main(argv, trainer_module)``: only where Trainer and TrainingArguments come from differs.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from harness import implementation
from seq_families import error_rate
from transformers import (
    AutoConfig,
    AutoFeatureExtractor,
    AutoModelForCTC,
    AutoProcessor,
    HfArgumentParser,
    Wav2Vec2CTCTokenizer,
    Wav2Vec2Processor,
    set_seed,
)
from transformers.trainer_utils import is_main_process


@dataclass
class ModelArguments:
    config_name: str = field(metadata={"help": "Local directory of the model's config (the model is built anew)"})
    feature_extractor_name: str = field(metadata={"help": "Local directory of the feature extractor"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "default: a vocabulary from the data"})
    cache_dir: str | None = field(default=None)
    freeze_feature_encoder: bool = field(default=True)
    attention_dropout: float = field(default=0.0)
    activation_dropout: float = field(default=0.0)
    feat_proj_dropout: float = field(default=0.0)
    hidden_dropout: float = field(default=0.0)
    final_dropout: float = field(default=0.0)
    mask_time_prob: float = field(default=0.05)
    mask_time_length: int = field(default=10)
    layerdrop: float = field(default=0.0)
    ctc_loss_reduction: str = field(default="mean")
    ctc_zero_infinity: bool = field(default=False)


@dataclass
class DataTrainingArguments:
    train_file: str = field(metadata={"help": "json lines with an audio {array, sampling_rate} and a text column"})
    validation_file: str = field(metadata={"help": "the evaluation split, as train_file"})
    dataset_name: str = field(default="synthetic-tones", metadata={"help": "only named in the model card"})
    audio_column_name: str = field(default="audio")
    text_column_name: str = field(default="text")
    chars_to_ignore: list[str] | None = field(default=None)
    eval_metrics: list[str] = field(default_factory=lambda: ["wer", "cer"])
    max_duration_in_seconds: float = field(default=20.0)
    min_duration_in_seconds: float = field(default=0.0)
    unk_token: str = field(default="[UNK]")
    pad_token: str = field(default="[PAD]")
    word_delimiter_token: str = field(default="|")


@dataclass
class DataCollatorCTCWithPadding:
    """Pads the waveforms with the feature extractor and the label ids with the tokenizer, separately (they
    differ in length); label padding becomes -100 so the CTC loss skips it."""

    processor: Any
    padding: bool | str = "longest"

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        audio = [{"input_values": f["input_values"]} for f in features]
        batch = self.processor.feature_extractor.pad(audio, padding=self.padding, return_tensors="pt")
        labels = self.processor.tokenizer.pad(
            [{"input_ids": f["labels"]} for f in features], padding=self.padding, return_tensors="pt"
        )
        batch["labels"] = labels["input_ids"].masked_fill(labels["attention_mask"].ne(1), -100)
        return batch


def vocabulary(raw_datasets: Any, data_args: DataTrainingArguments) -> dict[str, int]:
    """Every character of every split's transcripts, sorted; the space becomes the word delimiter; then unk, pad."""
    characters = sorted({c for split in raw_datasets.values() for text in split["target_text"] for c in text})
    vocab = {c: i for i, c in enumerate(characters)}
    vocab[data_args.word_delimiter_token] = vocab.pop(" ")
    vocab[data_args.unk_token] = len(vocab)
    vocab[data_args.pad_token] = len(vocab)
    return vocab


def main(argv: list[str] | None = None, trainer_module: str = "transformers") -> dict[str, Any]:
    Trainer, TrainingArguments = implementation(trainer_module)
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)

    set_seed(training_args.seed)
    data_files = {"train": data_args.train_file, "eval": data_args.validation_file}
    raw_datasets = datasets.load_dataset("json", data_files=data_files, cache_dir=model_args.cache_dir)
    ignored = f"[{''.join(data_args.chars_to_ignore)}]" if data_args.chars_to_ignore else None

    def normalise_text(example: dict[str, Any]) -> dict[str, Any]:
        text = example[data_args.text_column_name]
        text = re.sub(ignored, "", text) if ignored else text
        return {"target_text": text.lower() + " "}

    with training_args.main_process_first(desc="dataset map special characters removal"):
        raw_datasets = raw_datasets.map(normalise_text, remove_columns=[data_args.text_column_name])

    config = AutoConfig.from_pretrained(model_args.config_name, cache_dir=model_args.cache_dir)
    tokenizer_dir = model_args.tokenizer_name_or_path
    if tokenizer_dir is None:  # the example's vocabulary from the data, written to output_dir
        tokenizer_dir = training_args.output_dir
        vocab_file = Path(tokenizer_dir) / "vocab.json"
        with training_args.main_process_first(desc="dataset map vocabulary creation"):
            if not vocab_file.is_file():
                os.makedirs(tokenizer_dir, exist_ok=True)
                vocab_file.write_text(json.dumps(vocabulary(raw_datasets, data_args)), encoding="utf-8")
    tokenizer = Wav2Vec2CTCTokenizer(
        str(Path(tokenizer_dir) / "vocab.json"), unk_token=data_args.unk_token, pad_token=data_args.pad_token,
        word_delimiter_token=data_args.word_delimiter_token,
    )  # fmt: skip
    feature_extractor = AutoFeatureExtractor.from_pretrained(
        model_args.feature_extractor_name, cache_dir=model_args.cache_dir
    )
    config.update({
        "feat_proj_dropout": model_args.feat_proj_dropout, "attention_dropout": model_args.attention_dropout,
        "hidden_dropout": model_args.hidden_dropout, "final_dropout": model_args.final_dropout,
        "activation_dropout": model_args.activation_dropout, "mask_time_prob": model_args.mask_time_prob,
        "mask_time_length": model_args.mask_time_length, "layerdrop": model_args.layerdrop,
        "ctc_loss_reduction": model_args.ctc_loss_reduction, "ctc_zero_infinity": model_args.ctc_zero_infinity,
        "pad_token_id": tokenizer.pad_token_id, "vocab_size": len(tokenizer),
    })  # fmt: skip
    model = AutoModelForCTC.from_config(config)
    if model_args.freeze_feature_encoder:
        model.freeze_feature_encoder()

    sampling_rate = feature_extractor.sampling_rate
    max_input_length = data_args.max_duration_in_seconds * sampling_rate
    min_input_length = data_args.min_duration_in_seconds * sampling_rate
    input_name = feature_extractor.model_input_names[0]

    def prepare_dataset(example: dict[str, Any]) -> dict[str, Any]:
        audio = example[data_args.audio_column_name]
        if audio["sampling_rate"] != sampling_rate:
            raise ValueError(f"audio at {audio['sampling_rate']} Hz, the feature extractor wants {sampling_rate}")
        waveform = np.asarray(audio["array"], dtype=np.float32)
        inputs = feature_extractor(waveform, sampling_rate=sampling_rate)
        return {
            input_name: getattr(inputs, input_name)[0],
            "input_length": len(waveform),
            "labels": tokenizer(example["target_text"]).input_ids,
        }

    with training_args.main_process_first(desc="dataset map preprocessing"):
        vectorized = raw_datasets.map(prepare_dataset, remove_columns=raw_datasets["train"].column_names)
        vectorized = vectorized.filter(
            lambda length: min_input_length < length < max_input_length, input_columns=["input_length"]
        )

    def preprocess_logits_for_metrics(logits: torch.Tensor, labels: torch.Tensor) -> Any:
        return torch.argmax(logits, dim=-1), labels  # keep only the argmax, as the example does

    def compute_metrics(pred: Any) -> dict[str, float]:
        pred_ids = pred.predictions[0]
        pred_ids = np.where(pred_ids != -100, pred_ids, tokenizer.pad_token_id)  # the collector's padding
        label_ids = np.where(pred.label_ids != -100, pred.label_ids, tokenizer.pad_token_id)
        predicted = tokenizer.batch_decode(pred_ids)
        references = tokenizer.batch_decode(label_ids, group_tokens=False)  # no CTC merging of the references
        units = {"wer": str.split, "cer": list}
        return {name: error_rate(predicted, references, units[name]) for name in data_args.eval_metrics}

    with training_args.main_process_first():  # save everything a processor is loaded from
        if is_main_process(training_args.local_rank):
            feature_extractor.save_pretrained(training_args.output_dir)
            tokenizer.save_pretrained(training_args.output_dir)
            config.save_pretrained(training_args.output_dir)
    try:
        processor = AutoProcessor.from_pretrained(training_args.output_dir)
    except (OSError, KeyError):
        processor = Wav2Vec2Processor.from_pretrained(training_args.output_dir)

    trainer = Trainer(
        model=model,
        data_collator=DataCollatorCTCWithPadding(processor=processor),
        args=training_args,
        compute_metrics=compute_metrics,
        train_dataset=vectorized["train"] if training_args.do_train else None,
        eval_dataset=vectorized["eval"] if training_args.do_eval else None,
        processing_class=processor,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics,
    )
    results: dict[str, Any] = {"trainer": trainer}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(vectorized["train"])
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()
        results["train"] = metrics
    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["eval_samples"] = len(vectorized["eval"])
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results["eval"] = metrics
    if training_args.do_predict:
        results["predict"] = trainer.predict(vectorized["eval"])
    trainer.create_model_card(
        finetuned_from=None, tasks="automatic-speech-recognition",
        tags=["automatic-speech-recognition", data_args.dataset_name],
        dataset_args="Config: na, Training split: train, Eval split: eval",
        dataset=f"{data_args.dataset_name.upper()} - NA",
    )  # fmt: skip
    return results


if __name__ == "__main__":
    main(sys.argv[1:], "transformers")
