"""Differential scenarios: transformers.Trainer vs trainbus.plugins.Trainer on the same job (see hf_diff)."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_transformers():
    """transformers warns about tiny things (no config, no tokenizer) on every run: keep the output readable."""
    import transformers

    level, ours = transformers.logging.get_verbosity(), logging.getLogger("trainbus").level
    transformers.logging.set_verbosity_error()
    logging.getLogger("trainbus").setLevel(logging.ERROR)
    yield
    transformers.logging.set_verbosity(level)
    logging.getLogger("trainbus").setLevel(ours)  # a later test's caplog must see trainbus's warnings
