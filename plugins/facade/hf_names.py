"""Every method of transformers' ``Trainer`` / ``Seq2SeqTrainer``, classified: what trainbus does with it.

transformers' Trainer is a class that subclasses override, public methods and private ones alike. A port
that knows only the names it listed ignores the rest without a word: a subclass's ``_save`` or
``_maybe_log_save_evaluate`` would simply never run. So every name of the supported releases (4.57 to
the newest; ``tests/test_hf_total_surface.py`` enumerates the installed release and fails on a name
missing here) is in exactly one of three tables:

- ``HONOURED``: trainbus has the method with transformers' signature and meaning, and calls a subclass's
  override where transformers calls it (the test records the calls under both and compares).
- ``OFFERED``: trainbus has it with transformers' meaning for a script to call; transformers itself
  never calls it inside train / evaluate / predict / save / load, so an override is the script's own.
- ``REFUSED``: trainbus does not call it (the engine does that work in a plugin). A subclass that
  overrides it is refused when the Trainer is built, with the message naming the plugin to use; calling
  it (where trainbus has no method of the name) raises the same message.

The value of each entry says where (honoured), what (offered) or what to use instead (refused).
"""

from __future__ import annotations

from typing import Any

from trainbus.engine import ConfigError

HONOURED: dict[str, str] = {
    "__init__": "the constructor: HF's arguments",
    "train": "the script's call",
    "evaluate": "every scheduled evaluation and the script's call; its metrics drive best model and early stopping",
    "predict": "the script's call",
    "training_step": "every micro-batch",
    "compute_loss": "every micro-batch and evaluation batch, with num_items_in_batch",
    "prediction_step": "every evaluation and prediction batch",
    "evaluation_loop": "evaluate() and predict()",
    "get_train_dataloader": "train()",
    "get_eval_dataloader": "every evaluate()",
    "get_test_dataloader": "predict()",
    "_get_train_sampler": "the train loader",
    "get_batch_samples": "every training window (its micro-batches and num_items_in_batch)",
    "_get_num_items_in_batch": "every training window (its num_items_in_batch)",
    "_get_eval_sampler": "every evaluation and prediction loader",
    "_get_dataloader": "get_train_dataloader / get_eval_dataloader / get_test_dataloader",
    "_remove_unused_columns": "every loader of a datasets.Dataset (remove_unused_columns)",
    "_get_collator_with_removed_columns": "every loader of another dataset (remove_unused_columns)",
    "_prepare_input": "every training and evaluation batch (through _prepare_inputs)",
    "_prepare_inputs": "every training and evaluation batch, as it moves to the device",
    "compute_loss_context_manager": "every micro-batch's loss and every evaluation batch's forward",
    "autocast_smart_context_manager": "compute_loss_context_manager's context",
    "create_optimizer": "train()",
    "create_scheduler": "train()",
    "create_optimizer_and_scheduler": "train(), when create_scheduler or it is overridden",
    "get_optimizer_cls_and_kwargs": "create_optimizer()",
    "get_decay_parameter_names": "create_optimizer(): the weight-decay group",
    "log": "every log record (steps, evaluations, the train summary)",
    "floating_point_ops": "every micro-batch (total_flos)",
    "_set_signature_columns_if_needed": "_remove_unused_columns / _get_collator_with_removed_columns, before they read "
    "_signature_columns (a subclass may set its own columns there)",
    "_evaluate": "every scheduled evaluation; the metrics it returns decide the best checkpoint, save_strategy="
    "'best' and early stopping (also when patched on the instance, as transformers' tests do)",
    "load_generation_config": "Seq2SeqTrainer's constructor, for a generation_config argument",
    "_pad_tensors_to_max_len": "Seq2SeqTrainer.prediction_step, generated tokens padded to the max length",
    "save_model": "every checkpoint (its folder, before it is committed; _internal_call=True) and the script's call",
    "_save": "save_model(), in every checkpoint and for the final model",
    "_save_checkpoint": "every checkpoint save; its super() writes trainbus's checkpoint (atomic, verified)",
    "_load_from_checkpoint": "resume_from_checkpoint, once the checkpoint is verified; its super() applies the weights",
    "_load_best_model": "the end of training with load_best_model_at_end and a best checkpoint",
    "_issue_warnings_after_load": "after the weights load of _load_from_checkpoint and _load_best_model",
    "_maybe_log_save_evaluate": "after every optimizer step's on_step_end and every epoch's on_epoch_end, with "
    "transformers' arguments (tr_loss accumulating since the last log, grad_norm, learning_rate, ...); its "
    "decisions replace the engine's logging, evaluation and saving for the run, its super() logs, evaluates "
    "(_evaluate) and saves (_save_checkpoint) as transformers' does",
    "_get_learning_rate": "every optimizer step, before the scheduler moves; the learning_rate logged is its value",
    "_clip_grad_norm": "every optimizer step with max_grad_norm > 0, after the gradients are unscaled (its norm goes "
    "to _get_grad_norm)",
    "store_flos": "every training log, every checkpoint save and the end of training (the FloCounter plugin moves "
    "the count into state.total_flos through it)",
    "_get_grad_norm": "every optimizer step, after _clip_grad_norm; the grad_norm logged (and given to "
    "_maybe_log_save_evaluate) is its value",
}

OFFERED: dict[str, str] = {
    "get_learning_rates": "each parameter group's learning rate",
    "get_num_trainable_parameters": "the count of parameters with requires_grad",
    "get_optimizer_group": "a parameter's group, or every group's parameters",
    "log_metrics": "HF's formatted print, main process only",
    "metrics_format": "metrics formatted for printing",
    "save_metrics": "{split}_results.json and all_results.json",
    "save_state": "trainer_state.json in output_dir",
    "hyperparameter_search": "optuna",
    "pop_callback": "a callback or plugin removed and returned",
    "remove_callback": "a callback or plugin removed",
    "create_model_card": "README.md next to the saved model (no Hub)",
    "end": "the end of a script: trackers finished, the process group destroyed",
    "num_tokens": "the tokens of a loader's batches",
    "tokenizer": "the processing class (transformers 4.x's deprecated alias)",
    "prediction_loop": "transformers 4.x's legacy name of evaluation_loop",
}

_CHECKPOINTING = "the Checkpointing plugin (trainbus.plugins.Checkpointing) or a callback's on_save"
_SAVE_STATES = (
    "a _save_checkpoint override (call super(), then add files to args.output_dir/checkpoint-<global_step>) or a "
    "_save / save_model override (called with the checkpoint's folder before it is committed): trainbus writes the "
    "optimizer, scheduler, scaler and RNG states itself, as safetensors + JSON listed in manifest.json, not pickle"
)
_LOAD_STATES = (
    "a _load_from_checkpoint override (called on resume with the verified checkpoint's path) to read files of your "
    "own: trainbus restores the optimizer, scheduler, scaler and RNG states from the verified checkpoint in one step"
)
_LOOP = "the engine's loop: add a plugin on its events (trainbus.engine.Event) or an HF callback"
_DATA = "get_train_dataloader / get_eval_dataloader / get_test_dataloader, or the data collator"
_NO_HUB = "trainbus never talks to the Hub: upload the saved folder with huggingface_hub yourself"
_ACCELERATE = "the Distributed plugin, which sets up accelerate from TrainingArguments and `accelerate config`"

REFUSED: dict[str, str] = {
    # the loop itself: trainbus's engine runs it, with events for every point transformers' loop has
    "_inner_training_loop": _LOOP,
    "_run_epoch": _LOOP,
    "_init_training_state": _LOOP,
    "_prepare_for_training": _LOOP,
    "_finalize_training": _LOOP + " (Event.TRAIN_END)",
    "_determine_best_metric": "metric_for_best_model / greater_is_better (the BestMetric plugin keeps "
    "state.best_metric at each evaluation's EVAL_END, before checkpoints and early stopping read it), or an evaluate() "
    "override returning the metric; trainbus's _determine_best_metric answers whether the latest evaluation set the "
    "best (for a copied _maybe_log_save_evaluate body)",
    "_track_num_input_tokens": "include_num_input_tokens_seen (the TokenCounter plugin)",
    "set_initial_training_values": "max_steps / num_train_epochs (the engine plans the run)",
    "get_total_train_batch_size": "per_device_train_batch_size x gradient_accumulation_steps (the engine plans "
    "the run)",
    "num_examples": _DATA,
    "_update_auto_batch_size": "auto_find_batch_size",
    # data loading internals
    "_prepare_context_parallel_inputs": "trainbus has no context parallelism",
    # checkpoints: the Checkpointing plugin writes and reads them (safetensors and JSON, verified)
    "_get_output_dir": "args.output_dir (checkpoints are args.output_dir/checkpoint-N; a search trial's args are "
    "its run folder's)",
    "_save_rng_state": _SAVE_STATES,
    "_save_optimizer_and_scheduler": _SAVE_STATES,
    "_save_scaler": _SAVE_STATES,
    "_load_rng_state": _LOAD_STATES,
    "_load_optimizer_and_scheduler": _LOAD_STATES,
    "_load_scaler": _LOAD_STATES,
    "_load_callback_state": "restore_callback_states_from_checkpoint",
    "_rotate_checkpoints": "save_total_limit (the Checkpointing plugin rotates)",
    "_sorted_checkpoints": "save_total_limit (the Checkpointing plugin rotates)",
    "compare_trainer_and_checkpoint_args": "resume_from_checkpoint (a resumed checkpoint's arguments are checked)",
    "_save_tpu": "trainbus does not run on TPUs",
    "_tune_save_checkpoint": "hyperparameter_search with optuna (Ray Tune is not a backend)",
    # set-up: accelerate, devices, wrappers
    "_validate_args": "TrainingArguments, which checks its fields when it is built",
    "_build_accelerator_args": _ACCELERATE,
    "create_accelerator_and_postprocess": _ACCELERATE,
    "_wrap_model": _ACCELERATE,
    "_move_model_to_device": "the device argument of TrainingArguments (use_cpu) or `accelerate config`",
    "propagate_args_to_deepspeed": _ACCELERATE,
    "_fsdp_qlora_plugin_updates": _ACCELERATE,
    "_defer_fsdp_gradient_reduction": _ACCELERATE,
    "_sync_replicated_trainable_parameters": "trainbus has no tensor parallelism",
    "_has_mixed_mesh_grads": "trainbus has no tensor parallelism",
    "_mixed_mesh_grad_norm": "trainbus has no tensor parallelism",
    "get_tp_size": "trainbus has no tensor parallelism (1)",
    "get_sp_size": "trainbus has no sequence parallelism (1)",
    "get_cp_size": "trainbus has no context parallelism (1)",
    "_deepspeed_sp_compute_loss": "trainbus has no DeepSpeed sequence parallelism",
    "_gather_and_numpify": "the EvalCollector plugin gathers across processes",
    "_nested_gather": "the EvalCollector plugin gathers across processes",
    "_is_attention_mask_causal": "the model's own attention mask handling",
    "_activate_neftune": "neftune_noise_alpha (the NEFTune plugin)",
    "_deactivate_neftune": "neftune_noise_alpha (the NEFTune plugin)",
    "_align_special_tokens": "the processing_class (its special tokens are copied to the model's config)",
    "is_world_process_zero": _ACCELERATE,
    "is_local_process_zero": _ACCELERATE,
    "add_callback": "the callbacks argument (add_callback itself is not called by the constructor)",
    "call_model_init": "the model_init argument",
    "_hp_search_setup": "hyperparameter_search (plugins/facade/search.py)",
    "_report_to_hp_search": "hyperparameter_search (plugins/facade/search.py)",
    # the Hub
    "push_to_hub": _NO_HUB,
    "init_hf_repo": _NO_HUB,
    "_push_from_checkpoint": _NO_HUB,
    "_finish_current_push": _NO_HUB,
    "_add_sm_patterns_to_gitignore": _NO_HUB,
    "torch_jit_model_eval": "removed from transformers 5 (jit_mode_eval)",
}


def classification(name: str) -> str | None:
    """``"honoured"``, ``"offered"``, ``"refused"``, or None for a name transformers' Trainer does not have."""
    for label, table in (("honoured", HONOURED), ("offered", OFFERED), ("refused", REFUSED)):
        if name in table:
            return label
    return None


def _is_trainbus_class(cls: type) -> bool:
    return cls.__module__.split(".")[0] in {"trainbus", "builtins"}


def refused_overrides(cls: type) -> list[tuple[str, str]]:
    """``(class.method, what to use)`` for each method a class outside trainbus defines that trainbus refuses."""
    return [(f"{klass.__qualname__}.{name}", REFUSED[name]) for klass in _user_classes(cls) for name in vars(klass)
            if name in REFUSED]  # fmt: skip


def _user_classes(cls: type) -> list[type]:
    """The classes of ``cls``'s hierarchy that are neither trainbus's nor transformers' (the script's own)."""
    return [
        klass
        for klass in cls.__mro__
        if not _is_trainbus_class(klass) and not klass.__module__.startswith("transformers")
    ]


def check_overrides(cls: type) -> None:
    """A ConfigError naming every refused method the subclass overrides (see the module docstring)."""
    found = refused_overrides(cls)
    if found:
        lines = "\n".join(f"  - {method}: use {instead}" for method, instead in found)
        raise ConfigError(
            f"{cls.__name__} overrides methods of transformers' Trainer that trainbus's Trainer never calls, so "
            f"the override would be ignored:\n{lines}\n(docs/hf_surface.md lists what each transformers method "
            "is in trainbus)"
        )


#: honoured in one process and under DDP; a sharded checkpoint (FSDP, DeepSpeed ZeRO) is written by its own path
NOT_UNDER_SHARDING = ("save_model", "_save", "_save_checkpoint", "_load_from_checkpoint", "_load_best_model")


def check_sharded_overrides(cls: type, args: Any) -> None:
    """A checkpoint override with fsdp / deepspeed would not be called (their sharded checkpoints): refused now."""
    sharded = "fsdp" if getattr(args, "fsdp", None) else "deepspeed" if getattr(args, "deepspeed", None) else None
    if sharded is None:
        return
    classes = _user_classes(cls)
    overridden = [f"{k.__qualname__}.{name}" for k in classes for name in NOT_UNDER_SHARDING if name in vars(k)]
    if overridden:
        raise ConfigError(
            f"{', '.join(overridden)}: with {sharded} trainbus writes and reads sharded checkpoints itself and would "
            f"not call these overrides; remove them, or train without {sharded} (a callback's on_save can add files)"
        )


def refusing_method(name: str) -> Any:
    """A method that raises the refusal, for a transformers name trainbus's Trainer has no method of."""

    def refused(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError(f"Trainer.{name} is not part of trainbus's Trainer: use {REFUSED[name]}")

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"transformers' Trainer.{name}: refused in trainbus (use {REFUSED[name]})."
    return refused


def markdown_table() -> str:
    """The classification as docs/hf_surface.md shows it (``python -m trainbus.plugins.facade.hf_names``)."""
    rows = ["| method | in trainbus | where it runs / what it is / what to use instead |", "|---|---|---|"]
    for label, table in (("honoured", HONOURED), ("offered", OFFERED), ("refused", REFUSED)):
        rows += [f"| `{name}` | {label} | {table[name]} |" for name in sorted(table)]
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
