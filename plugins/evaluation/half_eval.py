"""Full half-precision evaluation (HF ``bf16_full_eval`` / ``fp16_full_eval``) as a plugin.

Outside training, ``evaluate()`` and ``predict()`` run the model itself in bf16 / fp16, which
halves its memory and speeds it up, instead of autocasting an fp32 model. Inside ``fit`` the
evaluations keep the fp32 model, as HF does: casting the trained weights down and back would
change them.

Unlike HF, which leaves the model in half precision after ``evaluate()`` (a later ``train()``
would then train a half model), the plugin keeps the fp32 tensors aside while the eval runs and
puts them back at EVAL_END / PREDICT_END, so the weights after an evaluation are bit for bit the
weights before it. That costs the fp32 tensors' memory during the evaluation. The restore is a
cleanup handler: when an evaluation raises, the engine fires EVAL_END / PREDICT_END with
``payload.error`` before the exception reaches the caller, so the fp32 tensors are back then too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority
from trainbus.engine.errors import suggest

from ..optimization.precision import DTYPES

if TYPE_CHECKING:
    from trainbus.engine import Engine


def cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    """Cast the floating-point tensors of a nested batch to ``dtype`` (integer ids stay as they are)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, Mapping):
        cast = {k: cast_floats(v, dtype) for k, v in batch.items()}
        return cast if type(batch) is dict else type(batch)(cast)  # type: ignore[call-arg]
    if isinstance(batch, list | tuple) and not hasattr(batch, "_fields"):
        return type(batch)(cast_floats(v, dtype) for v in batch)
    return batch


class HalfPrecisionEval(Plugin):
    """Run evaluate() / predict() outside training with the model cast to bf16 or fp16.

    Args:
        dtype: "bf16" or "fp16".

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine, Event
        >>> model = torch.nn.Linear(3, 2)
        >>> engine = Engine(model, loss_fn=torch.nn.CrossEntropyLoss(), plugins=[HalfPrecisionEval("bf16")])
        >>> seen = []
        >>> _ = engine.on(Event.EVAL_BATCH_END, lambda ev: seen.append(ev.logits.dtype))
        >>> _ = engine.evaluate([(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))])
        >>> seen, model.weight.dtype
        ([torch.bfloat16], torch.float32)
    """

    priority = Priority.FIRST

    def __init__(self, dtype: str = "bf16") -> None:
        if dtype not in ("bf16", "fp16"):
            raise ConfigError(
                f"full eval dtype must be 'bf16' or 'fp16', got {dtype!r}{suggest(str(dtype), ['bf16', 'fp16'])}"
            )
        self.dtype = DTYPES[dtype]
        self._training = False
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_START, self._train_start)
        self.on(engine, Event.TRAIN_END, self._train_end, priority=Priority.LAST, cleanup=True)
        for start, end in ((Event.EVAL_START, Event.EVAL_END), (Event.PREDICT_START, Event.PREDICT_END)):
            self.on(engine, start, self._cast_model)
            self.on(engine, end, self._restore_model, priority=Priority.LAST, cleanup=True)
        self.wrap_hook(engine, "prediction_step", self._cast_inputs)

    def _train_start(self, ev: Any) -> None:
        self._training = True

    def _train_end(self, ev: Any) -> None:
        self._training = False

    def _cast_model(self, ev: Any) -> None:
        if self._training:
            return
        model: torch.nn.Module = ev.engine.model
        tensors = [*model.parameters(), *model.buffers()]
        self._saved = [(t, t.data) for t in tensors if t.is_floating_point()]
        for tensor, data in self._saved:
            tensor.data = data.to(self.dtype)

    def _restore_model(self, ev: Any) -> None:
        for tensor, data in self._saved:
            tensor.data = data
        self._saved = []

    def _cast_inputs(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def prediction_step(model: torch.nn.Module, batch: Any, *args: Any, **kwargs: Any) -> Any:
            if self._saved:  # the model is in half precision: so must its float inputs be
                batch = cast_floats(batch, self.dtype)
            return inner(model, batch, *args, **kwargs)

        return prediction_step
