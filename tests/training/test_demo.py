"""The README's demo command runs end to end (few steps): a progress bar, then a short summary and two plots."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.common.paths import REPO_ROOT

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


@pytest.mark.timeout(180)  # measured 40 s on the loaded 2-core machine (issue 20.3)
def test_demo_runs_offline_end_to_end(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "tools" / "demo.py"), "--out", str(out), "--steps", "4"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=ENV,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = out / "runs" / "demo-partitionsel"
    stdout = result.stdout
    # The summary: per-domain validation loss, the mixture table, the wall time, the plots' paths.
    assert "Per-domain validation loss" in stdout
    assert "Domain mixture over 4 steps" in stdout
    for header in ("natural", "pool", "selected"):
        assert header in stdout
    assert "wall time" in stdout
    # The table is not read as a finding: proportional capacities make it the pool's mixture (issue 30.3).
    assert "sel/pool = 1 by construction" in stdout and "policy: slack" in stdout
    for name in ("mixture.png", "val_curves.png"):
        png = run_dir / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert str(png) in stdout
    mix = json.loads((run_dir / "mixture.json").read_text())
    assert set(mix["weights"]) == {"common-crawl", "reddit", "spam", "stackexchange", "wiki"}
    # No flood on the console: neither Composer's per-step metric lines nor Python warnings.
    console = stdout + result.stderr
    assert "Train loss/train/total" not in console
    assert "Warning" not in console and "WARNING" not in console
    assert len(stdout.splitlines()) < 60, stdout
    # ... but every metric stays in the run's files.
    log = (run_dir / "console.log").read_text()
    assert "[batch=4/4]" in log and "loss/train/total" in log
    assert "data/mixture/wiki" in (run_dir / "log-rank0.txt").read_text()


@pytest.mark.parametrize(
    ("strategy", "capacities", "says"),
    [
        ("partitionsel", None, "by construction"),
        ("id", "proportional", "by construction"),
        ("partitionsel", {"policy": "slack", "factor": 2}, "the selection chose"),
        ("partitionsel", {"policy": "fractions", "file": "w.json"}, "follow the policy"),
        ("random", None, "up to chance"),
        ("greats", None, "up to chance"),
        ("none", None, "whole pool"),
    ],
)
def test_mixture_note_says_whether_the_shares_were_chosen(strategy, capacities, says):
    from demo import mixture_note

    assert says in mixture_note(strategy, capacities)


def test_demo_help_imports_nothing_heavy():
    # `--help` must answer at once: torch, composer and matplotlib load only after argument parsing.
    code = (
        "import runpy, sys\n"
        "sys.argv = ['demo.py', '--help']\n"
        "try:\n"
        f"    runpy.run_path({str(REPO_ROOT / 'tools' / 'demo.py')!r}, run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('HEAVY', sorted(m for m in ('torch', 'composer', 'matplotlib', 'tqdm') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, env=ENV
    )
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
    assert "HEAVY []" in result.stdout, result.stdout[-500:]


def test_the_progress_bar_shows_the_loss_again_after_an_evaluation(tmp_path, capsys):
    # It kept "evaluating" for the rest of training (a new-user review). A stand-in for train.py prints Composer's
    # console lines: a logged step, an evaluation, then a step whose loss line has not come yet.
    from demo import _train_with_progress

    lines = ["[batch=1/3]:", "Train loss/train/total: 2.5000", "[Eval batch=1/1] Eval on eval data", "[batch=2/3]:"]
    script = "; ".join(f"print({ln!r}, flush=True)" for ln in lines)
    _train_with_progress([sys.executable, "-c", script], tmp_path / "log.txt", steps=3)
    final = capsys.readouterr().err.split("\r")[-1]
    assert "2/3" in final and "loss 2.5000" in final and "evaluating" not in final, final
