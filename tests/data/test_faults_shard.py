"""Fault injection on tools/shard.py in real processes: SIGKILL mid-run then a rerun, and Ctrl-C (SIGINT to the group)."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.common.paths import REPO_ROOT

pytestmark = pytest.mark.slow

N_DOCS = 12_000
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud light".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """About 6 MB of JSON Lines in two domains: long enough to be caught mid-run on any machine we test on."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("faults") / "docs.jsonl.gz"
    lines = (
        json.dumps({"text": " ".join(rng.choices(WORDS, k=80)) + f" {i}", "source": "ab"[i % 2]})
        for i in range(N_DOCS)
    )
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), mtime=0))
    return path


def _start(corpus: Path, out: Path) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO_ROOT / "tools" / "shard.py"), "dolma", str(corpus), "--out", str(out)]
    cmd += [
        "--max-seq-len",
        "64",
        "--workers",
        "2",
        "--chunk-records",
        "32",
        "--size-limit",
        "32kb",
        "--no-progress",
    ]
    # The run must take Ctrl-C as one started from a terminal does. A test run started in the background by a
    # non-interactive shell has SIGINT ignored, and an ignored signal stays ignored across exec (Python then
    # installs no KeyboardInterrupt handler): give the child the default disposition.
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # Its own process group: the signal reaches the workers too, as a terminal's Ctrl-C or a job killer's would.
        return subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    finally:
        signal.signal(signal.SIGINT, saved)


def _communicate(proc: subprocess.Popen, timeout_s: float) -> tuple[str, str]:
    """Wait for the run; on a timeout kill its whole group (a hung pool must not outlive the test) and fail."""
    try:
        return proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the run did not end within {timeout_s} s (killed); stderr tail:\n{stderr[-3000:]}")


def _staging(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.tmp-*"))


def _wait_mid_run(proc: subprocess.Popen, out: Path, timeout_s: float = 300) -> None:
    """Return once the run has written MDS shard files into its staging directory (it is mid-run)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(
                f"the run ended (exit {proc.returncode}) before the fault could be injected; make the corpus larger"
            )
        if any(any(d.rglob("shard.*.mds.zstd")) for d in _staging(out)):
            return
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"no shard file appeared in the staging directory within {timeout_s} s")


def test_sigkill_mid_run_then_rerun_cleans_up_and_succeeds(corpus, tmp_path):
    out = tmp_path / "out"
    proc = _start(corpus, out)
    _wait_mid_run(proc, out)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    leftover = _staging(out)
    assert proc.returncode == -signal.SIGKILL and not out.exists() and len(leftover) == 1

    rerun = _start(corpus, out)
    stdout, stderr = _communicate(rerun, 600)
    assert rerun.returncode == 0, stderr[-3000:]
    assert f"removing {leftover[0]}" in stderr and "interrupted run" in stderr
    assert _staging(out) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert f"records read {N_DOCS} = written {N_DOCS} + rejected 0" in stdout
    check = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "shard.py"), "verify", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert check.returncode == 0 and check.stdout.strip().endswith("OK"), check.stdout[-3000:]


def test_ctrl_c_mid_run_exits_130_with_one_line_and_no_staging(corpus, tmp_path):
    out = tmp_path / "out"
    proc = _start(corpus, out)
    _wait_mid_run(proc, out)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = _communicate(proc, 120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("interrupted: nothing written")
    assert list(tmp_path.iterdir()) == []  # neither the output nor the staging directory
