"""Optimizer state a checkpoint can hold, and the layer-wise optimizer.

Optimizer state that is neither a tensor nor a JSON value (GaLore's projectors, torchao's low-bit
tensor subclasses, GrokAdamW's per-group dict) is turned into such values by ``keep_state_plain``,
so checkpoints stay safetensors + JSON and a resume is exact.

The layer-wise GaLore / APOLLO names build a ``LayerwiseOptimizer``: one optimizer per parameter,
stepped from that parameter's gradient hook, so the model's gradients never all exist at once.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

#: packages whose state classes a checkpoint may name; they are rebuilt from their attributes, never unpickled
_STATE_PACKAGES = ("galore_torch.", "apollo_torch.", "torchao.")
_OBJECT, _SUBCLASS, _BY_POSITION = "__state_object__", "__tensor_subclass__", "__by_param_position__"


def keep_state_plain(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state_dict()`` hold only tensors and JSON values, and load them back.

    Checkpoints are safetensors and JSON (no pickle), but some optimizers keep other things:
    GaLore / APOLLO a projector object per projected weight, torchao's low-bit AdamW tensor
    subclasses (codes + scales), GrokAdamW a dict keyed by the parameters in each group. The
    state dict carries their parts instead, and loading rebuilds them.
    """
    optimizer.register_state_dict_post_hook(_state_to_plain)
    optimizer.register_load_state_dict_pre_hook(_state_from_plain)
    optimizer.register_load_state_dict_post_hook(_rekey_by_parameter)


def _class_path(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _state_class(path: str) -> Any:
    module_name, _, class_name = path.rpartition(".")
    if not module_name.startswith(_STATE_PACKAGES):
        raise ValueError(f"optimizer state names the class {path!r}, which is not one trainbus rebuilds")
    return getattr(importlib.import_module(module_name), class_name)


def _to_plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        if type(value) in (torch.Tensor, torch.nn.Parameter) or not hasattr(value, "__tensor_flatten__"):
            return value
        names, context = value.__tensor_flatten__()
        return {
            _SUBCLASS: _class_path(value),
            "tensors": {n: _to_plain(getattr(value, n)) for n in names},
            "context": list(context),
            "size": list(value.shape),
            "stride": list(value.stride()),
        }
    if value is None or isinstance(value, bool | int | float | str | torch.dtype | list | tuple | Mapping):
        return value
    if hasattr(value, "__dict__"):  # an object of plain attributes (a GaLore / APOLLO projector)
        return {_OBJECT: _class_path(value), "attributes": {k: _to_plain(v) for k, v in vars(value).items()}}
    return value


def _from_plain(value: Any) -> Any:
    if not isinstance(value, Mapping):
        return value
    if _SUBCLASS in value:
        tensors = {k: _from_plain(v) for k, v in value["tensors"].items()}
        cls = _state_class(value[_SUBCLASS])
        return cls.__tensor_unflatten__(tensors, list(value["context"]), torch.Size(value["size"]), value["stride"])
    if _OBJECT in value:
        cls = _state_class(value[_OBJECT])
        obj = cls.__new__(cls)
        vars(obj).update({k: _from_plain(v) for k, v in value["attributes"].items()})
        return obj
    return value


def _state_to_plain(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    # copies throughout: the live state keeps its objects
    state = {key: {k: _to_plain(v) for k, v in s.items()} for key, s in state_dict["state"].items()}
    groups = []
    for saved, live in zip(state_dict["param_groups"], optimizer.param_groups):
        position = {id(p): i for i, p in enumerate(live["params"])}
        saved = dict(saved)
        for key, value in saved.items():
            if isinstance(value, dict) and value and all(id(k) in position for k in value):
                saved[key] = {_BY_POSITION: {position[id(k)]: _to_plain_dict(v) for k, v in value.items()}}
        groups.append(saved)
    return {**state_dict, "state": state, "param_groups": groups}


def _to_plain_dict(value: Any) -> Any:
    return {k: _to_plain(v) for k, v in value.items()} if isinstance(value, Mapping) else _to_plain(value)


def _state_from_plain(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    state = {key: {k: _from_plain(v) for k, v in s.items()} for key, s in state_dict["state"].items()}
    return {**state_dict, "state": state}


def _rekey_by_parameter(optimizer: torch.optim.Optimizer) -> None:
    # after loading (torch deep-copies the saved groups, so parameter keys must be set afterwards)
    for group in optimizer.param_groups:
        for key, value in list(group.items()):
            if isinstance(value, Mapping) and _BY_POSITION in value:
                params = group["params"]
                group[key] = {params[int(i)]: _from_plain_dict(v) for i, v in value[_BY_POSITION].items()}


def _from_plain_dict(value: Any) -> Any:
    return {k: _from_plain(v) for k, v in value.items()} if isinstance(value, Mapping) else _from_plain(value)


class LayerwiseOptimizer(torch.optim.Optimizer):
    """One optimizer per parameter, each stepped from its parameter's post-accumulate-grad hook.

    HF's layer-wise GaLore / APOLLO: a parameter's gradient is used and freed as soon as backward
    has produced it, so the model's gradients never all exist at once. ``step()`` does nothing.
    ``param_groups`` are the inner optimizers' own group dicts, so a scheduler built on this
    optimizer sets their learning rates. The state dict lists the inner optimizers' state dicts.

    Args:
        optimizer_cls: the class each parameter gets. param_groups: the groups to split.
        kwargs: keyword arguments of ``optimizer_cls`` (``lr`` ...).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = LayerwiseOptimizer(torch.optim.SGD, [{"params": list(model.parameters())}], lr=0.1)
        >>> before = model.weight.detach().clone()
        >>> model(torch.ones(1, 2)).sum().backward()  # steps inside backward
        >>> bool((model.weight != before).all()), model.weight.grad is None
        (True, True)
    """

    def __init__(self, optimizer_cls: Any, param_groups: list[dict[str, Any]], **kwargs: Any) -> None:
        self.optimizers: dict[torch.Tensor, torch.optim.Optimizer] = {}
        for group in param_groups:
            for param in group["params"]:
                inner = optimizer_cls([{**group, "params": [param]}], **kwargs)
                keep_state_plain(inner)
                self.optimizers[param] = inner
        # the same dict objects: torch's add_param_group keeps the dicts it is given
        super().__init__([g for opt in self.optimizers.values() for g in opt.param_groups], {"lr": kwargs.get("lr")})
        self._hooks = [p.register_post_accumulate_grad_hook(self._step_parameter) for p in self.optimizers]

    def _step_parameter(self, param: torch.Tensor) -> None:
        optimizer = self.optimizers[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Nothing to do: every parameter stepped when its gradient was ready."""
        return None

    def remove_hooks(self) -> None:
        """Stop stepping from backward (before building another optimizer for the same model)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [opt.state_dict() for opt in self.optimizers.values()]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("optimizers")
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            count = len(saved) if isinstance(saved, list) else "no"
            raise ValueError(f"the state holds {count} layer-wise optimizers, this one has {len(self.optimizers)}")
        for optimizer, state in zip(self.optimizers.values(), saved):
            optimizer.load_state_dict(state)
        # loading gave the inner optimizers new group dicts: share them again, for the scheduler
        self.param_groups = [g for opt in self.optimizers.values() for g in opt.param_groups]
