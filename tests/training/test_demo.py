"""The README's demo command runs end to end (few steps) and prints the per-domain losses and mixture."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.common.paths import REPO_ROOT


def test_demo_runs_offline_end_to_end(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "demo.py"), "--out", str(out), "--steps", "4"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Per-domain validation loss" in result.stdout
    assert "Domain mixture over 4 steps" in result.stdout
    mix = json.loads((out / "runs" / "demo-partitionsel" / "mixture.json").read_text())
    assert set(mix["weights"]) == {"common-crawl", "reddit", "spam", "stackexchange", "wiki"}
