"""Single-threaded CPU execution of the solvers' small-kernel loops (a process-wide setting)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

log = logging.getLogger(__name__)

__all__ = ["single_thread_on_cpu"]


@contextlib.contextmanager
def single_thread_on_cpu(device: torch.device, enabled: bool) -> Iterator[None]:
    """Run the block with one intra-op thread when ``enabled`` and on CPU; restore the count after.

    PyTorch's intra-op thread count is process-wide (``torch.set_num_threads``): while the block
    runs, every other Python thread of the process also runs single-threaded, and two such blocks
    in different threads can restore each other's value in the wrong order. Hence an option (the
    ``cpu_single_thread`` option of ``partitionsel`` and ``iwd``, default on since issue 15's
    measurements, see ``PartitionSelOptions``). On a machine whose cores are busy with other
    work, the OpenMP/BLAS hand-offs of the OMP rounds' kernels (vectors of a few thousand
    entries, matrices up to ``k x N``) can cost several times the work itself.

    Args:
        device: where the solver runs (CUDA blocks are left alone).
        enabled: whether to change the thread count at all.
    """
    if not enabled or device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
