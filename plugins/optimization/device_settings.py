"""Device-wide settings as plugins: TF32 matmuls (HF ``tf32``) and emptying the allocator's cache
every N steps (HF ``torch_empty_cache_steps``).

Both act on process-global state, so ``TF32`` restores the previous setting when detached.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from trainbus.engine import ConfigError, Event, Plugin
from trainbus.engine.errors import check_positive_int

if TYPE_CHECKING:
    from trainbus.engine import Engine, StepEndEvent


def tf32_supported() -> bool:
    """Whether TF32 matmuls can run here: a CUDA GPU of compute capability >= 8.0, Ampere on (HF's check)."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    return torch.cuda.get_device_properties(torch.cuda.current_device()).major >= 8


def check_tf32(tf32: bool | None) -> None:
    """Raise ``ConfigError`` when ``tf32=True`` cannot take effect here (HF raises too)."""
    if tf32 not in (None, True, False):
        raise ConfigError(f"tf32 must be True, False or None (torch's default), got {tf32!r}")
    if tf32 and not tf32_supported():
        if torch.cuda.is_available() and torch.version.cuda is not None:
            major, minor = torch.cuda.get_device_capability()
            found = f"{torch.cuda.get_device_name()} has compute capability {major}.{minor}"
        else:
            found = "this machine has no CUDA GPU"
        raise ConfigError(
            f"tf32=True needs an NVIDIA GPU of the Ampere generation or newer (compute capability >= 8.0), but "
            f"{found}; leave tf32 at None or set it to False"
        )


def tf32_setting(tf32: bool | None, *, torch_compile: bool, fp16: bool) -> bool | None:
    """The TF32 setting a run gets, as HF decides it: ``tf32``, else True when compiling in fp32 / bf16 on a TF32 GPU.

    None leaves torch's own setting alone.
    """
    if tf32 is None and torch_compile and not fp16 and tf32_supported():
        return True  # HF turns TF32 on for torch.compile, whose speed-ups come with it
    return tf32


def set_tf32(enabled: bool) -> Callable[[], None]:
    """Allow (or forbid) TF32 in CUDA matmuls and cuDNN convolutions; returns a function restoring the old setting.

    torch >= 2.9 has ``torch.backends.fp32_precision``, which HF sets there: mixing it with the
    legacy ``allow_tf32`` flags makes torch raise, so the legacy flags are used only on older torch.
    """
    backends = torch.backends
    if hasattr(backends, "fp32_precision"):
        previous = backends.fp32_precision
        backends.fp32_precision = "tf32" if enabled else "ieee"
        return lambda: setattr(backends, "fp32_precision", previous)
    old_matmul, old_cudnn = backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32
    backends.cuda.matmul.allow_tf32 = backends.cudnn.allow_tf32 = enabled

    def restore() -> None:
        backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = old_matmul, old_cudnn

    return restore


class TF32(Plugin):
    """TF32 matmuls on or off while attached (HF ``tf32``); detaching restores the previous setting.

    Args:
        enabled: True allows TF32 (needs an Ampere or newer GPU: ``ConfigError`` otherwise); False
            forbids it where the GPU has it, and is a no-op where there is no TF32 to forbid.
    """

    def __init__(self, enabled: bool = True) -> None:
        check_tf32(enabled)
        self.enabled = enabled
        self._restore: Callable[[], None] | None = None

    def attach(self, engine: Engine) -> None:
        if tf32_supported():
            self._restore = set_tf32(self.enabled)

    def detach(self, engine: Engine) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None
        super().detach(engine)


class EmptyDeviceCache(Plugin):
    """Release the accelerator's cached memory every ``every`` optimizer steps (HF ``torch_empty_cache_steps``).

    Calls accelerate's ``clear_device_cache`` (``torch.cuda.empty_cache`` and its MPS / XPU / NPU
    siblings) after steps ``every``, ``2 * every``, ...: lower reserved memory, slower steps.

    Args:
        every: steps between two calls (> 0).

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> engine = Engine(torch.nn.Linear(2, 1), plugins=[EmptyDeviceCache(every=10)])
        >>> engine.get_plugin(EmptyDeviceCache).every
        10
    """

    def __init__(self, every: int) -> None:
        check_positive_int("torch_empty_cache_steps", every)
        self.every = every

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.STEP_END(every=self.every), self.empty_cache)

    def empty_cache(self, ev: StepEndEvent) -> None:
        from accelerate.utils.memory import clear_device_cache

        clear_device_cache()


__all__ = ["TF32", "EmptyDeviceCache", "check_tf32", "set_tf32", "tf32_setting", "tf32_supported"]
