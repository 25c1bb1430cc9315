"""CTC speech recognition (wav2vec2, frozen feature encoder, SpecAugment): transformers.Trainer vs trainbus.

The checkpoint folders and the final model folder must hold the frozen feature encoder too: each
loads with ``Wav2Vec2ForCTC.from_pretrained`` with no missing key, and its frozen weights are the
initial ones (the same tensors under both trainers).
"""

from __future__ import annotations

from pathlib import Path

import run_speech_recognition_ctc
from families import listing, resume_differences
from harness import assert_same, check_losses_logged, common_argv, run_both
from seq_families import loading_problems, utterances, write_splits

SPLITS = {"train": 24, "validation": 10}  # eval batches of 4: 4, 4, 2 (the Trainer weighs them right)
# group_by_length stays off (its default; transformers 5 has no such argument)


def write_model_inputs(directory: Path) -> dict[str, str]:
    """A tiny wav2vec2 config (8x downsampling: about 8 frames per spoken letter) and its feature extractor."""
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor

    config = Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, conv_dim=(16, 16),
        conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=2,
        feat_extract_norm="layer", do_stable_layer_norm=True, vocab_size=16,
    )  # fmt: skip
    config.save_pretrained(directory / "config")
    extractor = Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=16_000, padding_value=0.0, do_normalize=True, return_attention_mask=True
    )
    extractor.save_pretrained(directory / "feature_extractor")
    return {"config_name": str(directory / "config"), "feature_extractor_name": str(directory / "feature_extractor")}


def argv_for(tmp_path: Path, **overrides: object):
    files = write_splits(tmp_path / "data", utterances(sum(SPLITS.values()), seed=6), SPLITS)
    model_inputs = write_model_inputs(tmp_path / "model")

    def argv(name: str) -> list[str]:
        arguments = {
            "per_device_eval_batch_size": 4, "learning_rate": 3e-3, "mask_time_length": 2, "hidden_dropout": 0.1,
            **overrides,
        }  # fmt: skip
        return common_argv(tmp_path / name, cache_dir=tmp_path / f"cache-{name}", **files, **model_inputs, **arguments)

    return argv


def test_speech_recognition_ctc_matches_transformers(tmp_path: Path) -> None:
    from transformers import Wav2Vec2ForCTC

    hf, tb = run_both(run_speech_recognition_ctc.main, argv_for(tmp_path))
    check_losses_logged(hf)
    assert {"eval_wer", "eval_cer"} <= set(hf.eval_metrics)
    assert hf.predictions[0].shape[0] == SPLITS["validation"] and hf.predictions[0].dtype.kind == "i"  # argmax ids
    assert_same(hf, tb)
    problems = loading_problems(hf, Wav2Vec2ForCTC) + loading_problems(tb, Wav2Vec2ForCTC)
    assert not problems, "the frozen feature encoder must be saved:\n" + "\n".join(problems)


def test_resume_matches_transformers(tmp_path: Path) -> None:
    """Resumed mid-epoch from checkpoint-4 (of 12 steps): SpecAugment's numpy draws continue as uninterrupted."""
    argv = argv_for(tmp_path, save_strategy="steps", save_steps=4, save_total_limit=3)
    found, runs = resume_differences(run_speech_recognition_ctc.main, argv, tmp_path, step=4)
    check_losses_logged(runs["transformers"][1])
    assert not found, listing(found)
