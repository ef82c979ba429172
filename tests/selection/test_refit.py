"""Refits: exact NNLS and both APGAs against brute force and loop references; the incremental OMP states."""

from __future__ import annotations

import pytest
import torch

from composer_algos.selection import GramRows, omp_select, refit_apga, refit_exact
from composer_algos.selection.apga import LIPSCHITZ_SAFETY, estimate_spectral_norm
from composer_algos.selection.objective import build_objective
from tests.selection.reference import (
    brute_force_refit,
    make_instance,
    objective_terms,
    omp_apga_pool_loop,
    omp_greedy_loop,
)

ETA = 0.5


def _support_instance(seed, n, k, flip):
    """A random instance and a random support; `flip` makes some alignments negative (zero weights)."""
    features, val_feature, _ = make_instance(seed, n)
    if flip:
        val_feature = -0.5 * val_feature + 0.3 * features[0]
    gram, mu = objective_terms(features, val_feature, ETA)
    gen = torch.Generator().manual_seed(1000 + seed)
    support = torch.randperm(n, generator=gen)[:k]
    return gram, mu, support


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_exact_refit_equals_brute_force(seed, flip):
    n = 12 + seed % 3
    k = 3 + seed % 3
    gram, mu, support = _support_instance(seed, n, k, flip)
    phi_ref, v_ref = brute_force_refit(gram, mu, support.tolist())
    v = refit_exact(gram[support][:, support], mu[support])
    phi = float(v @ mu[support] - 0.5 * v @ gram[support][:, support] @ v)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-8)
    assert abs(phi - phi_ref) <= 1e-8 * max(1.0, abs(phi_ref))


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_apga_to_tolerance_agrees_with_exact(seed, flip):
    gram, mu, support = _support_instance(seed, 14, 5, flip)
    g_ss, mu_s = gram[support][:, support], mu[support]
    v_exact = refit_exact(g_ss, mu_s)
    v_apga = refit_apga(g_ss, mu_s, max_iters=20000, tol=0.0)
    phi = lambda v: float(v @ mu_s - 0.5 * v @ g_ss @ v)  # noqa: E731
    torch.testing.assert_close(v_apga, v_exact, rtol=0, atol=1e-7)
    assert abs(phi(v_apga) - phi(v_exact)) <= 1e-10 * abs(phi(v_exact))
    # With a tolerance it stops early but still close in objective.
    v_tol = refit_apga(g_ss, mu_s, max_iters=20000, tol=1e-12)
    assert abs(phi(v_tol) - phi(v_exact)) <= 1e-8 * abs(phi(v_exact))


@pytest.mark.parametrize("seed", range(5))
def test_exact_refit_warm_start_does_not_change_the_optimum(seed):
    gram, mu, support = _support_instance(seed, 14, 5, True)
    g_ss, mu_s = gram[support][:, support], mu[support]
    cold = refit_exact(g_ss, mu_s)
    gen = torch.Generator().manual_seed(seed)
    warm = refit_exact(g_ss, mu_s, v0_S=torch.rand(5, generator=gen, dtype=torch.float64))
    torch.testing.assert_close(warm, cold, rtol=0, atol=1e-12)


def test_ridge_makes_duplicates_and_antipodes_well_posed():
    # g, g (duplicate) and -g: K is singular, and with eta > 0 the direction (1, 0, 1) would make
    # Phi grow without bound (G^T d = 0, <d, diag K> > 0). The ridge keeps the refit finite.
    g = torch.tensor([[1.0, 2.0], [1.0, 2.0], [-1.0, -2.0]], dtype=torch.float64)
    gbar = torch.tensor([0.5, 0.1], dtype=torch.float64)
    gram, mu, _ = build_objective(g, gbar, eta=0.5)
    ridge = 1e-3
    v = refit_exact(gram, mu, ridge_abs=ridge)
    assert bool(torch.isfinite(v).all()) and bool((v >= 0).all())
    grad = mu - (gram + ridge * torch.eye(3, dtype=torch.float64)) @ v
    assert bool((grad[v > 0].abs() <= 1e-9).all()) and bool((grad[v == 0] <= 1e-9).all())
    phi_ref, _ = brute_force_refit(gram, mu, [0, 1, 2], ridge=ridge)
    phi = float(v @ mu - 0.5 * v @ (gram + ridge * torch.eye(3, dtype=torch.float64)) @ v)
    assert abs(phi - phi_ref) <= 1e-10 * phi_ref


def test_exact_refit_without_ridge_leaves_dependent_column_at_zero():
    # Two identical rows at ridge 0: the second is linearly dependent; the value is still optimal.
    g = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    gbar = torch.tensor([1.0, 0.5], dtype=torch.float64)
    gram, mu, _ = build_objective(g, gbar, eta=0.0)
    v = refit_exact(gram, mu)
    phi = float(v @ mu - 0.5 * v @ gram @ v)
    # The optimum of min ||G^T v - gbar||^2 / 2 reproduces gbar exactly: Phi = ||gbar||^2 / 2.
    assert abs(phi - 0.5 * float(gbar @ gbar)) <= 1e-12
    assert bool((v >= 0).all())


# A 3-D instance where OMP's third pick drives the second pick's weight to zero, so the
# incremental state must take a Lawson–Hanson step and drop it (found by a seeded search).
_DROP_G = [
    [0.8, 1.4, 0.5],
    [-0.6, 1.7, -1.3],
    [2.2, 0.3, -0.9],
    [0.5, 0.3, 0.0],
    [0.8, 0.5, -0.4],
    [-0.4, 1.2, 0.2],
]
_DROP_GBAR = [0.5, 0.6, 0.3]


def test_incremental_state_drops_a_weight_that_reaches_zero():
    features = torch.tensor(_DROP_G, dtype=torch.float64)
    gram, mu, _ = build_objective(features, torch.tensor(_DROP_GBAR, dtype=torch.float64), eta=0.0)
    dom = torch.zeros(6, dtype=torch.long)
    sel, v, phi, info = omp_select(gram, mu, dom, torch.tensor([3]), 3)
    assert int(info["weight_drops"]) >= 1 and int(info["slow_refits"]) == 0
    assert bool((v == 0).any()), "the dropped element keeps weight 0"
    phi_ref, v_ref = brute_force_refit(gram, mu, sel.tolist())
    torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-12)
    assert abs(float(phi) - phi_ref) <= 1e-12


@pytest.mark.parametrize("dim", [3, 8, 64])
@pytest.mark.parametrize("seed", range(4))
def test_incremental_state_matches_refit_exact_on_final_support(seed, dim):
    # Small D makes weight drops (the slow path) frequent; large D makes them rare. With 12 > D
    # selected, K_SS is singular and Phi can be unbounded, so a ridge is needed (the default one).
    features, val_feature, dom = make_instance(seed, 40, dim=dim, num_domains=3)
    val_feature = val_feature - 0.5 * features[seed]
    gram, mu, _ = build_objective(features, val_feature, eta=ETA)
    ridge = 1e-6 * float(gram.diagonal().mean())
    caps = torch.bincount(dom, minlength=3)
    sel, v, phi, info = omp_select(gram, mu, dom, caps, 12, ridge_abs=ridge)
    g_ss = gram[sel][:, sel]
    v_ref = refit_exact(g_ss, mu[sel], ridge_abs=ridge)
    torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-8 * float(v_ref.abs().max()))
    phi_ref = float(v_ref @ mu[sel] - 0.5 * v_ref @ g_ss @ v_ref)
    assert abs(float(phi) - phi_ref) <= 1e-9 * abs(phi_ref)
    # KKT of the ridge problem: zero gradient on the positive weights, non-positive elsewhere.
    grad = mu[sel] - (g_ss + ridge * torch.eye(12, dtype=torch.float64)) @ v
    scale = float(mu.abs().max())
    assert bool((grad[v > 0].abs() <= 1e-8 * scale).all()) and bool((grad[v == 0] <= 1e-8 * scale).all())


def test_apga_omp_state_tracks_exact_with_enough_iterations():
    features, val_feature, dom = make_instance(3, 30)
    gram, mu, _ = build_objective(features, val_feature, eta=ETA)
    caps = torch.tensor([4, 4, 4])
    sel, v, phi, info = omp_select(gram, mu, dom, caps, 10, refit="apga", apga_max_iters=3000)
    v_ref = refit_exact(gram[sel][:, sel], mu[sel])
    torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-6)
    assert int(info["apga_iterations"]) == 10 * 3000


@pytest.mark.parametrize("refit", ["apga", "apga_pool"])
def test_apga_omp_states_reach_the_exact_optimum_when_run_to_tolerance(refit):
    features, val_feature, dom = make_instance(5, 30)
    gram, mu, _ = build_objective(features, val_feature, eta=ETA)
    caps = torch.tensor([4, 4, 4])
    sel, v, phi, info = omp_select(gram, mu, dom, caps, 10, refit=refit, apga_max_iters=5000)
    # The same pick sequence as the exact refit, and the exact NNLS optimum on the support.
    sel_exact, v_exact, phi_exact, _ = omp_select(gram, mu, dom, caps, 10)
    assert sel.tolist() == sel_exact.tolist()
    phi_ref, v_ref = brute_force_refit(gram, mu, sel.tolist())
    torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-9)
    assert abs(float(phi) - phi_ref) <= 1e-12 * phi_ref
    # With a tolerance it stops early, still at the optimum in objective.
    sel_t, _, phi_t, info_t = omp_select(gram, mu, dom, caps, 10, refit=refit, apga_max_iters=5000, apga_tol=1e-13)
    assert sel_t.tolist() == sel_exact.tolist()
    assert abs(float(phi_t) - phi_ref) <= 1e-10 * phi_ref
    assert int(info_t["apga_iterations"]) < 10 * 5000


@pytest.mark.parametrize("ridge", [0.0, 1e-3])
@pytest.mark.parametrize("seed", range(3))
def test_apga_pool_matches_the_loop_alg3_on_the_full_pool_vector(seed, ridge):
    # Few iterations, so the iterates are far from converged and every detail of Alg. 3 counts:
    # momentum, projection onto the support, warm start, the step from ||K + ridge I||.
    features, val_feature, dom = make_instance(seed, 10, num_domains=2)
    gram, mu, _ = build_objective(features, val_feature, eta=ETA)
    caps = torch.tensor([2, 2])
    lip = float(estimate_spectral_norm(gram + ridge * torch.eye(10, dtype=torch.float64)))
    ref_sel, ref_w = omp_apga_pool_loop(gram, mu, dom, caps, 4, lip, iters=5, ridge=ridge)
    sel, v, phi, info = omp_select(gram, mu, dom, caps, 4, refit="apga_pool", apga_max_iters=5, ridge_abs=ridge)
    assert sel.tolist() == ref_sel
    ref_v = torch.tensor([ref_w[i] for i in ref_sel], dtype=torch.float64)
    torch.testing.assert_close(v, ref_v, rtol=1e-12, atol=1e-14)
    assert int(info["apga_iterations"]) == 4 * 5


@pytest.mark.parametrize("seed", range(3))
def test_spectral_norm_estimate_is_an_inflated_norm(seed):
    features, _, _ = make_instance(seed, 40)
    gram = features @ features.T
    true = float(torch.linalg.eigvalsh(gram)[-1])
    est = float(estimate_spectral_norm(gram))
    assert true <= est <= LIPSCHITZ_SAFETY * true * (1 + 1e-12)


def test_lazy_gram_rows_equal_the_gram_and_prefetch_by_priority():
    features, _, _ = make_instance(0, 20, dim=8)
    gram = features @ features.T
    rows = GramRows(features_ND=features, batch_rows=6)
    assert rows.lazy and not rows.has(3)
    torch.testing.assert_close(rows.diag_N, torch.diagonal(gram), rtol=1e-12, atol=0)
    priority = torch.full((20,), float("-inf"), dtype=torch.float64)
    priority[[5, 7, 11, 3]] = torch.tensor([1.0, 3.0, 2.0, 10.0], dtype=torch.float64)
    rows.ensure([3], priority)
    # Row 3 (requested; its high priority must not count twice), then every finite priority;
    # the batch has room for 5 more, but -inf elements never come along.
    assert [i for i in range(20) if rows.has(i)] == [3, 5, 7, 11]
    assert rows.rows_computed == 4 and rows.batches == 1
    for i in (3, 5, 7, 11):
        torch.testing.assert_close(rows.gram_NN[i], gram[i], rtol=1e-12, atol=1e-14)
    rows.ensure([7, 11], priority)  # already there: no work
    assert rows.rows_computed == 4 and rows.batches == 1
    small = GramRows(features_ND=features, batch_rows=2)
    small.ensure([0], priority)
    assert [i for i in range(20) if small.has(i)] == [0, 3], "the single best priority fills the batch"
    torch.testing.assert_close(rows.full(), gram, rtol=1e-12, atol=1e-14)
    assert all(rows.has(i) for i in range(20))
    assert not GramRows(gram_NN=gram).lazy


@pytest.mark.parametrize("dim", [3, 4, 6])
@pytest.mark.parametrize("seed", range(8))
def test_incremental_drops_and_reentries_match_the_loop_omp(seed, dim):
    # Small D with 7 picks: weights reach zero (Lawson–Hanson drops) and dropped elements come back
    # (re-entries) in most of these instances; every round must still be the exact NNLS optimum,
    # so the pick sequence and the final weights equal greedy OMP with a brute-force refit.
    features, val_feature, dom = make_instance(seed, 12, dim=dim, num_domains=2)
    val_feature = val_feature - 0.5 * features[seed]
    gram, mu, _ = build_objective(features, val_feature, eta=ETA)
    caps = torch.bincount(dom, minlength=2)
    ridge = 1e-3
    ref_sel, ref_v = omp_greedy_loop(gram, mu, dom, caps, 7, ridge=ridge)
    sel, v, phi, info = omp_select(gram, mu, dom, caps, 7, ridge_abs=ridge)
    assert sel.tolist() == ref_sel
    torch.testing.assert_close(v, torch.tensor(ref_v, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    assert int(info["slow_refits"]) == 0


@pytest.mark.parametrize("seed", range(3))
def test_float32_ill_conditioned_selection_moves_to_float64_and_stays_exact(seed):
    # More picks than feature dimensions: K_SS is singular up to the ridge (cond ~ 1e6), beyond what
    # float32 rank-one inverse updates can carry. The state switches to float64 once, and the result
    # is the exact NNLS optimum of the float32 problem on its support.
    features, val_feature, dom = make_instance(seed, 120, dim=8, num_domains=3, dtype=torch.float32)
    gram, mu, _ = build_objective(features, val_feature, eta=ETA)
    ridge = 1e-6 * float(gram.diagonal().mean())
    caps = torch.bincount(dom, minlength=3)
    sel, v, phi, info = omp_select(gram, mu, dom, caps, 30, ridge_abs=ridge)
    assert v.dtype == torch.float32 and phi.dtype == torch.float32
    assert int(info["slow_refits"]) == 1, "one refit at the switch, no thrashing after it"
    g64, mu64 = gram.double()[sel][:, sel], mu.double()[sel]
    v_ref = refit_exact(g64, mu64, ridge_abs=ridge)
    phi_ref = float(v_ref @ mu64 - 0.5 * v_ref @ g64 @ v_ref)
    assert abs(float(phi) - phi_ref) <= 1e-5 * abs(phi_ref)
