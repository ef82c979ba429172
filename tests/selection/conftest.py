"""Selection tests run single-threaded: their many tiny kernels only pay for OpenMP hand-offs."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Use one intra-op thread for the module (module fixtures included) and restore the previous setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
