"""Two processes on CPU with the composer launcher (gloo): global and local scope, and resumption."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

from tests.common.paths import COMPOSER_LAUNCHER, REPO_ROOT
from tests.training.conftest import tiny_overrides

# Two launcher processes on a loaded 2-core machine can time out; one rerun, never more.
pytestmark = [pytest.mark.world_size(2), pytest.mark.flaky(reruns=1)]

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
LINE = re.compile(r"\[metric\]\[batch=(\d+)\]: (\S+): (\S+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(shards: Path, run_dir: Path, *extra: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        *COMPOSER_LAUNCHER, "-n", "2", "--master_port", str(_free_port()), str(REPO_ROOT / "train.py"), str(TINY),
        *tiny_overrides(shards, run_dir, "eval_loader=null", *extra),
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def _metrics(run_dir: Path, rank: int) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = defaultdict(dict)
    for line in (run_dir / f"log-rank{rank}.txt").read_text().splitlines():
        m = LINE.search(line)
        if m:
            out[m.group(2)][int(m.group(1))] = float(m.group(3))
    return out


@pytest.mark.timeout(180)  # measured 30 s on the loaded 2-core machine (issue 20.3)
def test_global_scope_same_selection_on_both_ranks_and_equal_batches(dolma_shards, tmp_path):
    run = tmp_path / "global"
    _launch(dolma_shards, run, "algorithms.data_selection.scope=global",
            "algorithms.data_selection.check_consistency=true")
    r0, r1 = _metrics(run, 0), _metrics(run, 1)
    assert len(r0["selection/selected_hash"]) == 3
    # Identical by construction (rank 0's selection is broadcast); check_consistency compared the
    # gathered problems, so the run reaching here means the ranks' features were bit-identical.
    assert r0["selection/selected_hash"] == r1["selection/selected_hash"]
    # chunk_size auto scores the run's microbatch (default: the 2 examples a rank trains) per forward.
    assert set(r0["selection/score_chunk_size"].values()) == {2.0} == set(r1["selection/score_chunk_size"].values())
    # global_train_batch_size 4 over 2 ranks: each trains exactly 2 of the 12 pooled candidates.
    assert set(r0["selection/kept_samples"].values()) == {2.0} == set(r1["selection/kept_samples"].values())
    assert (run / "mixture.json").exists()


@pytest.mark.timeout(180)  # measured 25 s on the loaded 2-core machine (issue 20.3)
def test_local_scope_runs(dolma_shards, tmp_path):
    run = tmp_path / "local"
    _launch(dolma_shards, run, "algorithms.data_selection.scope=local")
    r0, r1 = _metrics(run, 0), _metrics(run, 1)
    assert set(r0["selection/kept_samples"].values()) == {2.0} == set(r1["selection/kept_samples"].values())


@pytest.mark.timeout(300)  # measured 72 s on the loaded 2-core machine (issue 20.3)
def test_resumed_two_process_run_reproduces_selections_and_losses(dolma_shards, tmp_path):
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _launch(dolma_shards, full, "max_duration=6ba", "save_interval=3ba")
    ckpt = full / "ep0-ba3-rank0.pt"
    assert ckpt.exists()
    _launch(dolma_shards, resumed, "max_duration=6ba", f"load_path={ckpt}")
    a, b = _metrics(full, 0), _metrics(resumed, 0)
    steps = sorted(b["loss/train/total"])
    assert steps == [3, 4, 5]  # the steps after the checkpoint at batch 3
    for step in steps:
        assert b["loss/train/total"][step] == a["loss/train/total"][step]
        assert b["selection/selected_hash"][step] == a["selection/selected_hash"][step]


@pytest.mark.timeout(400)
def test_select_ahead_on_two_ranks_selects_identically_and_resumes_selecting_at_the_step(dolma_shards, tmp_path):
    """select_ahead under global scope: both ranks make the next step's selection ahead, in the same collectives, and
    pick the same rows; a resume (rank 0's checkpoint cannot hold the other rank's pending selection) selects its first
    step at the step on both ranks, then goes on ahead."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    common = ["algorithms.data_selection.scope=global", "algorithms.data_selection.check_consistency=true",
              "algorithms.data_selection.select_ahead=true", "max_duration=6ba"]
    _launch(dolma_shards, full, *common, "save_interval=3ba")
    _launch(dolma_shards, resumed, *common, f"load_path={full / 'ep0-ba3-rank0.pt'}")
    for run, first in ((full, 0), (resumed, 3)):
        r0, r1 = _metrics(run, 0), _metrics(run, 1)
        expected = {s: float(s > first) for s in range(first, 6)}
        assert r0["selection/made_ahead"] == expected == r1["selection/made_ahead"], run
        assert r0["selection/selected_hash"] == r1["selection/selected_hash"] and len(r0["selection/selected_hash"]) == 6 - first
        assert set(r0["selection/kept_samples"].values()) == {2.0} == set(r1["selection/kept_samples"].values())
