"""``DPOTrainer``: TRL's direct preference optimisation on trainbus's Trainer, ported by changing the import.

TRL's own utilities prepare the data (its DPO dataset preparation: prompt extraction, EOS, tokenisation of
prompt / chosen / rejected; its ``DataCollatorForPreference``) and make the log-probabilities (its fused LM
head). The loss is the ``DPOLoss`` plugin, the reference the ``ReferencePolicy`` plugin, the metrics
``TRLMetrics``; everything else is the facade's, as for any ``Trainer``.
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
from .configs import DPOConfig
from .dpo_loss import DPOLoss
from .metrics import TRLMetrics
from .reference import ReferencePolicy, precompute

#: the columns TRL's DPOTrainer keeps for its collator
DPO_COLUMNS = ["prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps"]
FUSED_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


class DPOTrainer(Trainer):  # type: ignore[misc]  # mypy reads trainbus.* as Any
    """TRL's ``DPOTrainer`` arguments and behaviour over trainbus's engine (see the module docstring)."""

    #: the loss hook returns the micro-batch's mean over its pairs: accumulation weighs it by its rows
    loss_is_scaled_for_ga = False
    _tag_names: ClassVar[list[str]] = ["trl", "dpo"]
    train_dataset: Any
    eval_dataset: Any

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        args: Any = None,
        data_collator: Callable[[list[Any]], Any] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Callable[[Any], dict[str, float]] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        plugins: list[Any] | None = None,
    ) -> None:
        args = setup.config_from(args, DPOConfig, model, "DPO")
        setup.refuse(args, quantization_config=quantization_config)
        self._refuse_variants(args)
        if train_dataset is None:
            raise ConfigError("DPOTrainer needs a train_dataset")
        set_seed(args.seed)
        model = setup.model_from(model, args)
        if ref_model is not None and ref_model is model:
            raise ConfigError("model and ref_model cannot be the same object: omit ref_model to use a copy")
        processing_class, self._tokenizer = setup.tokenizer_of(processing_class, model)
        if self._tokenizer.pad_token is None:
            self._tokenizer.pad_token = self._tokenizer.eos_token
        model.config.get_text_config().pad_token_id = self._tokenizer.pad_token_id
        model.generation_config.pad_token_id = self._tokenizer.pad_token_id
        model = self._with_adapters(model, peft_config, ref_model)
        if data_collator is None:
            data_collator = self._default_collator(model, args)
        from trl.trainer.dpo_trainer import DPOTrainer as TRLDPOTrainer

        train_dataset = TRLDPOTrainer._prepare_dataset(self, train_dataset, processing_class, args, "train")
        if isinstance(eval_dataset, dict):
            eval_dataset = {k: TRLDPOTrainer._prepare_dataset(self, d, processing_class, args, k)
                            for k, d in eval_dataset.items()}  # fmt: skip
        elif eval_dataset is not None:
            eval_dataset = TRLDPOTrainer._prepare_dataset(self, eval_dataset, processing_class, args, "eval")
        setup.check_lm_head_not_adapted(model)
        ref_model = self._reference_model(model, ref_model, args)
        self.trl_metrics = TRLMetrics()
        self.reference = ReferencePolicy(ref_model, args.gradient_checkpointing_kwargs)
        loss = DPOLoss(self.trl_metrics, self.reference, args.beta, args.loss_type, args.loss_weights)
        super().__init__(
            model, args, data_collator, train_dataset, eval_dataset, processing_class,
            compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
            plugins=[self.trl_metrics, self.reference, loss, *(plugins or [])],
        )  # fmt: skip
        self.ref_model = ref_model
        self._after_init(args)

    # -- TRL's setup ------------------------------------------------------------------------------------
    @staticmethod
    def _refuse_variants(args: Any) -> None:
        if args.f_divergence_type != "reverse_kl" or args.ld_alpha is not None or args.use_weighting:
            raise ConfigNotImplementedError(
                "trainbus.trl's DPO implements the reverse-KL losses without length desensitisation or WPO "
                "weighting: f_divergence_type='reverse_kl', ld_alpha=None, use_weighting=False"
            )
        if args.sync_ref_model:
            raise ConfigNotImplementedError("sync_ref_model=True is not supported by trainbus.trl")

    def _with_adapters(self, model: Any, peft_config: Any, ref_model: Any) -> Any:
        """A new adapter from ``peft_config``; a pretrained adapter without ref_model gets a frozen copy "ref"."""
        if peft_config is not None:
            return setup.with_peft(model, peft_config)
        if setup.is_peft(model) and ref_model is None:
            model.add_adapter("ref", model.peft_config["default"])
            for name, param in model.named_parameters():
                if ".default." in name:
                    model.get_parameter(name.replace(".default.", ".ref.")).data.copy_(param.data)
        return model

    def _default_collator(self, model: Any, args: Any) -> Any:
        from trl.trainer.dpo_trainer import DataCollatorForPreference

        setup.set_pad_token(model, self._tokenizer, args.pad_token)
        return DataCollatorForPreference(
            pad_token_id=self._tokenizer.pad_token_id, max_length=args.max_length,
            truncation_mode=args.truncation_mode, pad_to_multiple_of=args.pad_to_multiple_of,
        )  # fmt: skip

    @staticmethod
    def _reference_model(model: Any, ref_model: Any, args: Any) -> Any:
        """TRL's choice: the given one; none with a peft policy or precomputed log-probs; else a fresh copy
        loaded from the policy's path."""
        if ref_model is not None or setup.is_peft(model) or args.precompute_ref_log_probs:
            return ref_model
        from trl.trainer.utils import create_model_from_path, get_config_model_id

        kwargs = dict(args.model_init_kwargs or {})
        kwargs.setdefault("dtype", model.dtype)
        return create_model_from_path(get_config_model_id(model.config), **kwargs)

    def _after_init(self, args: Any) -> None:
        from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

        if args.disable_dropout:
            disable_dropout_in_model(self.model)
            if self.ref_model is not None:
                disable_dropout_in_model(self.ref_model)
        add_fused_lm_head(setup.base_of(self.model), outputs=FUSED_OUTPUTS)
        if self.ref_model is not None:
            add_fused_lm_head(self.ref_model)
        self._model_for_columns = setup.ColumnsOf(DPO_COLUMNS)
        if callable(getattr(self.model, "add_model_tags", None)):
            self.model.add_model_tags(self._tag_names)
        setup.model_card_at_saves(self)
        if args.precompute_ref_log_probs:
            self._precompute_all(args)

    def _precompute_all(self, args: Any) -> None:
        """The reference log-probabilities of every example, once, before training (TRL's order and batches):
        from the ref model, else the policy as it is now (adapters disabled for a peft policy)."""
        if self.ref_model is not None or setup.is_peft(self.model):
            reference = ReferencePolicy(self.ref_model, args.gradient_checkpointing_kwargs)
        else:
            reference = ReferencePolicy(self.model, args.gradient_checkpointing_kwargs)

        def with_reference(dataset: Any, batch_size: int) -> Any:
            return precompute(dataset, self.data_collator, batch_size, reference, self.model)

        size = args.precompute_ref_batch_size
        self.train_dataset = with_reference(self.train_dataset, size or args.per_device_train_batch_size)
        eval_size = size or args.per_device_eval_batch_size
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {k: with_reference(d, eval_size) for k, d in self.eval_dataset.items()}
        elif self.eval_dataset is not None:
            self.eval_dataset = with_reference(self.eval_dataset, eval_size)

    # -- evaluation: always the loss (the batch has no labels), logits only when asked --------------------
    def prediction_step(
        self, model: torch.nn.Module, inputs: Any, prediction_loss_only: bool, ignore_keys: list[str] | None = None
    ) -> tuple[Any, Any, Any]:
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.hooks.compute_loss(self.hooks.forward(model, inputs), inputs).detach()
            if prediction_loss_only:
                return loss, None, None
            plain = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
            logits = model(**plain, use_cache=False).logits
        return loss, logits, inputs["input_ids"]
