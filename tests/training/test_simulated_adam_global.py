"""`adam_simulated` features under global scope: one filter state on every rank, advanced with the global pool."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_algos.data_selection.algorithm import DataSelection
from composer_algos.features.normalize import SimulatedAdam
from composer_algos.selection import STRATEGIES
from tests.common.models import tiny_llama
from tests.training.fake_ranks import FakeState, ListLogger, ThreadRanks

DOMAINS = ["a", "b", "c"]


def _rows(rank: int, n: int, width: int, layer: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * rank + layer)
    return torch.randn(n, width, generator=g, dtype=torch.float64) * (1 + rank)


def test_commit_global_gives_every_rank_the_state_of_the_union(monkeypatch):
    ranks = ThreadRanks(2)
    sizes = (3, 5)  # uneven pools: the mean is over all 8 rows, not a mean of the two means
    widths = {"l0": 4, "l1": 6}

    def body(rank):
        sim = SimulatedAdam((0.9, 0.99))
        sim.defer_commits = True
        for step in range(2):
            for i, (name, width) in enumerate(widths.items()):
                sim.accumulate(name, _rows(rank, sizes[rank], width, 10 * step + i))
            sim.commit()  # deferred: nothing moves until every rank agreed
            assert sim.count == step
            sim.commit_global(ranks.all_reduce)
        return sim

    out = ranks.run(body)
    ref = SimulatedAdam((0.9, 0.99))
    for step in range(2):
        for i, (name, width) in enumerate(widths.items()):
            ref.accumulate(name, torch.cat([_rows(r, sizes[r], width, 10 * step + i) for r in range(2)]))
        ref.commit()
    probe = torch.randn(2, widths["l1"], dtype=torch.float64)
    for sim in out:
        assert sim.count == ref.count == 2
        for name in widths:
            torch.testing.assert_close(sim._m[name], ref._m[name], rtol=1e-12, atol=0)
            torch.testing.assert_close(sim._v[name], ref._v[name], rtol=1e-12, atol=0)
        torch.testing.assert_close(sim.filter("l1", probe), ref.filter("l1", probe), rtol=1e-12, atol=0)


def _pool(rank: int, step: int, n: int = 6, T: int = 10) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, 128, (n, T), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones(n, T, dtype=torch.long),
        "labels": ids.clone(),
        "domain_id": torch.arange(n) % 3,
    }


def _algo() -> DataSelection:
    algo = DataSelection(
        strategy="gradnorm",
        scope="global",
        domain_names=DOMAINS,
        features={"normalization": "adam_simulated", "proj_dim": 16, "exact_max_numel": 0, "sketch_dim": 4},
    )
    algo.spec = STRATEGIES["gradnorm"]
    algo.kappa = 2
    return algo


def _states(algo: DataSelection) -> dict:
    return algo.state_dict()["extractor"]["simulated_adam"]


@pytest.mark.parametrize("resume_at", [None, 1])
def test_global_scope_filter_state_is_one_state_and_resumes_from_rank0(monkeypatch, resume_at):
    ranks = ThreadRanks(2)
    ranks.patch(monkeypatch)
    saved: dict[int, dict] = {}
    base = tiny_llama(seed=3)  # built here: seeding the global RNG from two threads would race

    def body(rank):
        model = copy.deepcopy(base)
        algo = _algo()
        hashes = []
        for step in range(3):
            if step == resume_at:
                # Composer writes rank 0's algorithm state; every rank loads it on resume.
                if rank == 0:
                    saved[0] = algo.state_dict()
                ranks.all_gather(torch.zeros(1))  # wait for rank 0's state
                algo = _algo()
                algo.load_state_dict(saved[0])
            state, logger = FakeState(_pool(rank, step), step=step, model=model), ListLogger()
            algo._select(state, logger)
            hashes.append(logger.metrics[-1]["selection/selected_hash"])
        return algo, hashes

    (a0, h0), (a1, h1) = ranks.run(body)
    s0, s1 = _states(a0), _states(a1)
    assert s0["count"] == s1["count"] == 3
    for key in ("m", "v"):
        assert set(s0[key]) == set(s1[key]) and s0[key]
        for name in s0[key]:
            torch.testing.assert_close(s0[key][name], s1[key][name], rtol=0, atol=0)
    assert h0 == h1
    if resume_at is not None:
        # Same selections and state as the uninterrupted run.
        monkeypatch.undo()
        ranks = ThreadRanks(2)
        ranks.patch(monkeypatch)
        saved.clear()
        resume_at = None
        (b0, g0), _ = ranks.run(body)
        assert g0 == h0
        for name in s0["m"]:
            torch.testing.assert_close(_states(b0)["m"][name], s0["m"][name], rtol=0, atol=0)
