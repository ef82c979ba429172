"""tools/bench/bench_shard.py --start-methods (issue 20.1): the smallest comparison runs end to end and prints its table."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from tests.common.paths import REPO_ROOT


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, str(REPO_ROOT / "tools" / "bench" / "bench_shard.py"), *args]
    return subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # 22 s idle; kept out of the default suite's 15 minutes (the option checks below run by default)
@pytest.mark.timeout(240)  # two fresh processes importing torch and transformers: measured 16 s at load 4-7 on 2 cores
def test_start_method_comparison_prints_a_row_per_method():
    proc = _bench("--scale", "0.02", "--repeats", "1", "--start-methods", "fork,forkserver", "--workers", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[0] == "2" and fields[1] in ("fork", "forkserver"):
            rows[fields[1]] = fields
    assert sorted(rows) == ["fork", "forkserver"], proc.stdout
    tokens = {m: int(r[2]) for m, r in rows.items()}
    assert tokens["fork"] == tokens["forkserver"] > 0, proc.stdout  # the same output, whatever the start method
    for fields in rows.values():
        best, median = float(fields[3].rstrip("s")), float(fields[4].rstrip("s"))
        assert math.isfinite(best) and 0 < best <= median, fields
    assert rows["forkserver"][-2].endswith("s,") and rows["forkserver"][-1].endswith("s"), rows["forkserver"]


def test_start_method_comparison_refuses_an_unknown_method():
    proc = _bench("--start-methods", "fork,threads")
    assert proc.returncode == 2 and "--start-methods needs two or more of" in proc.stderr and "'fork,threads'" in proc.stderr, proc.stderr
