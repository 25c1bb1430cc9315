"""Accumulation is exact for real transformers families: the loss protocol (plugins/facade/loss_protocol.py).

In float64, one optimizer step over 4 micro-batches of 2 sequences equals one step over a batch of
8, and both equal an independent step on the mean loss over every item of the 8 (for a causal LM,
the shifted labels). Sequences carry uneven -100 padding so that any miscount shows.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from trainbus.plugins import Trainer, TrainingArguments
from trainbus.plugins.facade.loss_protocol import (
    accepts_loss_kwargs,
    count_shifted_items,
    counted_by_transformers,
    divides_by_items,
    loss_shifts_labels,
)

SEQ, VOCAB, N = 7, 30, 8


def gpt2() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0,
                        embd_pdrop=0, attn_pdrop=0, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config)


def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=2, hidden_size=16, intermediate_size=24, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0,
                         eos_token_id=0, pad_token_id=0)  # fmt: skip
    return LlamaForCausalLM(config)


def t5() -> Any:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=24, num_layers=2,
                                               num_heads=2, dropout_rate=0.0, decoder_start_token_id=0,
                                               pad_token_id=0, eos_token_id=1))  # fmt: skip


def bert_config(**more: Any) -> Any:
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=24, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      max_position_embeddings=SEQ, **more)  # fmt: skip


def bert_mlm() -> Any:
    from transformers import BertForMaskedLM

    return BertForMaskedLM(bert_config())


def bert_tokens() -> Any:
    from transformers import BertForTokenClassification

    return BertForTokenClassification(bert_config(num_labels=5))


FAMILIES: dict[str, Callable[[], Any]] = {
    "gpt2": gpt2, "llama": llama, "t5": t5, "bert_mlm": bert_mlm, "bert_tokens": bert_tokens,
}  # fmt: skip


def uneven_rows(family: str) -> list[dict[str, torch.Tensor]]:
    """8 sequences; sequence i keeps a different number of labels (the rest -100)."""
    g = torch.Generator().manual_seed(11)
    rows = []
    for i in range(N):
        ids = torch.randint(2, VOCAB, (SEQ,), generator=g)
        labels = torch.randint(0, 5, (SEQ,), generator=g) if family == "bert_tokens" else ids.clone()
        keep = 2 + i % 5  # 2..6 labelled positions
        if family == "bert_mlm":
            labels[torch.randperm(SEQ, generator=g)[keep:]] = -100  # masked-LM: scattered labels
        else:
            labels[keep:] = -100
        row = {"input_ids": ids, "labels": labels}
        if family == "t5":
            row = {"input_ids": ids.flip(0), "labels": labels}
        rows.append(row)
    return rows


def one_step(family: str, batch: int, accumulation: int, out: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = FAMILIES[family]().double()
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
        max_steps=1, optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", max_grad_norm=0.0,
        save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True, logging_steps=1,
    )  # fmt: skip
    trainer = Trainer(model, args, train_dataset=uneven_rows(family))
    trainer.train()
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def reference_step(family: str) -> dict[str, torch.Tensor]:
    """SGD with lr 1 on the mean loss over every labelled item of the 8 sequences, computed here."""
    torch.manual_seed(0)
    model = FAMILIES[family]().double()
    rows = uneven_rows(family)
    ids = torch.stack([r["input_ids"] for r in rows])
    labels = torch.stack([r["labels"] for r in rows])
    logits = model(input_ids=ids, labels=labels).logits if family == "t5" else model(input_ids=ids).logits
    if family in ("gpt2", "llama"):  # next-token prediction: position t predicts label t+1
        # transformers' causal-LM loss upcasts the logits to float32 (ForCausalLMLoss): so does this one
        logits, labels = logits[:, :-1].float(), labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    return {n: (p - p.grad).detach() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_accumulation_equals_one_batch_and_the_true_item_mean(family: str, tmp_path: Path) -> None:
    accumulated = one_step(family, 2, 4, tmp_path / "k4")
    whole = one_step(family, 8, 1, tmp_path / "k1")
    reference = reference_step(family)
    worst_pair = max((accumulated[n] - whole[n]).abs().max().item() for n in whole)
    worst_reference = max((whole[n] - reference[n]).abs().max().item() for n in reference)
    moved = max((whole[n] - FAMILIES[family]().double().state_dict()[n]).abs().max().item() for n in reference)
    assert worst_pair < 1e-12, worst_pair
    # the causal LMs' loss is float32 (see reference_step): summation order costs ~1e-8 there; an item
    # miscounted moves an update by ~1e-3 (3.6e-3 for one GPT-2 step before items were counted shifted)
    assert worst_reference < (1e-7 if family in ("gpt2", "llama") else 1e-12), worst_reference
    assert moved > 1e-3  # the step did something


def test_the_protocol_is_read_from_the_model() -> None:
    assert loss_shifts_labels(gpt2()) and loss_shifts_labels(llama())
    assert not loss_shifts_labels(t5()) and not loss_shifts_labels(bert_mlm())
    # transformers 5 gives every family **kwargs (its rule: each takes loss kwargs); measured on a batch,
    # only the causal LMs divide by num_items_in_batch, the others return their own mean
    rows = {family: uneven_rows(family)[:2] for family in FAMILIES}
    batches = {f: {k: torch.stack([r[k] for r in rs]) for k in rs[0]} for f, rs in rows.items()}
    measured = {f: divides_by_items(FAMILIES[f](), batches[f], 5) for f in FAMILIES}
    assert accepts_loss_kwargs(gpt2()) and accepts_loss_kwargs(llama())  # on every supported release
    assert measured == {"gpt2": True, "llama": True, "t5": False, "bert_mlm": False, "bert_tokens": False}
    # what transformers counts: a labels tensor; a detection model's list of dicts is never counted
    assert counted_by_transformers(batches["gpt2"])
    assert not counted_by_transformers({"pixel_values": torch.ones(1), "labels": [{"boxes": torch.ones(1, 4)}]})
    assert divides_by_items(gpt2(), {"input_ids": batches["gpt2"]["input_ids"]}, 5) is None  # no labels: no answer

    class Plain(torch.nn.Module):
        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
            return x

    class Named(torch.nn.Module):  # transformers passes loss kwargs only to a **kwargs forward (or a declared one)
        def forward(self, x: torch.Tensor, labels: Any = None, num_items_in_batch: Any = None) -> Any:
            return x

    assert not accepts_loss_kwargs(Plain()) and not loss_shifts_labels(Plain()) and not accepts_loss_kwargs(Named())
    labels = torch.tensor([[1, 2, -100], [-100, 3, 4]])
    assert count_shifted_items({"labels": labels}) == 3  # the first position of each row predicts nothing
    assert count_shifted_items({"labels": labels, "shift_labels": labels}) == 4


def test_the_model_receives_num_items_in_batch_as_in_transformers(tmp_path: Path) -> None:
    """A model that names num_items_in_batch gets the window's items in training and returns sum / items."""
    seen: list[Any] = []

    class SumOverItems(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))

        def forward(self, x: torch.Tensor, labels: torch.Tensor, num_items_in_batch: Any = None, **kwargs: Any) -> Any:
            seen.append(num_items_in_batch)
            per_item = (x @ self.w - labels) ** 2
            total = per_item.sum()
            return {"loss": total / num_items_in_batch if num_items_in_batch is not None else per_item.mean()}

    g = torch.Generator().manual_seed(0)
    rows = [{"x": torch.randn(3, generator=g, dtype=torch.float64), "labels": torch.randn((), generator=g,
             dtype=torch.float64)} for _ in range(8)]  # fmt: skip
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=4, max_steps=1,
        optim="sgd", learning_rate=1.0, max_grad_norm=0.0, save_strategy="no", report_to="none", disable_tqdm=True,
        use_cpu=True, lr_scheduler_type="constant",
    )  # fmt: skip
    trainer = Trainer(SumOverItems(), args, train_dataset=rows)
    trainer.train()
    # float labels: every element an item, the window's 8; before them the two forwards that measure the
    # protocol on the first micro-batch (its 2 items, then twice that)
    assert [int(n) for n in seen] == [2, 4, 8, 8, 8, 8], seen
    xs = torch.stack([r["x"] for r in rows])
    ys = torch.stack([r["labels"] for r in rows])
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    ((xs @ w - ys) ** 2).mean().backward()
    assert torch.allclose(trainer.model.w.detach(), -w.grad, atol=1e-12, rtol=0)


def test_accumulation_across_two_processes_equals_one_batch(tmp_path: Path) -> None:
    """2 ranks x batch 2 x accumulation 2 (uneven -100 on each rank) equals one process's batch of 8."""
    from dist_helpers import launch_job, results
    from family_jobs import FAMILIES_ACROSS

    launch_job(Path(__file__).with_name("family_jobs.py"), "families", tmp_path, 2)
    got = results(tmp_path, "families")
    for family in FAMILIES_ACROSS:
        whole = one_step(family, 8, 1, tmp_path / f"one-{family}")
        worst = max(
            (torch.tensor(got[family][name], dtype=torch.float64) - value.reshape(-1)).abs().max().item()
            for name, value in whole.items()
        )
        assert worst < 1e-12, (family, worst)
