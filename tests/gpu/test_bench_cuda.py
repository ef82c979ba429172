"""`tools/bench/bench_step.py --device cuda` prints the CPU run's ratios plus the peak-memory line (issue 12.5)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.common.paths import REPO_ROOT

pytestmark = pytest.mark.gpu


def test_bench_step_on_cuda_prints_ratios_and_scoring_peak_within_training_peak(cuda):
    cmd = [
        sys.executable,
        str(REPO_ROOT / "tools" / "bench" / "bench_step.py"),
        "--device",
        "cuda",
        "--steps",
        "6",
        "--configs",
        "tiny",
        "--ratios",
        "2,4",
        "--repeats",
        "3",
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    print(out)
    assert "(ps-rand)/fwd" in out and "ps/random" in out
    peaks = re.findall(r"scoring/training (\d+\.\d+) \(target <= 1\)", out)
    assert len(peaks) == 2, out
    assert all(float(p) <= 1.0 for p in peaks), out
