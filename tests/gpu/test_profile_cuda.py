"""`profile_step.gpu_busy_by_stage` on real CUDA events (tools/bench/profile_gpu_step.py prints it on a GPU)."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_gpu_occupancy_sees_a_ranges_kernels_and_an_idle_range_on_cuda(cuda):
    """A range that waits for its own matrix products keeps the GPU busy most of its host time; a range that only
    sleeps on the host leaves it idle. Kineto's kernel events must land on the host clock for either to hold."""
    from profile_step import gpu_busy_by_stage
    from torch.profiler import ProfilerActivity, profile, record_function

    a, b = torch.randn(4096, 4096, device=cuda), torch.randn(4096, 4096, device=cuda)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("train"):
            for _ in range(20):
                c = a @ b
            torch.cuda.synchronize()
        with record_function("selection"):
            time.sleep(0.05)
        with record_function("selection/solve"):  # mirrored on the device from its first kernel to its last
            a.add_(1.0)
            time.sleep(0.05)
            a.add_(1.0)
            torch.cuda.synchronize()
    del c
    busy = gpu_busy_by_stage(prof.events())
    host_train, gpu_train = busy["train"]
    host_sel, gpu_sel = busy["selection"]
    assert gpu_train > 0.5 * host_train, busy
    assert gpu_sel < 0.1 * host_sel, busy
    host_solve, gpu_solve = busy["selection/solve"]
    assert gpu_solve < 0.1 * host_solve, busy  # two short kernels 50 ms apart: the gap is idle
