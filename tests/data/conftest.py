"""Fixtures for the data-pipeline tests: a small generated corpus and the demo tokenizer."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.tokenizer import DEMO_TOKENIZER, load_tokenizer
from tests.common.paths import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tools"))
from sample_corpus import write_sample_corpus  # noqa: E402  (tools/sample_corpus.py)

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
