"""A real run on the GPU path: 20 steps of amp_bf16 + partitionsel, FSDP on one GPU (issue 30.4) and over two (issue 12.5)."""

from __future__ import annotations

import math
import os
import socket
import subprocess

import pytest
from composer.loggers import InMemoryLogger

import train
from composer_algos.data_selection.algorithm import find_data_selection
from pipeline.config import load_config
from tests.common.paths import COMPOSER_LAUNCHER, REPO_ROOT
from tests.training.conftest import tiny_overrides

pytestmark = pytest.mark.gpu

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
GPU_RUN = ("device=gpu", "precision=amp_bf16", "max_duration=20ba", "eval_loader=null")


def _series(trainer, key: str) -> list[float]:
    mem = next(d for d in trainer.logger.destinations if isinstance(d, InMemoryLogger))
    return [float(v) for _, v in mem.data.get(key, [])]


@pytest.mark.parametrize("solver_loop", ["host", "device_triton"])
def test_twenty_steps_amp_bf16_with_partitionsel(cuda, dolma_shards, tmp_path, solver_loop, monkeypatch):
    """The default host loop, and the Triton rounds (issue 31.3) in a training run: launched one by one at these
    4 picks a step (graphs from 16), counted so that a run falling back to the eager rounds fails."""
    from composer_algos.selection import omp_triton

    launches = []
    real_call = omp_triton.TritonRound.__call__
    monkeypatch.setattr(omp_triton.TritonRound, "__call__", lambda self, kkt: launches.append(kkt) or real_call(self, kkt))
    loop = f"algorithms.data_selection.strategy_options.partitionsel.solver_loop={solver_loop}"
    cfg = load_config(TINY, tiny_overrides(dolma_shards, tmp_path, "loggers.in_memory={}", *GPU_RUN, loop))
    trainer = train.build_trainer(cfg)
    trainer.fit()
    algo = find_data_selection(trainer.state)
    assert str(trainer.state.precision.value) == "amp_bf16"
    losses = _series(trainer, "loss/train/total")
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses)
    assert _series(trainer, "selection/fallback") == [0.0] * 20, "features or solves failed on the GPU"
    assert _series(trainer, "selection/kept_samples") == [4.0] * 20
    # chunk_size auto: the run's microbatch (the 4 examples trained per step), unless an OOM halved it.
    assert set(_series(trainer, "selection/score_chunk_size")) <= {4.0, 2.0, 1.0}
    assert algo is not None and algo.extractor.normalization_in_use.startswith("adam_optimizer")
    # Every step's 4 picks in Triton's kernels (repaired rounds run again), and none with the host loop.
    assert len(launches) >= 80 if solver_loop == "device_triton" else not launches, len(launches)
    trainer.close()


def test_select_ahead_on_cuda_with_frozen_weights_picks_what_the_step_picks(cuda, dolma_shards, tmp_path):
    """select_ahead: true under amp_bf16 on the GPU: the next step's selection made while the backward runs. With the
    weights frozen (lr 1e-30) and features that do not read the optimizer, it must pick what selecting at the step
    picks, every step; `selection/made_ahead` shows it was made ahead from the second step on."""
    frozen = [*GPU_RUN, "max_duration=6ba", "optimizer.lr=1e-30", "algorithms.data_selection.features.normalization=none"]
    hashes = {}
    for mode in ("now", "ahead"):
        extra = ["algorithms.data_selection.select_ahead=true"] if mode == "ahead" else []
        cfg = load_config(TINY, tiny_overrides(dolma_shards, tmp_path / mode, "loggers.in_memory={}", *frozen, *extra))
        trainer = train.build_trainer(cfg)
        trainer.fit()
        hashes[mode] = _series(trainer, "selection/selected_hash")
        if mode == "ahead":
            assert _series(trainer, "selection/made_ahead") == [0.0] + [1.0] * 5
        assert _series(trainer, "selection/fallback") == [0.0] * 6
        trainer.close()
    assert len(hashes["now"]) == 6 and hashes["ahead"] == hashes["now"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_on_one_gpu_runs_partitionsel(cuda, dolma_shards, tmp_path):
    """The 1B recipe's FSDP settings on one GPU, where FSDP makes FULL_SHARD NO_SHARD (issue 30.4)."""
    run = tmp_path / "fsdp1"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "0"}
    cmd = [
        *COMPOSER_LAUNCHER, "-n", "1", "--master_port", str(_free_port()), str(REPO_ROOT / "train.py"), str(TINY),
        *tiny_overrides(dolma_shards, run, *GPU_RUN, "max_duration=6ba"),
        "fsdp_config={sharding_strategy: FULL_SHARD, mixed_precision: PURE, activation_checkpointing: true}",
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    lines = (run / "log-rank0.txt").read_text().splitlines()
    assert len([ln for ln in lines if "[metric]" in ln and "selection/selected_hash" in ln]) == 6
    assert not any("selection/fallback: 1" in ln for ln in lines), "features or solves failed under FSDP"


@pytest.mark.parametrize("sharding", ["FULL_SHARD"])
def test_fsdp_two_gpus_selects_identically_on_both_ranks(two_gpus, dolma_shards, tmp_path, sharding):
    run = tmp_path / "fsdp"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [
        *COMPOSER_LAUNCHER,
        "-n",
        "2",
        "--master_port",
        str(_free_port()),
        str(REPO_ROOT / "train.py"),
        str(TINY),
        *tiny_overrides(dolma_shards, run, *GPU_RUN, "max_duration=6ba"),
        f"fsdp_config={{sharding_strategy: {sharding}, mixed_precision: PURE}}",
        "algorithms.data_selection.check_consistency=true",
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    hashes = []
    for rank in (0, 1):
        text = (run / f"log-rank{rank}.txt").read_text()
        hashes.append([ln.rsplit(" ", 1)[-1] for ln in text.splitlines() if "selection/selected_hash" in ln])
        assert not any("selection/fallback: 1" in ln for ln in text.splitlines()), f"rank {rank} fell back"
    assert len(hashes[0]) == 6 and hashes[0] == hashes[1]
