"""select_ahead under Composer's FSDP on two ranks (CPU, gloo): each rank's sharded units train as without FSDP.

With select_ahead the next pool's scoring pass runs between a step's backward and its optimizer step. Under FSDP
on several ranks that pass, alone, drops the sharded training gradients of the units it runs a backward through
and leaves the blocks below the cut gathered with their old weights under SHARD_GRAD_OP
(`composer_algos.features.targets.sharded_fsdp_units_kept`, which the algorithm wraps it in; the mechanism is
tests/features/test_fsdp.py's, at torch's FSDP level). Here Composer runs the tiny config with `fsdp_config`
(FULL_SHARD and SHARD_GRAD_OP, `use_orig_params: true`) and select_ahead on two processes, through
tests/training/cpu_fsdp_runs.py, and every step's selection and loss must be those of the same run without FSDP
(DDP), up to the order of the gradient reduction: within 1e-6 relative when measured (2026-11-27); without the
context, SHARD_GRAD_OP's losses left the run without FSDP by 1.3e-4 relative by the fifth step (FULL_SHARD's
did not: Composer's optimizer steps the original parameters, whose gradients kept their views). A launch a
run, about 17 s each on the 2-core machine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from tests.common.paths import COMPOSER_LAUNCHER, REPO_ROOT
from tests.training.conftest import tiny_overrides

pytestmark = [pytest.mark.world_size(2), pytest.mark.flaky(reruns=1)]

TINY = REPO_ROOT / "yamls" / "testing" / "tiny_dolma.yaml"
STEPS = 5
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_rank_runs(dolma_shards, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("fsdp_two_ranks")
    ahead = ["eval_loader=null", "algorithms.data_selection.strategy=partitionsel", f"max_duration={STEPS}ba",
             "algorithms.data_selection.scope=global", "algorithms.data_selection.select_ahead=true", "save_folder=null"]
    runs = {
        s: tiny_overrides(dolma_shards, tmp / s, *ahead, f"fsdp_config={{sharding_strategy: {s}, use_orig_params: true}}")
        for s in STRATEGIES
    }
    runs["without_fsdp"] = tiny_overrides(dolma_shards, tmp / "plain", *ahead)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    results: list[dict] = [{}, {}]
    for name, overrides in runs.items():  # a launch each: a two-rank FSDP process may crash at its teardown
        (tmp / f"{name}.json").write_text(json.dumps({name: overrides}))
        cmd = [*COMPOSER_LAUNCHER, "-n", "2", "--master_port", str(_free_port()), "-m", "tests.training.cpu_fsdp_runs",
               str(tmp / f"{name}.out.json"), str(TINY), str(tmp / f"{name}.json")]
        result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
        outs = [tmp / f"{name}.out.json.rank{r}" for r in range(2)]
        # The results are written before the trainer closes, where Composer's FSDP on two CPU processes may crash.
        assert all(p.exists() for p in outs), f"{name}: rc {result.returncode}\n" + result.stdout[-3000:] + result.stderr[-5000:]
        for rank, p in enumerate(outs):
            results[rank].update(json.loads(p.read_text()))
    return results


@pytest.mark.timeout(700)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_select_ahead_under_two_rank_fsdp_trains_as_without_fsdp(two_rank_runs, strategy):
    for rank, res in enumerate(two_rank_runs):
        got, plain = res[strategy], res["without_fsdp"]
        assert got["wrappers"]["FullyShardedDataParallel"] >= 2, got["wrappers"]
        assert len(got["selection/selected_hash"]) == STEPS
        assert got["selection/selected_hash"] == plain["selection/selected_hash"], (rank, got, plain)
        assert got["loss/train/total"] == pytest.approx(plain["loss/train/total"], rel=1e-5), (rank, got, plain)
