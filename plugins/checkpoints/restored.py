"""The values a checkpoint restores, checked while it is read: types, ranges, agreement (#29 item 7).

The hashes in a manifest say a file is as written, not that what was written makes sense: a state
rewritten and rehashed, or written by a buggy version, was applied as it was (``global_step`` 1e30
"finished" without training, -7 trained 77 steps, 60.5 named the next checkpoint ``checkpoint-70.5``,
a string ``batches_in_epoch`` failed deep in the data plugin). So ``reading.read_checkpoint`` checks
here every field of the trainer state (its type, its range, and the counters against each other
and against the manifest) and that the RNG states can be set, before anything is applied; what
fails is damage (``safety.DamagedCheckpoint``, naming the field and the file), so a resume with
``True`` falls back to the checkpoint before. The weights' dtypes are checked where they are loaded.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .history import HF_STATE_FIELDS
from .identity import MANIFEST_KEY as RUN_ID_KEY
from .identity import valid_run_id
from .rng import rng_state, set_rng_state
from .safety import DamagedCheckpoint

__all__ = ["COUNT_MAX", "BEST_NAME", "check_rng_states", "check_state_fields", "trusted_best"]

#: what a best checkpoint is named in its run directory (directory.NAME; restated: directory.py imports more)
BEST_NAME = re.compile(r"^checkpoint-(\d+)$")

#: the largest counter a checkpoint may hold (torch's int64; no run takes 2**63 steps)
COUNT_MAX = 2**63 - 1
#: counters: integers in [0, COUNT_MAX]
_COUNTS = (
    "global_step", "max_steps", "logging_steps", "save_steps", "num_input_tokens_seen", "epochs_completed",
    "epoch_step", "batches_in_epoch", "optimizer_steps_taken", "micro_steps",
)  # fmt: skip
#: counters that may be None (unknown, unset); the smallest value each may take otherwise
_OPTIONAL_COUNTS = {"steps_per_epoch": 1, "eval_steps": 0, "train_batch_size": 1, "best_global_step": 0}
_FLAGS = ("is_local_process_zero", "is_world_process_zero", "is_hyper_param_search")
_TEXTS = ("best_model_checkpoint", "trial_name")
#: counters no larger than another one: (field, bound, why)
_AT_MOST = (
    ("epoch_step", "global_step", "the optimizer steps of the epoch are steps of the run"),
    ("optimizer_steps_taken", "global_step", "steps taken are steps counted"),
    ("best_global_step", "global_step", "the best step cannot be after the checkpoint's"),
    ("batches_in_epoch", "micro_steps", "the micro-batches of the epoch are micro-batches of the run"),
    ("epochs_completed", "micro_steps", "every epoch holds at least one micro-batch of the run"),
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_state_fields(
    fields: Mapping[str, Any], path: Path, manifest: Mapping[str, Any], own_path: Path | None = None
) -> None:
    """Refuse (DamagedCheckpoint) a trainer state (``path``) whose fields a run cannot have written.

    ``own_path``: the file holding the engine's own fields (``trainbus_state.json``), named for those.
    """

    def refuse(name: str, allowed: str) -> None:
        where = own_path if own_path is not None and name not in HF_STATE_FIELDS else path
        raise DamagedCheckpoint(
            f"checkpoint file {where} holds {name}={fields.get(name)!r:.80}; {allowed}: the state is damaged or forged"
        )

    for name in _COUNTS:
        if not (_is_int(fields.get(name)) and 0 <= fields[name] <= COUNT_MAX):
            refuse(name, f"it must be an integer from 0 to {COUNT_MAX}")
    for name, least in _OPTIONAL_COUNTS.items():
        value = fields.get(name)
        if value is not None and not (_is_int(value) and least <= value <= COUNT_MAX):
            refuse(name, f"it must be null or an integer from {least} to {COUNT_MAX}")
    for name in ("epoch", "total_flos", "num_train_epochs"):
        value = fields.get(name)
        if not (_is_number(value) and math.isfinite(value) and value >= 0):
            refuse(name, "it must be a finite number >= 0")
    if fields.get("best_metric") is not None and not _is_number(fields["best_metric"]):
        refuse("best_metric", "it must be null or a number")
    for name in _FLAGS:
        if not isinstance(fields.get(name), bool):
            refuse(name, "it must be true or false")
    for name in _TEXTS:
        if fields.get(name) is not None and not isinstance(fields[name], str):
            refuse(name, "it must be null or a string")
    if fields.get("run_id") is not None and not valid_run_id(fields["run_id"]):
        refuse("run_id", "it must be null or 32 lowercase hex digits (the id trainbus writes when a run starts)")
    listed_id = manifest.get(RUN_ID_KEY)
    if listed_id is not None and listed_id != fields.get("run_id"):
        refuse("run_id", f"its manifest names the run {listed_id!r:.40}")
    _check_containers(fields, refuse)
    for name, bound, why in _AT_MOST:
        value = fields.get(name)
        if value is not None and value > fields[bound]:
            refuse(name, f"it must be at most {bound} ({fields[bound]}): {why}")
    listed = manifest.get("global_step", fields["global_step"])
    if listed != fields["global_step"]:
        raise DamagedCheckpoint(
            f"checkpoint file {path} holds global_step {fields['global_step']} but its manifest says {listed!r:.40}: "
            "the state is damaged or forged"
        )


def _check_containers(fields: Mapping[str, Any], refuse: Any) -> None:
    if fields.get("trial_params") is not None and not isinstance(fields["trial_params"], dict):
        refuse("trial_params", "it must be null or an object")
    if not isinstance(fields.get("stateful_callbacks"), dict):
        refuse("stateful_callbacks", "it must be an object")
    counts = fields.get("event_counts")
    if not isinstance(counts, dict) or not all(_is_int(v) and 0 <= v <= COUNT_MAX for v in counts.values()):
        refuse("event_counts", "it must be an object of event names to integers >= 0")
    history = fields.get("log_history")
    if not isinstance(history, list) or not all(isinstance(record, dict) for record in history):
        refuse("log_history", "it must be a list of log records (objects)")


def check_rng_states(rng: Mapping[str, Any], path: Path) -> None:
    """Refuse RNG states (``path``) that cannot be set: each is set once, then this process's are put back.

    CUDA states are checked by kind only (a list of byte tensors): how many a process can set depends on
    the devices it sees, which says nothing of the checkpoint (the resume reports a mismatch itself).
    """
    bundles = [("", rng)]
    in_flight = rng.get("in_flight")
    if in_flight is not None:
        if not isinstance(in_flight, Mapping) or "python" not in in_flight or "torch" not in in_flight:
            raise DamagedCheckpoint(f"checkpoint file {path}: the in-flight RNG states lack the python/torch states")
        bundles.append(("in-flight ", in_flight))
    for _, states in bundles:
        cuda = states.get("cuda", [])
        if not isinstance(cuda, list | tuple) or not all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1 for t in cuda
        ):
            raise DamagedCheckpoint(f"checkpoint file {path} holds CUDA RNG states that are not byte tensors")
    bundles = [(kind, {k: v for k, v in states.items() if k != "cuda"}) for kind, states in bundles]
    own = rng_state()
    try:
        for kind, states in bundles:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # CUDA states where there is no CUDA: the resume warns
                    set_rng_state(states)
            except Exception as exc:  # what each generator's setstate raises: TypeError, ValueError, RuntimeError
                raise DamagedCheckpoint(
                    f"checkpoint file {path} holds {kind}RNG states that cannot be set: {type(exc).__name__}: {exc}"
                ) from exc
    finally:
        set_rng_state(own)


def trusted_best(value: str | None, directory: Path, global_step: int) -> tuple[str | None, str | None]:
    """The best checkpoint a resume from ``directory`` trusts: (its path, None), or (None, why it was forgotten).

    ``best_model_checkpoint`` is kept in trainer_state.json as transformers writes it: the run's
    output_dir joined with ``checkpoint-N``, as the run named it then (relative to the working directory
    of that time, in a folder since moved or copied, or forged). Only its last part is trusted, and
    only as a checkpoint of the run the resume continues: ``checkpoint-N`` (N at most the step resumed)
    next to ``directory``. Nothing outside that folder is ever named, whatever the state says.
    """
    if value is None:
        return None, None
    name = re.split(r"[\\/]", value)[-1]
    match = BEST_NAME.match(name)
    if match is None or int(match.group(1)) > global_step:
        return None, (
            f"best_model_checkpoint {value!r:.200} names no checkpoint-N of this run (its last part must be "
            f"checkpoint-<step>, the step at most {global_step}); forgotten: a LoadBestModelAtEnd keeps the run's "
            "own weights at the end unless the run saves a new best"
        )
    return str(directory.parent / name), None
