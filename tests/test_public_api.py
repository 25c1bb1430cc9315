"""The public import surface: every exported name resolves, and the HF port is one import away."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
