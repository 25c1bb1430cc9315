"""peft adapters (LoRA and the others) on an Engine or the Trainer.

A ``PeftModel`` from ``peft.get_peft_model`` trains as it is: its frozen base parameters have
``requires_grad=False``, so the optimizer gets only the adapters' (``create_optimizer`` leaves frozen
parameters out), checkpoints store only what trains plus a fingerprint of the frozen base
(plugins/checkpoints), and ``save_model`` writes peft's own format through ``save_pretrained``
(``adapter_model.safetensors`` + ``adapter_config.json``, one folder per extra adapter), which
``PeftModel.from_pretrained`` loads.

``AdapterSwitch`` trains several adapters of one model in turn, one per task: it activates an
adapter at an event, and peft's ``set_adapter`` freezes the others. ``prepare_qlora`` readies a
4-bit quantized model (bitsandbytes, GPU only) for training.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.events import EpochStartEvent, StepStartEvent

if TYPE_CHECKING:
    from trainbus.engine import Engine

Chooser = Sequence[str] | Callable[[Any], str]


def adapter_names(model: torch.nn.Module) -> list[str]:
    """The adapters of a peft model, in the order they were added; a ConfigError for another model."""
    config = getattr(model, "peft_config", None)
    if not isinstance(config, dict) or not callable(getattr(model, "set_adapter", None)):
        raise ConfigError(
            f"adapters need a peft model (peft.get_peft_model(model, config)), got {type(model).__name__}"
        )
    return list(config)


def adapter_parameters(model: torch.nn.Module, names: Sequence[str] | None = None) -> list[torch.nn.Parameter]:
    """The parameters of the adapters ``names`` (default: all): what an optimizer for AdapterSwitch holds."""
    wanted = set(adapter_names(model) if names is None else names)
    prefix = getattr(getattr(model, "base_model", None), "prefix", "lora_")  # peft's tuner prefix: lora_, ia3_...
    found = []
    for name, parameter in model.named_parameters():
        parts = name.split(".")
        # peft names an adapter's tensors <module>.<prefix...>.<adapter name>.<tensor>
        if prefix in name and wanted.intersection(parts):
            found.append(parameter)
    return found


class AdapterSwitch(Plugin):
    """Trains a peft model's adapters in turn: activates one at each epoch or step (one adapter per task).

    Args:
        adapters: the adapter names taken in turn (cycled), or ``fn(payload) -> name`` choosing one.
        at: ``"epoch"`` (EPOCH_START: epoch e trains ``adapters[e % len]``) or ``"step"`` (STEP_START:
            step s trains ``adapters[s % len]``); a callable chooser is asked at that event too.

    The position comes from the run's State (epochs completed, global step), so a resumed run
    activates the adapter the uninterrupted run would. At attach every named adapter is made
    trainable, so an optimizer built afterwards (the Trainer's, at ``train()``) holds them all; the
    adapters not active get no gradient and the optimizer leaves them untouched. A bare Engine's
    optimizer must hold them already: ``adapter_parameters(model)``.
    """

    priority = Priority.FIRST

    def __init__(self, adapters: Chooser, at: str = "epoch") -> None:
        if at not in ("epoch", "step"):
            raise ConfigError(f"AdapterSwitch(at=...) must be 'epoch' or 'step', got {at!r}")
        if not callable(adapters):
            if isinstance(adapters, str) or not isinstance(adapters, Iterable):
                raise ConfigError(
                    f"AdapterSwitch needs a list of adapter names or a chooser function, got {adapters!r:.80}"
                )
            adapters = list(adapters)
            if not adapters or not all(isinstance(a, str) for a in adapters):
                raise ConfigError(f"AdapterSwitch needs adapter names (strings) or a chooser, got {adapters!r}")
        self.adapters = adapters
        self.at = at
        self.active: str | None = None

    def attach(self, engine: Engine) -> None:
        model = engine.model
        available = adapter_names(model)
        if not callable(self.adapters):
            unknown = [a for a in self.adapters if a not in available]
            if unknown:
                raise ConfigError(f"AdapterSwitch: no adapter named {unknown} in the model; it has {available}")
            for parameter in adapter_parameters(model, self.adapters):
                parameter.requires_grad_(True)  # so an optimizer built from now on holds every adapter
            if engine.optimizer is not None:
                held = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
                missing = sorted(
                    {a for a in self.adapters for p in adapter_parameters(model, [a]) if id(p) not in held}
                )
                if missing:
                    raise ConfigError(
                        f"the optimizer lacks the parameters of adapter(s) {missing}: build it over every "
                        "adapter's parameters, e.g. torch.optim.AdamW(adapter_parameters(model))"
                    )
        event = Event.EPOCH_START if self.at == "epoch" else Event.STEP_START
        self.on(engine, event, self.switch)

    def switch(self, ev: EpochStartEvent | StepStartEvent) -> None:
        engine = ev.engine
        if callable(self.adapters):
            name = self.adapters(ev)
            available = adapter_names(engine.model)
            if name not in available:
                raise ConfigError(f"AdapterSwitch chose {name!r}, which the model does not have; it has {available}")
        else:
            position = engine.state.epochs_completed if self.at == "epoch" else engine.state.global_step
            name = self.adapters[position % len(self.adapters)]
        if name != getattr(engine.model, "active_adapter", None):
            engine.model.set_adapter(name)  # type: ignore[operator]
        self.active = name


def prepare_qlora(model: torch.nn.Module, gradient_checkpointing: bool = True) -> torch.nn.Module:
    """Ready a 4-bit (bitsandbytes) quantized model for LoRA training: peft's ``prepare_model_for_kbit_training``.

    QLoRA needs bitsandbytes and a CUDA GPU; elsewhere this fails before training, saying so.
    """
    if importlib.util.find_spec("bitsandbytes") is None or not torch.cuda.is_available():
        missing = "bitsandbytes is not installed" if importlib.util.find_spec("bitsandbytes") is None else ""
        where = missing or "this machine has no CUDA GPU"
        raise ConfigError(
            f"QLoRA needs bitsandbytes and a CUDA GPU, but {where}; train LoRA on the unquantized model instead "
            "(peft.get_peft_model without a quantization_config)"
        )
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=gradient_checkpointing)  # type: ignore[no-any-return]


__all__ = ["AdapterSwitch", "adapter_names", "adapter_parameters", "prepare_qlora"]
