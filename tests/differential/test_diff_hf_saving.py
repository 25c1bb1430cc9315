"""Saving scenarios of transformers' test_trainer_checkpointing.py (TrainerSavingTest, TrainerCheckpointSaveTest,
JITCheckpointTest) not ported before: what save_model() and each checkpoint write beside the weights, and the
checkpoint on SIGTERM that ``enable_jit_checkpoint`` asks for.

transformers' tests read their tokenizer, image processor and feature extractor from the Hub; here each is
built from code (a word-level tokenizer, ``ViTImageProcessor()``, ``Wav2Vec2FeatureExtractor()``), and each
is read back with its own class's ``from_pretrained``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time

import pytest
import transformers
from hf_diff import RegressionConfig, RegressionPreTrainedModel, checkpoint_names, regression_trainer, run_both


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "[PAD]", "this", "is", "a", "test", "sentence"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", model_max_length=12)


def _image_processor():
    from transformers import ViTImageProcessor

    return ViTImageProcessor(size={"height": 8, "width": 8}, image_mean=[0.1, 0.2, 0.3])


def _feature_extractor():
    from transformers import Wav2Vec2FeatureExtractor

    return Wav2Vec2FeatureExtractor(sampling_rate=8000, padding_value=0.5)


def _processor(tmp_path):
    from transformers import Wav2Vec2CTCTokenizer, Wav2Vec2Processor

    vocab = tmp_path / "vocab.json"
    vocab.write_text(json.dumps({"<pad>": 0, "<unk>": 1, "|": 2, "a": 3, "b": 4}))
    return Wav2Vec2Processor(feature_extractor=_feature_extractor(), tokenizer=Wav2Vec2CTCTokenizer(str(vocab)))


def _same_tokenizer(saved, loaded) -> bool:
    # tokenizers have no to_dict: as transformers' test, compare what they encode
    text = "this is a test sentence"
    return saved(text, padding="max_length").input_ids == loaded(text, padding="max_length").input_ids


PROCESSING = ("tokenizer", "image_processor", "feature_extractor", "processor")


@pytest.mark.parametrize("kind", PROCESSING)
def test_processing_class_saved__mirrors_test_trainer_saves(tmp_path, kind):
    """test_trainer_saves_tokenizer / _image_processor / _feature_extractor / _processor."""

    def scenario(impl, d):
        if kind == "processor":
            made = _processor(d)
        else:
            made = {
                "tokenizer": _tokenizer,
                "image_processor": _image_processor,
                "feature_extractor": _feature_extractor,
            }[kind]()
        out = d / "out"
        model = RegressionPreTrainedModel(RegressionConfig(a=1.5, b=2.5))
        impl.Trainer(model=model, args=impl.args(out), processing_class=made).save_model()
        loaded = type(made).from_pretrained(str(out))
        if kind == "tokenizer":
            same = _same_tokenizer(made, loaded)
        elif kind == "processor":
            same = loaded.feature_extractor.to_dict() == made.feature_extractor.to_dict() and (
                loaded.tokenizer.get_vocab() == made.tokenizer.get_vocab()
            )
        else:
            same = loaded.to_dict() == made.to_dict()
        return same, sorted(p.name for p in out.iterdir() if p.suffix == ".json")

    (hf_same, hf_files), (tb_same, tb_files) = run_both(scenario, tmp_path)
    assert hf_same and tb_same
    assert set(hf_files) - {"training_args.json"} <= set(tb_files), (hf_files, tb_files)


class _CollatorWithTokenizer:
    """A data collator that carries a tokenizer (transformers saves it when processing_class is None)."""

    def __init__(self) -> None:
        self.tokenizer = _tokenizer()
        self.tokenizer.add_tokens(["<NEW_TOKEN1>", "<NEW_TOKEN2>"])

    def __call__(self, features):
        from transformers import default_data_collator

        return default_data_collator(features)


def test_collator_tokenizer_saved__mirrors_test_save_collator_tokenizer_by_default(tmp_path):
    from transformers import PreTrainedTokenizerFast

    def scenario(impl, d):
        collator = _CollatorWithTokenizer()
        trainer = regression_trainer(impl, d, save_steps=5, max_steps=5, trainer_kwargs={"data_collator": collator})
        trainer.train()
        loaded = PreTrainedTokenizerFast.from_pretrained(str(d / "checkpoint-5"))
        return len(loaded), len(collator.tokenizer), _same_tokenizer(collator.tokenizer, loaded)

    hf, tb = run_both(scenario, tmp_path)
    assert hf == (9, 9, True)
    assert tb == hf


@pytest.mark.skipif(
    "enable_jit_checkpoint" not in {f.name for f in dataclasses.fields(transformers.TrainingArguments)},
    reason="transformers' JIT checkpoint came after this release",
)
def test_checkpoint_on_sigterm__mirrors_JITCheckpointTest(tmp_path):
    """enable_jit_checkpoint: a SIGTERM during training ends it early with a complete checkpoint, from which a
    resume ends on the uninterrupted run's weights. transformers waits its kill_wait (3 s) before it saves;
    the callback below sleeps past that once, so both see the request within a step or two."""

    def scenario(impl, d):
        class Terminate(impl.TrainerCallback):
            sent = False

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 2 and not self.sent:
                    self.sent = True
                    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                        raise AssertionError("no SIGTERM handler is installed: the signal would end the test run")
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(3.5)

        common = {"learning_rate": 0.1, "max_steps": 10, "save_steps": 10, "per_device_train_batch_size": 16}
        full = regression_trainer(impl, d / "full", pretrained=True, **common)
        full.train()
        stopped = regression_trainer(
            impl,
            d / "stopped",
            pretrained=True,
            enable_jit_checkpoint=True,
            trainer_kwargs={"callbacks": [Terminate()]},
            **common,
        )
        stopped.train()
        names = checkpoint_names(d / "stopped")
        incomplete = [n for n in names if (d / "stopped" / n / "checkpoint-is-incomplete.txt").exists()]
        resumed = regression_trainer(impl, d / "stopped", pretrained=True, **common)
        resumed.train(resume_from_checkpoint=str(d / "stopped" / names[-1]))
        same = (resumed.model.a.item(), resumed.model.b.item()) == (full.model.a.item(), full.model.b.item())
        return stopped.state.global_step < 10, bool(names) and int(names[-1].split("-")[1]) < 10, incomplete, same

    hf, tb = run_both(scenario, tmp_path)
    assert hf == (True, True, [], True)
    assert tb == hf
