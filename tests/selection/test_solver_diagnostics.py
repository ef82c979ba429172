"""PartitionSel's solver reports what it could not do: inexact refits before swaps, NaN Grams, singular pivots, ridge-dominated objectives."""

from __future__ import annotations

import logging

import pytest
import torch

from composer_algos.selection import SelectionNumericsError, refit_exact, select_partitionsel
from composer_algos.selection import partitionsel as partitionsel_module


def _problem(n: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, dim, generator=g, dtype=torch.float64)
    gbar = torch.randn(dim, generator=g, dtype=torch.float64)
    return feats, gbar, torch.arange(n) % 3


def _run(feats, gbar, dom, kappa, eta, **options):
    return select_partitionsel(
        features=feats,
        val_feature=gbar,
        domain_ids=dom,
        num_domains=3,
        kappa=kappa,
        eta=eta,
        generator=None,
        **options,
    )


@pytest.mark.parametrize("refit", ["apga", "apga_pool"])
def test_swap_after_apga_works_from_the_exact_optimum(refit):
    # One APGA iteration per pick leaves the weights far from optimal; the swap pass's closed forms
    # assume the exact optimum, and the returned weights must be the exact optimum on the final support.
    feats, gbar, dom = _problem(30, 12, seed=1)
    # Half the pool is zero rows: no swap gains anything, so without the exact re-solve the swap pass
    # would hand back APGA's weights (and objective) untouched.
    feats[15:] = 0.0
    eta = 0.05
    res = _run(feats, gbar, dom, 15, eta, refit=refit, apga_max_iters=1, refine="swap")
    K = feats @ feats.T
    mu = feats @ gbar + 0.5 * eta * torch.diagonal(K)
    ridge = 1e-6 * float(torch.diagonal(K).mean())
    S = res.indices
    v_exact = refit_exact(K[S][:, S], mu[S], ridge_abs=ridge)
    phi_exact = float(v_exact @ mu[S] - 0.5 * v_exact @ K[S][:, S] @ v_exact)
    assert float(res.info["objective_scaled"]) == pytest.approx(phi_exact, rel=1e-9)
    torch.testing.assert_close(res.weights * eta, v_exact, rtol=1e-6, atol=1e-9)
    # And the swap pass cannot end below the exact optimum of the OMP support it started from.
    start = _run(feats, gbar, dom, 15, eta, refit=refit, apga_max_iters=1)
    S0 = start.indices
    v0 = refit_exact(K[S0][:, S0], mu[S0], ridge_abs=ridge)
    assert phi_exact >= float(v0 @ mu[S0] - 0.5 * v0 @ K[S0][:, S0] @ v0) * (1 - 1e-12)


def test_nan_off_the_diagonal_of_a_given_gram_is_rejected():
    feats, gbar, dom = _problem(12, 5)
    gram = feats @ feats.T
    gram[2, 7] = gram[7, 2] = float("nan")
    with pytest.raises(SelectionNumericsError, match="gram"):
        _run(feats, gbar, dom, 4, 0.1, gram=gram)


def test_singular_pivots_are_counted():
    # Two feature dimensions, six picks, no ridge: from the third pick on, every candidate depends on
    # the active set, yet the diagonal bonus keeps its gradient positive.
    feats, gbar, dom = _problem(12, 2, seed=2)
    res = _run(feats, gbar, dom, 6, 1.0, ridge=0.0)
    assert res.indices.numel() == 6
    n_zero = int((res.weights == 0).sum())
    assert n_zero >= 3
    assert 1 <= int(res.info["singular_pivots"]) <= n_zero


def test_refit_exact_reports_blocked_coordinates():
    # a + b + c = 0 (exact integers): with any two in, the third's gradient is positive but its pivot
    # is zero (it factors with a pivot at rounding level: weights of 1e16 before the check).
    feats = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    gram = feats @ feats.T
    stats: dict = {}
    v = refit_exact(gram, torch.diagonal(gram).clone(), stats=stats)
    assert len(stats["blocked"]) == 1
    (b,) = stats["blocked"]
    assert v[b] == 0 and int((v > 0).sum()) == 2 and float(v.max()) < 10


def test_ridge_dominated_objective_warns_once_with_the_cause(caplog, monkeypatch):
    monkeypatch.setattr(partitionsel_module, "_RIDGE_WARNED", False)
    caplog.set_level(logging.WARNING, logger=partitionsel_module.__name__)
    feats, gbar, dom = _problem(12, 2, seed=2)
    for _ in range(2):
        res = _run(feats, gbar, dom, 6, 1.0)
        assert float(res.info["ridge_share"]) > 0.5
    msgs = [r.getMessage() for r in caplog.records if "ridge-dominated" in r.getMessage()]
    assert len(msgs) == 1
    assert "6 picks exceed the 2 feature dimensions" in msgs[0]


def test_well_conditioned_objective_does_not_warn(caplog, monkeypatch):
    monkeypatch.setattr(partitionsel_module, "_RIDGE_WARNED", False)
    caplog.set_level(logging.WARNING, logger=partitionsel_module.__name__)
    feats, gbar, dom = _problem(24, 32, seed=4)
    res = _run(feats, gbar, dom, 4, 1.0)
    assert float(res.info["ridge_share"]) < 1e-3
    assert not [r for r in caplog.records if "ridge-dominated" in r.getMessage()]


def test_kkt_reentry_that_promotes_to_float64_does_not_enter_an_element_twice():
    """Regression: a re-entry that triggered the float64 promotion re-entered an element the exact
    refit had just made active, giving it two slots (KeyError in _free_slot later; found at
    n=8192, kappa=4096 by tools/bench/bench_scaling.py, reproduced here with picks beyond the rank)."""
    from composer_algos.selection import select_partitionsel

    g = torch.Generator().manual_seed(33)
    n, D = 256, 16
    G = torch.randn(n, D, generator=g)
    gbar = torch.randn(D, generator=g)
    dom = torch.randint(0, 4, (n,), generator=g)
    for kappa in (64, 128):
        res = select_partitionsel(
            features=G, val_feature=gbar, domain_ids=dom, num_domains=4, kappa=kappa, eta=1e-3, generator=g
        )
        assert res.indices.numel() == kappa and res.indices.unique().numel() == kappa
        assert torch.isfinite(res.weights).all() and (res.weights >= 0).all()
