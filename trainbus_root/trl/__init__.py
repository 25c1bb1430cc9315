"""TRL's SFT and DPO trainers on trainbus: a TRL script ports by changing one import.

    from trainbus.trl import SFTTrainer, SFTConfig, DPOTrainer, DPOConfig   # was: from trl import ...

Needs TRL (``pip install "trainbus[trl]"``). TRL's data utilities prepare the data (chat templates,
packing, its collators); the losses, the reference model and TRL's metrics are trainbus plugins on the
Trainer facade's engine (docs/trl.md).
"""

from __future__ import annotations

try:
    import trl as _trl  # noqa: F401
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError("trainbus.trl needs TRL: pip install 'trainbus[trl]' (or pip install trl)") from error

from .configs import DPOConfig, SFTConfig
from .dpo_trainer import DPOTrainer
from .sft_trainer import SFTTrainer

__all__ = ["DPOConfig", "DPOTrainer", "SFTConfig", "SFTTrainer"]
