"""tools/bench/profile_gpu_step.py on the CPU (--smoke): the four arms profiled, their stage tables and traces."""

from __future__ import annotations

import profile_gpu_step  # noqa: E402
import pytest


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_smoke_profiles_four_arms_with_stage_tables_and_traces(tmp_path, capsys):
    assert profile_gpu_step.main(["--smoke", "--trace-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for arm in ("random", "partitionsel", "partitionsel+compiled", "partitionsel+ahead"):
        assert f"===== {arm}: " in out
        assert (tmp_path / f"{arm}.json").stat().st_size > 0
    assert out.count("selection/features") >= 2  # the partitionsel arms score features; random does not
    assert "host wait: aten::item" in out
    ahead = out.split("===== partitionsel+ahead: ")[1]
    assert "selection/ahead" in ahead  # the profiled step made the next step's selection inside its training


def test_steps_below_one_are_refused():
    with pytest.raises(SystemExit):
        profile_gpu_step.main(["--smoke", "--steps", "0"])


def _event(name, start_us, end_us, device="CPU", annotation=False):
    from types import SimpleNamespace

    return SimpleNamespace(
        name=name, device_type=SimpleNamespace(name=device), time_range=SimpleNamespace(start=start_us, end=end_us),
        is_user_annotation=annotation,
    )


def test_gpu_occupancy_is_the_union_of_device_intervals_within_each_host_range():
    """Hand-computed: the selection's host range [0, 100] ms holds kernels [10, 30] and [20, 40] (overlapping: 30 ms
    busy) and the start of [90, 120] (10 ms); the training's [100, 200] holds the rest of it (20 ms) and [130, 200]
    (70 ms); a kernel after the step counts for no stage. Two steps: the second selection adds 50 ms of host time,
    all of it idle."""
    from profile_step import format_occupancy, gpu_busy_by_stage

    ms = 1000.0
    events = [
        _event("step", 0, 200 * ms), _event("selection", 0, 100 * ms), _event("train", 100 * ms, 200 * ms),
        _event("selection", 300 * ms, 350 * ms), _event("aten::mm", 0, 5 * ms),
        *(_event("kernel", a * ms, b * ms, "CUDA") for a, b in ((10, 30), (20, 40), (90, 120), (130, 200), (400, 410))),
    ]
    busy = gpu_busy_by_stage(events)
    assert busy == {"step": (200 * ms, 130 * ms), "selection": (150 * ms, 40 * ms), "train": (100 * ms, 90 * ms)}
    table = format_occupancy(busy, steps=2).splitlines()
    assert table[2].split() == ["selection", "75.0", "20.0", "55.0", "73.3"]  # a step: 75 ms of host, 20 busy
    assert [line.split()[0] for line in table[1:]] == ["step", "selection", "train"]


def test_gpu_occupancy_ignores_ranges_mirrored_on_the_device():
    """Kineto mirrors a `record_function` range on the device as a user annotation from its first kernel to its
    last: a selection with a kernel at 1 ms and one at 99 ms is 2 ms busy, not 100 (the H200 run of 2026-11-27
    printed every stage 0% idle from these)."""
    from profile_step import gpu_busy_by_stage
    from step_audit import device_work

    ms = 1000.0
    events = [
        _event("selection", 0, 100 * ms), _event("selection", 0.5 * ms, 99.5 * ms, "CUDA", annotation=True),
        _event("kernel", 0.5 * ms, 1.5 * ms, "CUDA"), _event("kernel", 98.5 * ms, 99.5 * ms, "CUDA"),
    ]
    assert gpu_busy_by_stage(events) == {"selection": (100 * ms, 2 * ms)}
    assert [e.name for e in device_work(events)] == ["kernel", "kernel"]


def test_gpu_occupancy_of_a_cpu_profile_is_zero():
    import torch
    from profile_step import gpu_busy_by_stage
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function("selection"):
            torch.randn(64, 64) @ torch.randn(64, 64)
    busy = gpu_busy_by_stage(prof.events())
    assert set(busy) == {"selection"} and busy["selection"][0] > 0 and busy["selection"][1] == 0.0
