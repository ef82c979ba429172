"""The GPU suite (`pytest -m gpu`): every test needs CUDA and skips with the reason on a machine without it."""

from __future__ import annotations

import pytest
import torch

from tests.training.conftest import corpus_dir, dolma_shards  # noqa: F401  (the shards the Trainer runs read)

NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False on this machine (run `pytest -m gpu` on a GPU host)"


@pytest.fixture(scope="session")
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA)
    return torch.device("cuda")


@pytest.fixture(scope="session")
def two_gpus(cuda) -> int:
    count = torch.cuda.device_count()
    if count < 2:
        pytest.skip(f"needs 2 GPUs for a two-process FSDP run; this machine has {count}")
    return count
