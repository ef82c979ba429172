"""Identical selections by construction under global scope: rank 0's picks are broadcast (issue 12.4).

Ranks are threads (tests/training/fake_ranks.py); every case runs in well under a second.
"""

from __future__ import annotations

import pytest
import torch

import composer_algos.data_selection.step as selection_step
from composer_algos.data_selection.algorithm import DataSelection
from composer_algos.data_selection.step import SelectionProblem, solve_problem
from composer_algos.selection import SelectionResult
from tests.training.fake_ranks import ThreadRanks

D = 4


def _gathered_problem(feats_PD: torch.Tensor) -> SelectionProblem:
    P = feats_PD.shape[0]
    return SelectionProblem(
        torch.arange(P) % 3,
        4,
        feats_PD,
        feats_PD.mean(dim=0),
        owner_P=torch.arange(2).repeat_interleave(P // 2),
        local_P=torch.arange(P // 2).repeat(2),
        world=2,
    )


def test_every_rank_takes_rank_0s_indices_weights_and_objective(monkeypatch):
    ranks = ThreadRanks(2)
    ranks.patch(monkeypatch)
    real = selection_step._run_strategy

    def diverging(spec, strategy, problem, *args):
        # A replicated solve that differs on rank 1 (another GPU, a nondeterministic kernel).
        result, error = real(spec, strategy, problem, *args)
        if ranks.rank() == 1:
            result = SelectionResult(
                indices=torch.tensor([0, 1, 2, 3]),
                domain_counts=torch.tensor([2, 1, 1]),
                weights=torch.full((4,), 7.0, dtype=result.weights.dtype),
                objective=torch.tensor(-1.0, dtype=result.objective.dtype),
            )
        return result, error

    monkeypatch.setattr(selection_step, "_run_strategy", diverging)
    feats = torch.randn(8, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)

    def body(rank):
        return solve_problem(_gathered_problem(feats), "partitionsel", eta=1e-3, seed=3, num_domains=3).result

    r0, r1 = ranks.run(body)
    assert r0.indices.tolist() != [0, 1, 2, 3], "the test needs rank 0's own solve to differ from rank 1's"
    assert torch.equal(r1.indices, r0.indices) and r1.indices.dtype == torch.int64
    torch.testing.assert_close(r1.weights, r0.weights, rtol=0, atol=0)
    torch.testing.assert_close(r1.objective, r0.objective, rtol=0, atol=0)
    assert torch.equal(r1.domain_counts, r0.domain_counts)
    assert torch.equal(r0.domain_counts, torch.bincount((torch.arange(8) % 3)[r0.indices], minlength=3))


def test_strategies_without_weights_broadcast_indices_only(monkeypatch):
    ranks = ThreadRanks(2)
    ranks.patch(monkeypatch)
    real = selection_step._run_strategy

    def diverging(spec, strategy, problem, *args):
        result, error = real(spec, strategy, problem, *args)
        if ranks.rank() == 1:
            result = SelectionResult(
                indices=torch.tensor([4, 5, 6, 7]), domain_counts=torch.tensor([1, 2, 1])
            )
        return result, error

    monkeypatch.setattr(selection_step, "_run_strategy", diverging)
    feats = torch.randn(8, D, generator=torch.Generator().manual_seed(1))

    def body(rank):
        return solve_problem(_gathered_problem(feats), "random", eta=1e-3, seed=5, num_domains=3).result

    r0, r1 = ranks.run(body)
    assert r0.weights is None and r1.weights is None and r0.objective is None and r1.objective is None
    assert torch.equal(r1.indices, r0.indices) and r0.indices.tolist() != [4, 5, 6, 7]


def test_check_consistency_compares_the_gathered_problem_not_the_selection(monkeypatch):
    ranks = ThreadRanks(2)
    ranks.patch(monkeypatch)
    feats = torch.randn(8, D, generator=torch.Generator().manual_seed(2))

    def body(rank, differ):
        algo = DataSelection(scope="global", check_consistency=True, domain_names=["a", "b", "c"])
        mine = feats.clone()
        if differ and rank == 1:
            mine[3, 1] = torch.nextafter(mine[3, 1], torch.tensor(1e9))  # one ulp apart
        algo._check_same_problem(_gathered_problem(mine))

    ranks.run(lambda rank: body(rank, differ=False))
    with pytest.raises(RuntimeError, match="ranks assembled different selection problems"):
        ranks.run(lambda rank: body(rank, differ=True))
