"""The four stages of a selection step, each alone: assemble (local and gathered), solve, redistribute, record.

Ranks are threads (tests/training/fake_ranks.py); every case runs in well under a second.
"""

from __future__ import annotations

import csv
import json
from types import SimpleNamespace

import pytest
import torch

from composer_algos.data_selection.mixture_monitor import MixtureMonitor
from composer_algos.data_selection.step import (
    SelectionProblem,
    assemble_problem,
    record_step,
    redistribute,
    selection_hash,
    selection_metrics,
    solve_problem,
)
from composer_algos.selection import STRATEGIES, SelectionNumericsError, SelectionResult, StrategySpec
from tests.training.fake_ranks import ListLogger, ThreadRanks

D = 4


def _rank_data(rank: int, n: int):
    g = torch.Generator().manual_seed(rank)
    return torch.arange(n) % 3, torch.randn(n, D, generator=g), torch.randn(D, generator=g)


def _batch(rank: int, n: int) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.arange(n)[:, None].repeat(1, 5) + 100 * rank,
        "attention_mask": torch.ones(n, 5, dtype=torch.long),
        "domain_id": torch.arange(n) % 3,
        "example_id": torch.arange(n) + 100 * rank,
    }


# ---------------------------------------------------------------- assemble


def test_assemble_local_caps_the_budget_at_the_pool_and_keeps_the_features():
    dom, feats, gbar = _rank_data(0, 5)
    p = assemble_problem(dom, kappa_rank=8, gather=False, needs_features=True, features_ND=feats, gbar_D=gbar)
    assert p.kappa == 5 and not p.gathered
    assert p.features_PD is feats and p.gbar_D is gbar
    failed = assemble_problem(dom, kappa_rank=2, gather=False, needs_features=True, fallback="bad features")
    assert failed.fallback == "bad features" and failed.features_PD is None and failed.gbar_D is None


def test_assemble_gathered_concatenates_uneven_pools_and_weights_gbar_by_validation_size(monkeypatch):
    sizes, n_vals = (3, 2), (1, 3)
    ranks = ThreadRanks(2)
    ranks.patch(monkeypatch)

    def body(rank):
        dom, feats, gbar = _rank_data(rank, sizes[rank])
        return assemble_problem(
            dom,
            kappa_rank=4,
            gather=True,
            needs_features=True,
            features_ND=feats,
            gbar_D=gbar,
            n_val=n_vals[rank],
        )

    p0, p1 = ranks.run(body)
    data = [_rank_data(r, sizes[r]) for r in range(2)]
    for p in (p0, p1):
        assert p.gathered and p.world == 2
        assert p.kappa == 2 * min(4, 5 // 2)  # 5 candidates: 2 per rank
        assert p.owner_P.tolist() == [0, 0, 0, 1, 1] and p.local_P.tolist() == [0, 1, 2, 0, 1]
        torch.testing.assert_close(p.features_PD, torch.cat([data[0][1], data[1][1]]))
        torch.testing.assert_close(p.gbar_D, (1 * data[0][2] + 3 * data[1][2]) / 4)


def test_assemble_gathered_falls_back_everywhere_when_one_rank_failed(monkeypatch):
    ranks = ThreadRanks(2)
    ranks.patch(monkeypatch)

    def body(rank):
        dom, feats, gbar = _rank_data(rank, 4)
        reason = "nan features" if rank == 1 else None
        return assemble_problem(
            dom,
            kappa_rank=2,
            gather=True,
            needs_features=True,
            features_ND=feats,
            gbar_D=gbar,
            fallback=reason,
        )

    p0, p1 = ranks.run(body)
    assert p0.fallback == "the gradient features failed on another rank" and p1.fallback == "nan features"
    assert p0.features_PD is None and p1.features_PD is None


def test_assemble_applies_the_average_to_the_gathered_gbar_only(monkeypatch):
    dom, feats, gbar = _rank_data(0, 4)
    calls = []
    p = assemble_problem(
        dom,
        kappa_rank=2,
        gather=False,
        needs_features=True,
        features_ND=feats,
        gbar_D=gbar,
        average_gbar=lambda g: calls.append(g) or 2 * g,
    )
    torch.testing.assert_close(p.gbar_D, 2 * gbar)
    assemble_problem(
        dom, kappa_rank=2, gather=False, needs_features=True, fallback="x", average_gbar=calls.append
    )
    assert len(calls) == 1  # a failed step does not advance the average


# ---------------------------------------------------------------- solve


def _problem(n=9, kappa=3) -> SelectionProblem:
    dom, feats, gbar = _rank_data(0, n)
    return SelectionProblem(dom, kappa, feats.double(), gbar.double())


def test_solve_runs_the_strategy_with_its_options():
    out = solve_problem(
        _problem(), "partitionsel", eta=1e-3, seed=1, num_domains=3, options={"refit": "exact"}
    )
    assert out.strategy == "partitionsel" and out.fallback is None
    assert out.result.indices.numel() == 3
    with pytest.raises(ValueError, match="bogus"):
        solve_problem(_problem(), "partitionsel", eta=1e-3, seed=1, num_domains=3, options={"bogus": 1})


def test_solve_falls_back_within_capacities_when_the_strategy_breaks(monkeypatch):
    def broken(**kwargs):
        raise SelectionNumericsError("singular")

    monkeypatch.setitem(STRATEGIES, "partitionsel", StrategySpec(broken, True, True, True))
    out = solve_problem(_problem(), "partitionsel", eta=1e-3, seed=1, num_domains=3)
    assert out.strategy == "random_stratified" and "singular" in out.fallback
    assert out.result.indices.numel() == 3
    # Same seed, same fallback draw: the re-solve uses a fresh generator of the step's seed.
    again = solve_problem(_problem(), "partitionsel", eta=1e-3, seed=1, num_domains=3)
    assert torch.equal(out.result.indices, again.result.indices)


def test_solve_of_a_failed_problem_selects_at_random_within_capacities():
    p = _problem()
    p.fallback, p.features_PD, p.gbar_D = "nan features", None, None
    out = solve_problem(p, "partitionsel", eta=1e-3, seed=2, num_domains=3, options={"refit": "exact"})
    assert out.strategy == "random_stratified" and out.fallback == "nan features"
    assert torch.bincount(p.domain_P[out.result.indices], minlength=3).tolist() == [1, 1, 1]


# ---------------------------------------------------------------- redistribute


def test_redistribute_locally_subsets_every_per_example_field():
    batch = _batch(0, 6)
    batch["names"] = [f"x{i}" for i in range(6)]
    p = SelectionProblem(batch["domain_id"], 2)
    result = SelectionResult(
        indices=torch.tensor([4, 1]), domain_counts=torch.tensor([0, 2, 0]), weights=torch.tensor([3.0, 1.0])
    )
    out = redistribute(batch, p, result, weighted_loss=True)
    assert out["example_id"].tolist() == [4, 1] and out["names"] == ["x4", "x1"]
    assert out["loss_weight"].tolist() == [1.5, 0.5]  # w / mean(w)


def test_redistribute_gathered_gives_each_rank_its_share_of_the_selection(monkeypatch):
    ranks = ThreadRanks(2)
    ranks.patch(monkeypatch)
    # Global rows 0..3 live on rank 0, 4..7 on rank 1; rank 0 holds three of the four picks.
    selected = torch.tensor([0, 2, 3, 5])

    def body(rank):
        batch = _batch(rank, 4)
        p = SelectionProblem(
            torch.arange(8) % 3,
            4,
            owner_P=torch.tensor([0] * 4 + [1] * 4),
            local_P=torch.arange(4).repeat(2),
            world=2,
        )
        return redistribute(
            batch, p, SelectionResult(indices=selected, domain_counts=torch.bincount(selected % 3))
        )

    b0, b1 = ranks.run(body)
    assert b0["example_id"].shape[0] == b1["example_id"].shape[0] == 2
    assert sorted(b0["example_id"].tolist() + b1["example_id"].tolist()) == [0, 2, 3, 101]
    assert b1["example_id"].tolist()[0] == 101  # kept where it was, the overflow moved to rank 1


# ---------------------------------------------------------------- record


def test_record_logs_metrics_and_traces_and_the_monitor_writes_them(tmp_path):
    result = SelectionResult(
        indices=torch.tensor([2, 0]), domain_counts=torch.tensor([1, 0, 1]), objective=torch.tensor(0.25)
    )
    new_batch = {"domain_id": torch.tensor([2, 0]), "attention_mask": torch.ones(2, 3)}
    metrics = selection_metrics(
        result,
        features_PD=torch.eye(3),
        new_batch=new_batch,
        domain_key="domain_id",
        fallback=False,
        fallbacks_total=0,
        times_s=(0.5, 0.25, 0.125),
    )
    assert metrics["selection/selected_hash"] == float(selection_hash(torch.tensor([0, 2])))
    assert metrics["selection/kept_tokens"] == 6.0 and metrics["selection/objective"] == 0.25

    monitor = MixtureMonitor(domain_names=["a", "b", "c"], run_dir=str(tmp_path))
    logger = ListLogger()
    logger.destinations = (monitor,)
    logger.log_metrics = lambda m, step=None: [d.log_metrics(m, step) for d in logger.destinations]
    logger.log_traces = lambda t: [d.log_traces(t) for d in logger.destinations]
    record_step(
        logger,
        method="partitionsel",
        strategy="partitionsel",
        pool_counts_C=torch.tensor([1, 1, 2]),
        metrics=metrics,
    )
    state = SimpleNamespace(
        batch=new_batch, timestamp=SimpleNamespace(batch=SimpleNamespace(value=0)), run_name="r"
    )
    monitor.after_dataloader(state, logger)
    monitor.fit_end(state, logger)
    with open(tmp_path / "selection_log.csv", newline="") as f:
        row = next(r for r in csv.DictReader(f))
    assert row["strategy"] == "partitionsel" and float(row["objective"]) == 0.25
    assert (
        float(row["time_solve_s"]) == 0.25
        and float(row["selected_hash"]) == metrics["selection/selected_hash"]
    )
    assert [float(row[f"pool/{c}"]) for c in "abc"] == [0.25, 0.25, 0.5]  # from the logged pool counts
    assert [float(row[f"mixture/{c}"]) for c in "abc"] == [0.5, 0.0, 0.5]
    mix = json.loads((tmp_path / "mixture.json").read_text())
    assert mix["method"] == "partitionsel"  # from the logged trace, not from the algorithm object
