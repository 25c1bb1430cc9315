"""TRL differential tests: quiet the libraries' progress bars and warnings (every run maps datasets)."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("trl")


@pytest.fixture(autouse=True)
def _quiet_libraries():
    import datasets
    import transformers

    level, ours = transformers.logging.get_verbosity(), logging.getLogger("trainbus").level
    bars = datasets.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    logging.getLogger("trainbus").setLevel(logging.ERROR)
    yield
    transformers.logging.set_verbosity(level)
    logging.getLogger("trainbus").setLevel(ours)
    if bars:
        datasets.enable_progress_bars()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One locally trained tokenizer (WordPiece, ChatML specials, a chat template with generation markers)."""
    from trl_jobs import write_tokenizer

    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))
