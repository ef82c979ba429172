"""DoReMi over two CPU processes (gloo) equals one process on the same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.common.paths import REPO_ROOT

# Two launcher processes on a loaded 2-core machine can time out; one rerun, never more.
pytestmark = [pytest.mark.world_size(2), pytest.mark.flaky(reruns=1)]

WORKER = REPO_ROOT / "tests" / "doremi" / "dist_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.timeout(600)  # measured 102-115 s on the loaded 2-core machine (issue 20.3)
# Microbatches of 3 (the split path) run by default; 6 (one microbatch a rank) with -m slow: the suite's 15 minutes.
@pytest.mark.parametrize("microbatch", [pytest.param(6, marks=pytest.mark.slow), 3])
def test_two_ranks_match_one_process(tmp_path, microbatch):
    single, double = tmp_path / "single.json", tmp_path / "double.json"
    _run([sys.executable, str(WORKER), str(single), "--device-batch", "12", "--microbatch", "12"])
    composer = Path(sys.executable).with_name("composer")
    _run([str(composer), "-n", "2", "--master_port", str(_free_port()), str(WORKER), str(double),
          "--device-batch", "6", "--microbatch", str(microbatch)])
    a, b = json.loads(single.read_text()), json.loads(double.read_text())
    assert b["world_size"] == 2 and a["world_size"] == 1
    for key in ("alpha", "lambda", "average"):
        assert b[key] == pytest.approx(a[key], abs=1e-6), key
    assert b["first_param"] == pytest.approx(a["first_param"], abs=1e-5)
    assert b["param_sum"] == pytest.approx(a["param_sum"], rel=1e-5)
