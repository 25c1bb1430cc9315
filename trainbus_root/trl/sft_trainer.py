"""``SFTTrainer``: TRL's supervised fine-tuning on trainbus's Trainer, ported by changing the import.

What TRL's ``SFTTrainer`` does before training is done with TRL's own data utilities: its dataset
preparation (chat templates, EOS, tokenisation, completion and assistant masks, truncation, ``pack_dataset``
for packing), its ``DataCollatorForLanguageModeling`` (padding-free rows with position ids) and its fused LM
head. Training is trainbus's: the loss is the ``SFTLoss`` plugin on the forward and loss hooks, the metrics
the ``TRLMetrics`` plugin, and accumulation, clipping, schedules, logging, checkpoints and resume are the
facade's plugins, as for any ``Trainer``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from trainbus.engine import ConfigError
from trainbus.engine.errors import ConfigNotImplementedError
from trainbus.plugins import Trainer
from trainbus.plugins.facade.composition import set_seed

from . import setup
from .configs import SFTConfig
from .metrics import TRLMetrics
from .sft_loss import SFTLoss

#: the columns TRL's SFTTrainer keeps for its collator (``_set_signature_columns_if_needed``)
SFT_COLUMNS = ["input_ids", "labels", "seq_lengths"]


class SFTTrainer(Trainer):  # type: ignore[misc]  # mypy reads trainbus.* as Any
    """TRL's ``SFTTrainer`` arguments and behaviour over trainbus's engine (see the module docstring).

    ``model`` is a transformers causal LM, a peft model or a path; ``peft_config`` wraps it in a new adapter.
    ``plugins`` are trainbus plugins attached after the trainer's own, as for ``Trainer``.
    """

    #: the loss hook divides by the window's predicted tokens (``num_items_in_batch``): already normalised
    loss_is_scaled_for_ga = True
    _tag_names: ClassVar[list[str]] = ["trl", "sft"]

    def __init__(
        self,
        model: Any,
        args: Any = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_loss_func: Callable[..., Any] | None = None,
        compute_metrics: Callable[[Any], dict[str, float]] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[Any, Any], Any] | None = None,
        quantization_config: Any = None,
        peft_config: Any = None,
        formatting_func: Callable[[dict[str, Any]], str] | None = None,
        plugins: list[Any] | None = None,
    ) -> None:
        args = setup.config_from(args, SFTConfig, model, "SFT")
        setup.refuse(args, compute_loss_func=compute_loss_func, quantization_config=quantization_config)
        if args.label_smoothing_factor:
            raise ConfigNotImplementedError("label_smoothing_factor is not supported by trainbus.trl's SFTTrainer")
        if train_dataset is None:
            raise ConfigError("SFTTrainer needs a train_dataset")
        set_seed(args.seed)  # before peft makes its adapter's random weights (TRL's order)
        model = setup.model_from(model, args)
        processing_class, self._tokenizer = setup.tokenizer_of(processing_class, model)
        setup.set_eos_token(model, self._tokenizer, args.eos_token)
        processing_class = self._chat_template_file(processing_class, args)
        sample = next(iter(train_dataset))
        if "image" in sample or "images" in sample:
            raise ConfigNotImplementedError("vision datasets are not supported by trainbus.trl")
        model = setup.with_peft(model, peft_config)
        if setup.is_peft(model) and args.gradient_checkpointing:
            model.enable_input_require_grads()  # TRL's: checkpointed adapters need grads on the inputs
        self._formatting_func = formatting_func
        self._choose_losses(args, sample, processing_class)
        if data_collator is None:
            data_collator = self._default_collator(model, args)
        elif self.padding_free:
            raise ConfigError("a custom data_collator cannot be used with padding_free (or bfd packing)")
        self._skip_prepare = bool((args.dataset_kwargs or {}).get("skip_prepare_dataset", False))
        self._prepared: set[int] = set()
        train_dataset = self._prepare(train_dataset, args, args.packing, "train")
        eval_dataset = self._prepare_eval(eval_dataset, args)
        setup.check_lm_head_not_adapted(model)
        self.trl_metrics = TRLMetrics()
        sft_loss = SFTLoss(self.trl_metrics, args.loss_type, token_mean_in_eval=self.padding_free)
        super().__init__(
            model, args, data_collator, train_dataset, eval_dataset, processing_class,
            compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            plugins=[self.trl_metrics, sft_loss, *(plugins or [])],
        )  # fmt: skip
        self._after_init(("log_probs", "entropy", "is_top1"))

    def _after_init(self, outputs: tuple[str, ...]) -> None:
        """TRL's steps after transformers' constructor: the fused head, the kept columns, the model tags,
        the model card written with every checkpoint."""
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(setup.base_of(self.model), outputs=outputs)
        self._model_for_columns = setup.ColumnsOf(SFT_COLUMNS)
        if callable(getattr(self.model, "add_model_tags", None)):
            self.model.add_model_tags(self._tag_names)
        setup.model_card_at_saves(self)

    # -- TRL's choices, from the arguments and the first example ------------------------------------
    def _chat_template_file(self, processing_class: Any, args: Any) -> Any:
        path = args.chat_template_path
        if path is None:
            return processing_class
        if not str(path).endswith((".jinja", ".j2")):
            raise ConfigNotImplementedError(
                "chat_template_path naming a model (TRL clones its template and tokens) is not supported by "
                "trainbus.trl: give a .jinja file"
            )
        with open(path, encoding="utf-8") as f:
            processing_class.chat_template = f.read()
        return processing_class

    def _choose_losses(self, args: Any, sample: Any, processing_class: Any) -> None:
        """padding_free, the training chat template (assistant masks) and completion_only_loss, as TRL picks them."""
        from trl.chat_template_utils import get_training_chat_template, has_generation_markers
        from trl.data_utils import is_conversational

        self.padding_free = args.padding_free or (args.packing and args.packing_strategy in {"bfd", "bfd_split"})
        if self.padding_free and not args.packing and args.max_length is not None:
            raise ConfigError(
                "padding_free=True without packing does not enforce max_length: enable packing "
                "(packing=True, packing_strategy='bfd'), give truncated inputs, or set max_length=None"
            )
        if args.assistant_only_loss and not is_conversational(sample):
            raise ConfigError("assistant_only_loss=True needs a conversational dataset (a 'messages' column)")
        self.chat_template = None
        if args.assistant_only_loss and not has_generation_markers(processing_class.chat_template):
            self.chat_template = get_training_chat_template(processing_class)
        if args.completion_only_loss is None:
            self.completion_only_loss = "prompt" in sample and "completion" in sample
        else:
            self.completion_only_loss = args.completion_only_loss
        if self.completion_only_loss and self._formatting_func is not None:
            raise ConfigError("formatting_func cannot be used with completion_only_loss=True")

    def _default_collator(self, model: Any, args: Any) -> Any:
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        setup.set_pad_token(model, self._tokenizer, args.pad_token)
        return DataCollatorForLanguageModeling(
            pad_token_id=self._tokenizer.pad_token_id,
            padding_free=self.padding_free,
            pad_to_multiple_of=args.pad_to_multiple_of,
        )

    # -- datasets: TRL's preparation ----------------------------------------------------------------------
    def _prepare(self, dataset: Any, args: Any, packing: bool, name: str) -> Any:
        """TRL's SFT dataset preparation (its own function, run with this trainer's choices)."""
        if self._skip_prepare or dataset is None:
            return dataset
        from trl.trainer.sft_trainer import SFTTrainer as TRLSFTTrainer

        prepared = TRLSFTTrainer._prepare_dataset(
            self, dataset, self._tokenizer, args, packing, self._formatting_func, name
        )
        self._prepared.add(id(prepared))
        return prepared

    def _prepare_eval(self, eval_dataset: Any, args: Any) -> Any:
        packing = args.packing if args.eval_packing is None else args.eval_packing
        if isinstance(eval_dataset, dict):
            return {key: self._prepare(d, args, packing, key) for key, d in eval_dataset.items()}
        return self._prepare(eval_dataset, args, packing, "eval")

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """A dataset given to ``evaluate()`` is prepared as the trainer's own were (TRL's ``evaluate``)."""
        if eval_dataset is not None and not isinstance(eval_dataset, str) and id(eval_dataset) not in self._prepared:
            packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing
            eval_dataset = self._prepare(eval_dataset, self.args, packing, "eval")
        return super().get_eval_dataloader(eval_dataset)

    # -- evaluation: the loss (and TRL's metrics) from the fused head; logits only when asked ---------------
    def prediction_step(
        self, model: torch.nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[Any, Any, Any]:
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.hooks.compute_loss(self.hooks.forward(model, inputs), inputs).detach()
            if prediction_loss_only:
                return loss, None, None
            plain = {k: v for k, v in inputs.items() if k != "labels"}
            logits = model(**plain, use_cache=False).logits  # TRL's extra forward: the fused head makes none
        return loss, logits, inputs.get("labels")
