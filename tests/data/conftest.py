"""Fixtures for the data-pipeline tests: a small generated corpus and the demo tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
from sample_corpus import write_sample_corpus  # tools/sample_corpus.py

from pipeline.tokenizer import DEMO_TOKENIZER, load_tokenizer

SCALE = 0.06


@pytest.fixture(scope="session")
def sample_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated corpus at 6% of the default scale (seed 0); treat it as read-only."""
    root = tmp_path_factory.mktemp("sample_corpus")
    write_sample_corpus(root, seed=0, scale=SCALE)
    return root


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(DEMO_TOKENIZER)
