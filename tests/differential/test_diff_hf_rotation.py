"""Rotation scenarios of transformers' test_trainer_checkpointing.py (TrainerCheckpointRotationTest).

transformers' tests make empty checkpoint folders and call its public ``rotate_checkpoints`` with the Trainer's
``args.save_total_limit`` and ``state.best_model_checkpoint`` (set by the test). Ported as shipped, each Trainer
feeds transformers' function; trainbus's own rule (``checkpoints_to_keep``, which its Checkpointing plugin
applies after every save) must keep the same folders. The real runs are test_diff_checkpoints'.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import transformers.trainer_utils
from hf_diff import regression_trainer, run_both

pytestmark = pytest.mark.skipif(
    not hasattr(transformers.trainer_utils, "rotate_checkpoints"),
    reason="transformers 5's public rotate_checkpoints / sort_checkpoints (4.x has them as Trainer methods only)",
)

STEPS = (5, 10, 15, 20, 25)
CASES = {
    # case: (arguments, best step set on trainer.state, the steps transformers' test expects to remain)
    "limit_2": ({"save_total_limit": 2}, None, {20, 25}),
    "limit_2_best_5": ({"save_total_limit": 2, "load_best_model_at_end": True, "eval_strategy": "steps"}, 5, {5, 25}),
    "limit_1_best_25": ({"save_total_limit": 1, "load_best_model_at_end": True, "eval_strategy": "steps"}, 25, {25}),
    "limit_1_best_5": ({"save_total_limit": 1, "load_best_model_at_end": True, "eval_strategy": "steps"}, 5, {5, 25}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rotation_rule__mirrors_test_checkpoint_rotation(tmp_path, case):
    from transformers.trainer_utils import rotate_checkpoints

    from trainbus.plugins.checkpoints.rotation import checkpoints_to_keep

    kwargs, best, expected = CASES[case]

    def scenario(impl, d):
        trainer = regression_trainer(impl, d, **kwargs)
        for step in STEPS:
            (d / f"checkpoint-{step}").mkdir(parents=True, exist_ok=True)
        if best is not None:
            trainer.state.best_model_checkpoint = str(d / f"checkpoint-{best}")
        rotate_checkpoints(
            output_dir=str(d),
            save_total_limit=trainer.args.save_total_limit,
            best_model_checkpoint=trainer.state.best_model_checkpoint,
        )
        return {int(re.fullmatch(r"checkpoint-(\d+)", p.name).group(1)) for p in Path(d).glob("checkpoint-*")}

    hf, tb = run_both(scenario, tmp_path)
    assert hf == tb == expected
    assert checkpoints_to_keep(list(STEPS), kwargs["save_total_limit"], best) == expected


def test_sorting_keeps_best_second_to_last__mirrors_test_checkpoint_sorting(tmp_path):
    """transformers' sort_checkpoints puts the best second to last (so rotation spares it): trainbus's rule
    spares it the same way for every limit."""
    from transformers.trainer_utils import sort_checkpoints

    from trainbus.plugins.checkpoints.rotation import checkpoints_to_keep

    for step in (20, 5, 15, 25, 10):
        (tmp_path / f"checkpoint-{step}").mkdir()
    order = [
        int(p.rsplit("-", 1)[1])
        for p in sort_checkpoints(str(tmp_path), best_model_checkpoint=str(tmp_path / "checkpoint-5"))
    ]
    assert order == [10, 15, 20, 5, 25]
    for limit in range(1, 6):
        # transformers deletes the first len - limit of its order, never the newest (limit 1 keeps 2)
        kept_hf = set(order[max(len(order) - max(limit, 2 if limit == 1 else limit), 0) :])
        assert checkpoints_to_keep(sorted(order), limit, 5) == kept_hf, limit
