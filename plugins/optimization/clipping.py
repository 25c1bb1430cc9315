"""Gradient clipping as a plugin, at BEFORE_OPTIMIZER_STEP.

It runs at priority DEFAULT, after the mixed-precision plugin has unscaled the gradients at
FIRST, so ``max_norm`` applies to the true gradients, never the loss-scaled ones. The total norm
(before clipping, as HF logs it) stays on the device in ``engine.step_outputs["grad_norm"]``:
loggers read it once per logging window, so clipping adds no host sync to a step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from trainbus.engine import ConfigError, Event, Plugin, Priority

if TYPE_CHECKING:
    from trainbus.engine import Engine
    from trainbus.engine.events import BeforeOptimizerStepEvent, TrainStartEvent


def _check_threshold(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value < 0:
        raise ConfigError(f"{name} must be a number >= 0 (0 or None switches it off), got {value!r}")


class GradientClipping(Plugin):
    """Clip gradients by total norm (HF ``max_grad_norm``) and, optionally, by value.

    Args:
        max_norm: the largest total gradient norm; 0 or None: no norm clipping.
        clip_value: clamp every gradient element to ``[-clip_value, clip_value]`` first; None: off.
        norm_type: the p of the p-norm (``inf`` for the max norm).
        norm_when_off: with norm clipping off, still measure the total norm into ``grad_norm`` (transformers
            logs it with ``max_grad_norm=0``); False: no norm is computed then.
        optimizer: with several optimizers (``Engine(model, {"d": ..., "g": ...})``), the name of the one whose
            gradients this clips, before its steps only; the plugin is then named ``GradientClipping[g]``, so one
            per optimizer needs no ``name=``, and its norm goes to ``step_outputs["grad_norm_g"]``. Without it, a
            step function's ``engine.step_optimizer(name, loss)`` clips that optimizer's parameters, each apart.

    Example:
        >>> import torch
        >>> from trainbus.engine import Engine
        >>> model = torch.nn.Linear(2, 1)
        >>> data = [(100 * torch.randn(4, 2), torch.randn(4, 1))]
        >>> engine = Engine(model, torch.optim.SGD(model.parameters(), lr=0.1), train_data=data, max_epochs=1,
        ...                 loss_fn=torch.nn.MSELoss(), plugins=[GradientClipping(max_norm=1.0)])
        >>> _ = engine.fit()
        >>> engine.step_outputs["grad_norm"] > 1.0
        tensor(True)
    """

    priority = Priority.DEFAULT

    def __init__(
        self,
        max_norm: float | None = 1.0,
        clip_value: float | None = None,
        norm_type: float = 2.0,
        norm_when_off: bool = False,
        optimizer: str | None = None,
    ) -> None:
        _check_threshold("max_norm", max_norm)
        _check_threshold("clip_value", clip_value)
        if isinstance(norm_type, bool) or not (isinstance(norm_type, int | float) and norm_type > 0):
            raise ConfigError(f"norm_type must be > 0 (or inf), got {norm_type!r}")
        self.max_norm = max_norm or None
        self.clip_value = clip_value or None
        self.norm_type = float(norm_type)
        if not isinstance(norm_when_off, bool):
            raise ConfigError(f"norm_when_off must be True or False, got {norm_when_off!r}")
        self.norm_when_off = norm_when_off
        if optimizer is not None and (not isinstance(optimizer, str) or not optimizer):
            raise ConfigError(f"optimizer must name one of the engine's optimizers (a str), got {optimizer!r}")
        self.optimizer = optimizer
        if optimizer is not None:
            self.name = f"GradientClipping[{optimizer}]"
        self._params: list[torch.nn.Parameter] = []
        self._named: dict[str | None, list[torch.nn.Parameter]] = {}

    def attach(self, engine: Engine) -> None:
        self.on(engine, Event.TRAIN_START, self.collect, priority=Priority.LAST)
        named = self.optimizer is not None or engine.step_function is not None or engine.optimizers
        # the one-optimizer loop keeps its handler as it was: no per-step look at the payload's name
        self.on(engine, Event.BEFORE_OPTIMIZER_STEP, self.clip_named if named else self.clip)

    def collect(self, ev: TrainStartEvent) -> None:
        self._named = {}
        if self.optimizer is not None:
            optimizers = ev.engine.optimizers
            if self.optimizer not in optimizers:
                raise ConfigError(f"GradientClipping(optimizer={self.optimizer!r}): this engine's optimizers are "
                                  f"{list(optimizers)} (Engine(model, {{name: optimizer, ...}}))")  # fmt: skip
            self._params = [p for g in optimizers[self.optimizer].param_groups for p in g["params"]]
            return
        # gathered once, in the model's order as HF's clip_grad_norm_(model.parameters()): the total norm
        # sums the squares in that order, so the clip coefficient matches transformers to the last bit;
        # then any optimizer parameter the model does not hold (a parameter the script added)
        params = list(ev.engine.model.parameters())
        optimizer = ev.engine.optimizer
        if optimizer is not None:
            known = {id(p) for p in params}
            params += [p for g in optimizer.param_groups for p in g["params"] if id(p) not in known]
        self._params = params

    def clip(self, ev: BeforeOptimizerStepEvent) -> None:
        if not self._params:
            self.collect(ev)  # type: ignore[arg-type]  # fit() always fires TRAIN_START; direct use may not
        if self.clip_value is not None:
            torch.nn.utils.clip_grad_value_(self._params, self.clip_value, foreach=True)
        if self.max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self._params, self.max_norm, self.norm_type, foreach=True)
            ev.engine.step_outputs["grad_norm"] = norm  # computed under no_grad: nothing to detach
        elif self.norm_when_off:  # transformers' own measure: a clip to inf, whose rescale by 1.0 changes nothing
            norm = torch.nn.utils.clip_grad_norm_(self._params, math.inf, self.norm_type, foreach=True)
            ev.engine.step_outputs["grad_norm"] = norm

    def clip_named(self, ev: BeforeOptimizerStepEvent) -> None:
        """Several optimizers: ours before its step (or before the loop's step of all), else each its own."""
        name = ev.optimizer
        if self.optimizer is not None:
            if name is not None and name != self.optimizer:
                return
            self.clip(ev)
            self._rename(ev, self.optimizer)
        elif name is None:
            self.clip(ev)
        else:
            params = self._named.get(name)
            if params is None:
                groups = ev.engine.optimizers[name].param_groups
                params = self._named[name] = [p for g in groups for p in g["params"]]
            self._clip(ev, params, f"grad_norm_{name}")

    @staticmethod
    def _rename(ev: BeforeOptimizerStepEvent, name: str) -> None:
        outputs = ev.engine.step_outputs
        if "grad_norm" in outputs:
            outputs[f"grad_norm_{name}"] = outputs.pop("grad_norm")

    def _clip(self, ev: BeforeOptimizerStepEvent, params: list[torch.nn.Parameter], key: str) -> None:
        if self.clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.clip_value, foreach=True)
        if self.max_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm, self.norm_type, foreach=True)
            ev.engine.step_outputs[key] = norm  # computed under no_grad: nothing to detach
        elif self.norm_when_off:  # transformers' own measure: a clip to inf, whose rescale by 1.0 changes nothing
            norm = torch.nn.utils.clip_grad_norm_(params, math.inf, self.norm_type, foreach=True)
            ev.engine.step_outputs[key] = norm
