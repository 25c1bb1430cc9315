"""The public import surface: every exported name resolves, the first names are ``from trainbus import ...``,
and the HF port is one import away."""

from __future__ import annotations

import subprocess
import sys

import pytest

import trainbus
import trainbus.plugins


@pytest.mark.parametrize("name", trainbus.plugins.__all__)
def test_every_exported_plugin_name_resolves(name: str) -> None:
    assert getattr(trainbus.plugins, name) is not None


def test_unknown_names_raise_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Trainr'"):
        trainbus.plugins.Trainr  # noqa: B018


def test_importing_the_engine_pulls_in_no_feature_library() -> None:
    code = (
        "import sys, trainbus.engine, trainbus.hooks, trainbus.plugins;"
        "heavy = ('accelerate', 'ignite', 'safetensors', 'transformers', 'hypothesis');"
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_the_first_names_are_one_import_away() -> None:
    from trainbus import Engine, Event, Plugin, Trainer, TrainingArguments
    from trainbus.engine import Engine as EngineFromEngine
    from trainbus.plugins import Trainer as TrainerFromPlugins

    assert Engine is EngineFromEngine and Trainer is TrainerFromPlugins
    assert TrainingArguments.__name__ == "TrainingArguments" and Event.TRAIN_START and issubclass(Plugin, object)
    assert set(trainbus.__all__) <= set(dir(trainbus))


def test_the_seq2seq_pair_is_one_import_away_too() -> None:
    """A transformers script's ``from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments`` ports by
    changing ``transformers`` to ``trainbus``, as the Trainer's import does."""
    from trainbus import Seq2SeqTrainer, Seq2SeqTrainingArguments
    from trainbus.plugins import Seq2SeqTrainer as FromPlugins
    from trainbus.plugins import Seq2SeqTrainingArguments as ArgsFromPlugins

    assert Seq2SeqTrainer is FromPlugins and Seq2SeqTrainingArguments is ArgsFromPlugins


def test_the_version_is_the_installed_distributions() -> None:
    import importlib.metadata

    assert trainbus.__version__ == importlib.metadata.version("trainbus")
    assert trainbus.__version__.count(".") >= 2


def test_unknown_top_level_names_raise_with_a_suggestion() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Trainr'; did you mean 'Trainer'"):
        trainbus.Trainr  # noqa: B018


def test_the_top_level_package_loads_what_is_asked_for_only() -> None:
    code = (
        "import sys, trainbus; print('torch' in sys.modules, 'trainbus.engine' in sys.modules);"
        "import trainbus.engine; print('trainbus.plugins' in sys.modules);"
        "trainbus.Trainer; print('trainbus.plugins.facade.trainer' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False", "False", "True"]
