"""The facade follows what transformers models and scripts declare (#22): columns, outputs, counts, seeds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainbus.plugins import Trainer, TrainingArguments
from trainbus.plugins.data.loading import build_dataloader, fetch_one_ahead, resumable_epoch_iterator

WORDS = ["good", "bad", "fine", "awful", "great", "poor", "ok", "nice"]


def local_tokenizer(directory: Path) -> Any:
    """A word-level tokenizer saved to and loaded back from ``directory`` (no hub)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)


def tiny_bert(**more: Any) -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=len(WORDS) + 2, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, num_labels=2, **more)  # fmt: skip
    return BertForSequenceClassification(config)


def text_dataset(tokenizer: Any, n: int) -> Any:
    import datasets

    g = np.random.default_rng(0)
    texts = [" ".join(g.choice(WORDS, size=int(g.integers(2, 6)))) for _ in range(n)]
    raw = datasets.Dataset.from_dict({"text": texts, "label": [int("good" in t) for t in texts]})
    return raw.map(lambda batch: tokenizer(batch["text"], truncation=True), batched=True)


def args_for(out: Path, **more: Any) -> TrainingArguments:
    options: dict[str, Any] = dict(
        output_dir=str(out), per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=2,
        save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
    )  # fmt: skip
    return TrainingArguments(**{**options, **more})


def test_a_raw_text_column_is_removed_for_a_kwargs_forward(tmp_path: Path) -> None:
    """BERT's forward takes **kwargs; the text column must still go before the padding collator (as HF)."""
    from transformers import DataCollatorWithPadding

    tokenizer = local_tokenizer(tmp_path / "tok")
    data = text_dataset(tokenizer, 16)
    assert "text" in data.column_names
    trainer = Trainer(tiny_bert(), args_for(tmp_path / "run"), train_dataset=data, eval_dataset=data,
                      data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer)  # fmt: skip
    assert trainer.train().global_step == 2
    assert np.isfinite(trainer.evaluate()["eval_loss"])
    # total_flos as transformers counts it: 6 x input tokens x non-embedding parameters, also when
    # the collator returns a BatchEncoding (a UserDict, not a dict)
    assert trainer.state.total_flos > 0
    loader = trainer.get_train_dataloader()
    first_two = [b for _, b in zip(range(2), loader, strict=False)]
    tokens = sum(int(b["input_ids"].numel()) for b in first_two)
    assert trainer.state.total_flos == 6 * tokens * trainer.model.num_parameters(exclude_embeddings=True)


def test_a_compute_loss_that_pops_the_labels_keeps_eval_loss_and_metrics(tmp_path: Path) -> None:
    class PoppingTrainer(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):  # type: ignore[no-untyped-def]
            labels = inputs.pop("labels")  # as transformers' docs show
            outputs = model(**inputs)
            loss = torch.nn.functional.cross_entropy(outputs["logits"], labels)
            return (loss, outputs) if return_outputs else loss

    rows = [{"input_ids": torch.tensor([2 + i % 8, 3, 4]), "labels": torch.tensor(i % 2)} for i in range(12)]
    seen: list[Any] = []

    def metrics(prediction: Any) -> dict[str, float]:
        seen.append(prediction.label_ids)
        return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}

    trainer = PoppingTrainer(tiny_bert(), args_for(tmp_path), train_dataset=rows, eval_dataset=rows,
                             compute_metrics=metrics)  # fmt: skip
    trainer.train()
    result = trainer.evaluate()
    assert "eval_loss" in result and "eval_accuracy" in result
    assert list(seen[-1]) == [i % 2 for i in range(12)]


def test_a_causal_lm_with_use_cache_returns_no_cache_in_predictions(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=20, n_positions=8,
                                       bos_token_id=0, eos_token_id=0))  # fmt: skip
    rows = [{"input_ids": torch.arange(i, i + 6) % 20, "labels": torch.arange(i, i + 6) % 20} for i in range(6)]
    trainer = Trainer(model, args_for(tmp_path, use_cache=True), train_dataset=rows)
    assert model.config.use_cache is True  # args.use_cache is applied to the config, as transformers 5 does
    out = trainer.predict(rows)  # the forward returns a DynamicCache: never a prediction
    assert isinstance(out.predictions, np.ndarray) and out.predictions.shape == (6, 6, 20)
    assert "test_loss" in out.metrics


def test_train_output_epoch_and_fractions_as_transformers(tmp_path: Path) -> None:
    rows = [{"input_ids": torch.tensor([2 + i % 8, 3]), "labels": torch.tensor(i % 2)} for i in range(50)]
    args = args_for(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=3,
                    logging_steps=1)  # fmt: skip
    trainer = Trainer(tiny_bert(), args, train_dataset=rows)
    output = trainer.train()
    epochs = [e["epoch"] for e in trainer.state.log_history if "loss" in e]
    assert epochs == pytest.approx([4 / 25, 8 / 25, 12 / 25])  # micro-batches done / 25 per epoch
    assert output.metrics["epoch"] == pytest.approx(12 / 25)


def test_trainer_accelerator_serves_hf_scripts(tmp_path: Path) -> None:
    model = tiny_bert()
    trainer = Trainer(model, args_for(tmp_path))
    accelerator = trainer.accelerator
    assert accelerator.is_main_process and accelerator.num_processes == 1
    values = torch.arange(5)
    assert torch.equal(accelerator.gather_for_metrics(values), values)
    assert accelerator.unwrap_model(model) is model
    accelerator.wait_for_everyone()


class RandomItems(torch.utils.data.Dataset[torch.Tensor]):
    """Each item draws from the RNG of the process that loads it: a random augmentation."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(()) + index


def epoch_values(workers: int, epoch: int, skip: int = 0) -> list[float]:
    loader = build_dataloader(
        RandomItems(), batch_size=2, shuffle=True, seed=3, num_workers=workers, collate_fn=torch.stack
    )
    return [float(x) for batch in resumable_epoch_iterator(loader, epoch, skip) for x in batch]


def test_worker_draws_differ_per_epoch_and_resume_bit_for_bit() -> None:
    first, second = epoch_values(2, 0), epoch_values(2, 1)
    assert sorted(int(v) for v in first) == sorted(int(v) for v in second) == list(range(12))
    assert {v % 1 for v in first}.isdisjoint({v % 1 for v in second})  # augmentation does not repeat
    assert epoch_values(2, 1) == second  # the same epoch draws the same
    assert epoch_values(2, 1, skip=3) == second[6:]  # resumed after 3 batches: the rest, bit for bit
    assert epoch_values(1, 1) == second  # the draws do not depend on the worker count


def test_batches_are_fetched_one_ahead_as_accelerate_does() -> None:
    made: list[int] = []

    def batches() -> Any:
        for i in range(3):
            made.append(i)
            yield i

    seen = []
    for batch in fetch_one_ahead(batches()):
        seen.append((batch, list(made)))
    assert seen == [(0, [0, 1]), (1, [0, 1, 2]), (2, [0, 1, 2])]


def test_save_model_writes_a_model_folder_without_pickle(tmp_path: Path) -> None:
    import json

    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    tokenizer = local_tokenizer(tmp_path / "tok")
    data = text_dataset(tokenizer, 8)
    trainer = Trainer(tiny_bert(), args_for(tmp_path / "run"), train_dataset=data,
                      data_collator=DataCollatorWithPadding(tokenizer), processing_class=tokenizer)  # fmt: skip
    trainer.train()
    out = tmp_path / "final"
    trainer.save_model(str(out))
    loaded = AutoModelForSequenceClassification.from_pretrained(out)
    for (name, a), b in zip(trainer.model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert AutoTokenizer.from_pretrained(out)("good bad")["input_ids"] == tokenizer("good bad")["input_ids"]
    assert json.loads((out / "training_args.json").read_text())["learning_rate"] == trainer.args.learning_rate
    assert not [p.name for p in out.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".pkl")]


def test_a_finished_pass_moves_the_shuffle_on_without_set_epoch() -> None:
    """A custom loader that wraps trainbus's and never calls set_epoch still gets a new order each epoch."""
    from trainbus.plugins.data.loading import EpochSampler

    sampler = EpochSampler(20, seed=0)
    first, second = list(sampler), list(sampler)
    assert first != second and sorted(first) == sorted(second) == list(range(20))
    sampler.set_epoch(0)
    assert list(sampler) == first  # set_epoch still pins the order (resume)


def test_an_iterable_dataset_counts_max_steps_as_its_epoch(tmp_path: Path) -> None:
    """As transformers: without a length, the epoch fraction is the share of max_steps done."""

    class Stream(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
        def __iter__(self) -> Any:
            for i in range(1000):
                yield {"input_ids": torch.tensor([2 + i % 8, 3]), "labels": torch.tensor(i % 2)}

    args = args_for(tmp_path, per_device_train_batch_size=2, max_steps=4, logging_steps=1)
    trainer = Trainer(tiny_bert(), args, train_dataset=Stream())
    trainer.train()
    assert [e["epoch"] for e in trainer.state.log_history if "loss" in e] == [0.25, 0.5, 0.75, 1.0]
