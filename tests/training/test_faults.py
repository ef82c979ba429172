"""Fault injection: a run SIGKILLed mid-training and autoresumed matches an uninterrupted run, and a
rank killed under the composer launcher brings the whole job down quickly instead of hanging."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from pipeline.streaming_cleanup import clean_stale_streaming_resources
from tests.common.paths import COMPOSER_LAUNCHER, REPO_ROOT
from tests.training.conftest import tiny_overrides

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
LINE = re.compile(r"\[metric\]\[batch=(\d+)\]: (\S+): (\S+)")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO_ROOT)}

# Runs train.main with a callback that SIGKILLs this process group at the end of a given step,
# as a scheduler or the OOM killer would (no atexit handler, no resource tracker cleanup).
KILL_AT_STEP = """
import os, signal, sys
import train
from composer.core import Callback

kill_at = int(sys.argv[1])

class KillAt(Callback):
    def batch_end(self, state, logger):
        if int(state.timestamp.batch.value) == kill_at:
            os.killpg(os.getpgid(0), signal.SIGKILL)

build = train.build_trainer

def build_and_arm(cfg):
    trainer = build(cfg)
    print("SHM_PREFIX", trainer.state.train_dataloader.dataset._shm_prefix_int, flush=True)
    trainer.state.callbacks.append(KillAt())
    return trainer

train.build_trainer = build_and_arm
train.main(sys.argv[2:])
"""


@pytest.fixture(autouse=True)
def _clean_streaming_leftovers():
    """Killed processes leave Streaming shared memory and file locks; remove what no one holds."""
    yield
    clean_stale_streaming_resources()


def _metrics(run_dir: Path, rank: int = 0) -> dict[str, dict[int, list[float]]]:
    """Every logged value per metric and step (a step logged again after a resume has two)."""
    out: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for line in (run_dir / f"log-rank{rank}.txt").read_text().splitlines():
        m = LINE.search(line)
        if m:
            out[m.group(2)][int(m.group(1))].append(float(m.group(3)))
    return out


def _model_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state"]["model"]


@pytest.mark.slow
def test_sigkill_mid_training_then_autoresume_matches_uninterrupted_run(dolma_shards, tmp_path):
    def args(run: Path) -> list[str]:
        return [
            str(TINY),
            *tiny_overrides(
                dolma_shards,
                run,
                "eval_loader=null",
                "run_name=fault-resume",
                "autoresume=true",
                "max_duration=8ba",
                "save_interval=3ba",
            ),
        ]

    full, crashed = tmp_path / "full", tmp_path / "crashed"
    res = subprocess.run(
        [sys.executable, "train.py", *args(full)],
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]

    # Killed after step 5 (0-based batches 0..4 trained), between the checkpoints at 3 and 6.
    res = subprocess.run(
        [sys.executable, "-c", KILL_AT_STEP, "5", *args(crashed)],
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )
    assert res.returncode == -signal.SIGKILL, res.stderr[-4000:]
    assert (crashed / "ep0-ba3-rank0.pt").exists() and not (crashed / "ep0-ba6-rank0.pt").exists()
    prefix = int(re.search(r"SHM_PREFIX (\d+)", res.stdout).group(1))
    stale = Path("/dev/shm") / f"{prefix:06}_locals"
    assert not os.path.isdir("/dev/shm") or stale.exists()  # SIGKILL left the run's shared memory
    before = _metrics(crashed)
    assert sorted(before["selection/selected_hash"]) == [0, 1, 2, 3, 4]

    # The same command again: autoresume picks up the checkpoint at batch 3.
    res = subprocess.run(
        [sys.executable, "train.py", *args(crashed)],
        cwd=REPO_ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]

    # The stale shared memory was removed at start (or reused and released at exit); a block with
    # this prefix that names another directory belongs to some other job on the machine.
    if stale.exists():
        assert str(dolma_shards) not in stale.read_bytes().decode("utf-8", "replace")

    a, b = _metrics(full), _metrics(crashed)
    # The log kept the crashed run's lines: steps 3 and 4 were trained twice (before and after).
    for key in ("selection/selected_hash", "loss/train/total"):
        assert sorted(a[key]) == list(range(8)) == sorted(b[key]), key
        for step in range(8):
            assert len(a[key][step]) == 1
            assert len(b[key][step]) == (2 if step in (3, 4) else 1), (key, step, b[key][step])
            assert set(b[key][step]) == set(a[key][step]), (key, step, a[key][step], b[key][step])

    wa, wb = _model_weights(full / "latest-rank0.pt"), _model_weights(crashed / "latest-rank0.pt")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), (name, (wa[name] - wb[name]).abs().max().item())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    """The pid of the launcher's child process that runs global rank `rank`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != launcher_pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env:
            return int(pid)
    return None


@pytest.mark.slow
@pytest.mark.world_size(2)
def test_one_rank_killed_under_composer_launcher_fails_within_60s(dolma_shards, tmp_path):
    if not os.path.isdir("/proc"):
        pytest.skip("needs /proc to find the rank's process")
    run = tmp_path / "dist"
    cmd = [
        *COMPOSER_LAUNCHER, "-n", "2", "--master_port", str(_free_port()), str(REPO_ROOT / "train.py"), str(TINY),
        *tiny_overrides(dolma_shards, run, "eval_loader=null", "max_duration=100000ba", "save_interval=2ba"),
    ]  # fmt: skip
    log_path = tmp_path / "launcher.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen(cmd, cwd=REPO_ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
    try:
        # Both ranks are training once the checkpoint at batch 2 (written after a barrier) exists.
        deadline = time.monotonic() + 400
        while not (run / "ep0-ba2-rank0.pt").exists():
            assert launcher.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, "the two-rank run did not reach batch 2 in 400 s"
            time.sleep(0.2)
        pid = _rank_pid(launcher.pid, 1)
        assert pid is not None, "rank 1's process not found among the launcher's children"
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        try:
            rc = launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the launcher still runs 60 s after rank 1 was killed:\n{log_path.read_text()[-4000:]}"
            )
        elapsed = time.monotonic() - t0
        print(f"launcher exited with {rc} {elapsed:.1f} s after rank 1 was killed")
        assert rc != 0
        assert elapsed < 60
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
