"""PartitionSel: parity with a loop OMP, the randomized pick, weights/objective scale, eta = 0, swap, options."""

from __future__ import annotations

import pytest
import torch

from composer_algos.selection import compute_capacities, refit_exact, select_partitionsel
from composer_algos.selection.objective import build_objective
from composer_algos.selection.partitionsel import _randomized_pick
from composer_algos.selection.swap import estimate_swap_gains
from tests.selection.reference import (
    brute_force_refit,
    make_instance,
    objective_terms,
    omp_greedy_loop,
    unconstrained_phi,
)

ETA = 0.5


def _run(features, val_feature, dom, num_domains, kappa, eta=ETA, **options):
    return select_partitionsel(
        features=features,
        val_feature=val_feature,
        domain_ids=dom,
        num_domains=num_domains,
        kappa=kappa,
        eta=eta,
        generator=None,
        **options,
    )


@pytest.mark.parametrize("seed", range(10))
def test_greedy_exact_matches_loop_reference(seed):
    features, val_feature, dom = make_instance(seed, 14, num_domains=3)
    gram, mu = objective_terms(features, val_feature, ETA)
    caps = compute_capacities(torch.bincount(dom, minlength=3), 5)
    ref_sel, ref_v = omp_greedy_loop(gram, mu, dom, caps, 5)
    res = _run(features, val_feature, dom, 3, 5, ridge=0.0)
    assert res.indices.tolist() == sorted(ref_sel)
    order = {int(i): p for p, i in enumerate(ref_sel)}
    ref_w = torch.tensor([ref_v[order[int(i)]] for i in res.indices], dtype=torch.float64) / ETA
    torch.testing.assert_close(res.weights, ref_w, rtol=0, atol=1e-10)


@pytest.mark.parametrize("seed", range(4))
def test_weights_and_objective_are_in_the_w_variable(seed):
    features, val_feature, dom = make_instance(seed, 30)
    res = _run(features, val_feature, dom, 3, 8, ridge=0.0)
    gram, mu, _ = build_objective(features, val_feature, ETA)
    w = res.weights
    sel = res.indices
    u_of_w = float(w @ mu[sel] - 0.5 * ETA * w @ gram[sel][:, sel] @ w)
    assert abs(float(res.objective) - u_of_w) <= 1e-12 * abs(u_of_w)
    phi_ref, v_ref = brute_force_refit(gram, mu, sel.tolist())
    torch.testing.assert_close(w * ETA, v_ref, rtol=0, atol=1e-10)
    assert abs(float(res.info["objective_scaled"]) - phi_ref) <= 1e-10 * phi_ref
    assert "scale_free" not in res.info


def test_eta_zero_reports_scale_free_weights():
    features, val_feature, dom = make_instance(0, 30)
    res = _run(features, val_feature, dom, 3, 6, eta=0.0, ridge=0.0)
    assert bool(res.info["scale_free"])
    gram, mu, _ = build_objective(features, val_feature, 0.0)
    phi_ref, v_ref = brute_force_refit(gram, mu, res.indices.tolist())
    torch.testing.assert_close(res.weights, v_ref, rtol=0, atol=1e-10)
    assert abs(float(res.objective) - phi_ref) <= 1e-10 * phi_ref


@pytest.mark.parametrize("seed", range(3))
def test_eta_zero_selection_depends_on_the_data(seed):
    # Permuting the pool permutes the selection: nothing is picked by position.
    features, val_feature, dom = make_instance(seed, 40, num_domains=4)
    res = _run(features, val_feature, dom, 4, 10, eta=0.0)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(seed))
    res_p = _run(features[perm], val_feature, dom[perm], 4, 10, eta=0.0)
    assert sorted(perm[res_p.indices].tolist()) == res.indices.tolist()
    torch.testing.assert_close(res_p.objective, res.objective)
    assert res.indices.tolist() != list(range(10))


def test_randomized_pick_is_uniform_over_the_max_weight_base():
    gen = torch.Generator().manual_seed(0)
    n, num_domains = 30, 4
    dom = torch.randint(0, num_domains, (n,), generator=gen)
    grad = torch.randn(n, generator=gen, dtype=torch.float64)
    avail = torch.rand(n, generator=gen) > 0.3
    avail_counts = torch.bincount(dom[avail], minlength=num_domains)
    rem = torch.minimum(torch.tensor([2, 0, 3, 1]), avail_counts)
    # Loop reference: the rem_c available elements of largest max(0, grad) in each domain.
    base = set()
    for c in range(num_domains):
        members = [i for i in range(n) if int(dom[i]) == c and bool(avail[i])]
        members.sort(key=lambda i: (-max(0.0, float(grad[i])), i))
        base.update(members[: int(rem[c])])
    counts = torch.bincount(dom, minlength=num_domains)
    starts = torch.cumsum(counts, 0) - counts
    positions = torch.arange(n)
    j_greedy = torch.where(avail, grad, torch.tensor(float("-inf"), dtype=torch.float64)).argmax()
    size = len(base)
    picks = [
        int(_randomized_pick(grad, avail, dom, rem, starts, positions, torch.tensor((t + 0.5) / size, dtype=torch.float64), j_greedy))
        for t in range(size)
    ]
    assert sorted(picks) == sorted(base), "a grid of uniforms hits every base element exactly once"


def test_randomized_pick_falls_back_to_largest_gradient():
    n = 6
    dom = torch.zeros(n, dtype=torch.long)
    grad = torch.tensor([-3.0, -1.0, -2.0, -0.5, -4.0, 5.0], dtype=torch.float64)
    avail = torch.tensor([True, True, True, True, True, False])
    j_greedy = torch.tensor(3)
    pick = _randomized_pick(grad, avail, dom, torch.tensor([2]), torch.tensor([0]), torch.arange(n), torch.tensor(0.01, dtype=torch.float64), j_greedy)
    assert int(pick) == 3


def test_budget_is_filled_when_no_gradient_is_positive():
    features, val_feature, dom = make_instance(1, 20)
    # Positive features against a negative validation feature: every gradient is negative at eta = 0.
    res = _run(features.abs(), -torch.ones(32, dtype=torch.float64), dom, 3, 6, eta=0.0)
    assert res.indices.numel() == 6
    assert float(res.objective) == 0.0 and bool((res.weights == 0).all())


def test_randomized_pick_is_deterministic_and_uses_the_generator():
    features, val_feature, dom = make_instance(2, 60, num_domains=4)
    kw = dict(features=features, val_feature=val_feature, domain_ids=dom, num_domains=4, kappa=15, eta=ETA, pick="randomized")
    a = select_partitionsel(generator=torch.Generator().manual_seed(5), **kw)
    b = select_partitionsel(generator=torch.Generator().manual_seed(5), **kw)
    assert a.indices.tolist() == b.indices.tolist()
    others = {tuple(select_partitionsel(generator=torch.Generator().manual_seed(s), **kw).indices.tolist()) for s in range(6)}
    assert len(others) > 1
    caps = compute_capacities(torch.bincount(dom, minlength=4), 15)
    assert bool((a.domain_counts <= caps).all()) and int(a.domain_counts.sum()) == 15


def test_greedy_does_not_consume_the_generator():
    features, val_feature, dom = make_instance(0, 30)
    gen = torch.Generator().manual_seed(7)
    before = gen.get_state().clone()
    for refine in (None, "swap"):
        select_partitionsel(features=features, val_feature=val_feature, domain_ids=dom, num_domains=3, kappa=8, eta=ETA, generator=gen, refine=refine)
    assert torch.equal(gen.get_state(), before)


@pytest.mark.parametrize("refit", ["apga", "apga_pool"])
@pytest.mark.parametrize("seed", range(3))
def test_apga_refit_reaches_the_exact_objective_on_its_support(seed, refit):
    features, val_feature, dom = make_instance(seed, 40)
    res = _run(features, val_feature, dom, 3, 10, refit=refit, apga_max_iters=2000, ridge=0.0)
    gram, mu, _ = build_objective(features, val_feature, ETA)
    phi_ref, _ = brute_force_refit(gram, mu, res.indices.tolist())
    assert abs(float(res.info["objective_scaled"]) - phi_ref) <= 1e-7 * phi_ref
    exact = _run(features, val_feature, dom, 3, 10, ridge=0.0)
    assert float(exact.objective) >= float(res.objective) * (1 - 1e-7)


@pytest.mark.parametrize("refit", ["apga", "apga_pool"])
def test_apga_tolerance_stops_early(refit):
    features, val_feature, dom = make_instance(0, 40)
    full = _run(features, val_feature, dom, 3, 10, refit=refit, apga_max_iters=500, apga_tol=0.0)
    early = _run(features, val_feature, dom, 3, 10, refit=refit, apga_max_iters=500, apga_tol=1e-6)
    assert int(full.info["apga_iterations"]) == 10 * 500
    assert int(early.info["apga_iterations"]) < 10 * 500


@pytest.mark.parametrize("seed", range(6))
def test_swap_never_lowers_f_and_keeps_domain_counts(seed):
    features, val_feature, dom = make_instance(seed, 40, num_domains=4)
    base = _run(features, val_feature, dom, 4, 10)
    swapped = _run(features, val_feature, dom, 4, 10, refine="swap")
    assert float(swapped.objective) >= float(base.objective) * (1 - 1e-12)
    assert swapped.domain_counts.tolist() == base.domain_counts.tolist()
    assert abs(float(swapped.info["objective_before_refine"]) - float(base.objective)) <= 1e-9 * abs(float(base.objective))
    assert int(swapped.info["swap_rounds"]) >= 1


@pytest.mark.parametrize("seed", range(5))
def test_swap_ends_in_a_local_optimum_when_every_candidate_is_checked(seed):
    features, val_feature, dom = make_instance(seed, 13, num_domains=3)
    res = _run(features, val_feature, dom, 3, 5, refine="swap", swap_max_checks=1000, swap_max_rounds=100, ridge=0.0)
    gram, mu, _ = build_objective(features, val_feature, ETA)
    sel = res.indices.tolist()
    phi, _ = brute_force_refit(gram, mu, sel)
    for pos, i in enumerate(sel):
        for j in range(13):
            if j in sel or int(dom[j]) != int(dom[i]):
                continue
            cand = sel[:pos] + [j] + sel[pos + 1 :]
            phi_c, _ = brute_force_refit(gram, mu, cand)
            assert phi_c <= phi * (1 + 1e-9), f"swap {i}->{j} improves {phi} to {phi_c}"


@pytest.mark.parametrize("ridge", [0.0, 1e-3])
def test_swap_gain_estimates_match_unconstrained_refits(ridge):
    # The support has one zero weight, so both branches are checked: removing a positive-weight
    # element (then refitting A - i + j) and removing a zero-weight one (refitting A + j).
    features, val_feature, dom = make_instance(4, 16, num_domains=2)
    gram, mu, _ = build_objective(features, val_feature, ETA)
    sel = torch.tensor([0, 3, 5, 9])
    v = refit_exact(gram[sel][:, sel], mu[sel], ridge_abs=ridge)
    assert int((v == 0).sum()) == 1 and int((v > 0).sum()) == 3
    active = [i for i, w in zip(sel.tolist(), v.tolist()) if w > 0]
    phi_a, _ = unconstrained_phi(gram, mu, active, ridge)
    unsel, est = estimate_swap_gains(gram, mu, dom, sel, v, ridge_abs=ridge)
    checked = 0
    for u, j in enumerate(unsel.tolist()):
        for p, i in enumerate(sel.tolist()):
            if int(dom[i]) != int(dom[j]):
                assert est[u, p] == float("-inf")
                continue
            rest = [s for s in active if s != i]
            phi_rest, v_rest = unconstrained_phi(gram, mu, rest, ridge)
            g_j = float(mu[j] - gram[j, rest] @ v_rest)
            # j helps only with a positive gradient; then the unconstrained refit on rest + j.
            phi_new = unconstrained_phi(gram, mu, rest + [j], ridge)[0] if g_j > 0 else phi_rest
            assert abs(float(est[u, p]) - (phi_new - phi_a)) <= 1e-10
            checked += 1
    assert checked > 10


def test_kappa_at_least_n_selects_everything_with_an_exact_refit():
    features, val_feature, dom = make_instance(0, 9)
    res = _run(features, val_feature, dom, 3, 50, ridge=0.0)
    assert res.indices.tolist() == list(range(9))
    gram, mu, _ = build_objective(features, val_feature, ETA)
    phi_ref, v_ref = brute_force_refit(gram, mu, list(range(9)))
    torch.testing.assert_close(res.weights * ETA, v_ref, rtol=0, atol=1e-10)


def test_user_capacities_with_slack_are_respected():
    features, val_feature, dom = make_instance(3, 30, num_domains=3)
    caps = torch.tensor([1, 10, 10])
    res = _run(features, val_feature, dom, 3, 8, ridge=0.0, refine="swap")
    capped = select_partitionsel(features=features, val_feature=val_feature, domain_ids=dom, num_domains=3, kappa=8, eta=ETA, generator=None, capacities=caps)
    assert int(capped.indices.numel()) == 8 and int(capped.domain_counts[0]) <= 1
    assert res.indices.numel() == 8


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(pick="best"), "`pick` must be one of"),
        (dict(refit="cg"), "`refit` must be one of"),
        (dict(refine="anneal"), "`refine` must be one of"),
        (dict(apga_max_iters=0), "`apga_max_iters` must be an int >= 1"),
        (dict(apga_tol=-1.0), "`apga_tol`"),
        (dict(ridge=-0.1), "`ridge`"),
        (dict(swap_max_rounds=1.5), "`swap_max_rounds`"),
        (dict(swap_time_budget_s=0), "`swap_time_budget_s`"),
        (dict(max_iter=3), r"unknown option\(s\) \['max_iter'\]"),
        (dict(gram_rows="half"), "`gram_rows` must be one of"),
        (dict(gram_batch_rows=0), "`gram_batch_rows` must be an int >= 1"),
        (dict(cpu_single_thread="yes"), "`cpu_single_thread` must be a bool"),
    ],
)
def test_bad_options_raise(options, match):
    features, val_feature, dom = make_instance(0, 10)
    with pytest.raises(ValueError, match=match):
        _run(features, val_feature, dom, 3, 3, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dtypes(dtype):
    features, val_feature, dom = make_instance(0, 50, dtype=torch.float64)
    res = _run(features.to(dtype), val_feature.to(dtype), dom, 3, 12, refine="swap")
    expect = torch.float64 if dtype == torch.float64 else torch.float32
    assert res.weights.dtype == expect and res.objective.dtype == expect
    ref = _run(features, val_feature, dom, 3, 12, refine="swap")
    rel = abs(float(res.objective) - float(ref.objective)) / float(ref.objective)
    assert rel < (0.05 if dtype == torch.bfloat16 else 1e-4)


def test_singular_pool_with_duplicates_float32():
    # Heavy duplication and D < n: K is PSD but singular; the default ridge keeps everything finite.
    features, val_feature, dom = make_instance(5, 20, dim=4, dtype=torch.float32)
    features = torch.cat([features, features, -features])
    dom = torch.cat([dom, dom, dom])
    res = _run(features, val_feature, dom, 3, 15, refine="swap")
    assert bool(torch.isfinite(res.weights).all()) and bool(torch.isfinite(res.objective))
    assert res.indices.unique().numel() == 15


def test_cpu_single_thread_off_leaves_the_thread_count_alone(monkeypatch):
    # With the option off, a library call must not change process-wide state.
    features, val_feature, dom = make_instance(0, 30)

    def refuse(n):
        raise AssertionError(f"torch.set_num_threads({n}) called with cpu_single_thread=False")

    monkeypatch.setattr(torch, "set_num_threads", refuse)
    _run(features, val_feature, dom, 3, 8, refine="swap", cpu_single_thread=False)
    from composer_algos.selection import select_greats

    select_greats(features=features, val_feature=val_feature, domain_ids=dom, num_domains=3, kappa=8, eta=ETA, generator=None)


def test_cpu_single_thread_default_is_the_documented_measured_one():
    # Issue 15: one thread was 1.2-4x faster on the shared 2-core VM at n = 32, 64 and 2048.
    from composer_algos.selection.partitionsel import PartitionSelOptions

    assert PartitionSelOptions().cpu_single_thread is True
    doc = " ".join((PartitionSelOptions.__doc__ or "").split())
    assert "cpu_single_thread: run the OMP rounds and swap verifications with one intra-op thread on CPU (default True" in doc


def test_cpu_single_thread_option_restores_the_thread_count(monkeypatch):
    features, val_feature, dom = make_instance(0, 30)
    before = torch.get_num_threads()
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    try:
        real(2)
        plain = _run(features, val_feature, dom, 3, 8, refine="swap", cpu_single_thread=False)
        single = _run(features, val_feature, dom, 3, 8, refine="swap", cpu_single_thread=True)
        assert torch.get_num_threads() == 2
        assert 1 in calls and calls[-1] == 2
        assert single.indices.tolist() == plain.indices.tolist()
    finally:
        real(before)


@pytest.mark.parametrize(
    "options",
    [{}, {"refine": "swap"}, {"pick": "randomized"}, {"refit": "apga"}, {"refine": "swap", "ridge": 0.0}],
)
@pytest.mark.parametrize("seed", range(3))
def test_lazy_gram_rows_give_the_full_gram_result(seed, options):
    # Only the rows the solver reads are computed, in speculative batches; the result must not change.
    features, val_feature, dom = make_instance(seed, 160, dim=48, num_domains=4)
    kw = dict(features=features, val_feature=val_feature, domain_ids=dom, num_domains=4, kappa=20, eta=ETA, **options)
    full = select_partitionsel(generator=torch.Generator().manual_seed(seed), gram_rows="full", **kw)
    lazy = select_partitionsel(
        generator=torch.Generator().manual_seed(seed), gram_rows="lazy", gram_batch_rows=8, **kw
    )
    assert lazy.indices.tolist() == full.indices.tolist()
    torch.testing.assert_close(lazy.weights, full.weights, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(lazy.objective, full.objective, rtol=1e-12, atol=0)
    computed = int(lazy.info["gram_rows_computed"])
    assert 20 <= computed < 160, f"lazy Gram computed {computed} of 160 rows"
    assert "gram_rows_computed" not in full.info


def test_auto_gram_rows_is_lazy_only_for_small_budgets_on_cpu():
    features, val_feature, dom = make_instance(0, 240, dim=16, num_domains=3)
    assert "gram_rows_computed" in _run(features, val_feature, dom, 3, 30).info
    assert "gram_rows_computed" not in _run(features, val_feature, dom, 3, 31).info
    assert "gram_rows_computed" not in _run(features, val_feature, dom, 3, 30, refit="apga_pool", apga_max_iters=2).info
    gram = features @ features.T
    given = _run(features, val_feature, dom, 3, 30, gram=gram, gram_rows="lazy")
    assert "gram_rows_computed" not in given.info, "a given Gram is used as is"


@pytest.mark.parametrize("seed", range(4))
def test_settled_picks_and_the_states_scores_select_as_full_rounds(seed, monkeypatch):
    # Once a pick's gradient is not positive the exact state settles and the rounds take the
    # remaining picks as the maxima of its fixed scores (penalised in place, full domains masked at
    # once); until then the state keeps grad + penalty itself. Both must pick exactly as full rounds
    # with the penalty added each round (the lazy Gram's path) on the same Gram.
    from composer_algos.selection import partitionsel as ps
    from composer_algos.selection.active_set import ActiveSetState

    features, val_feature, dom = make_instance(seed, 16, dim=2, num_domains=4)
    gram, mu = objective_terms(features, val_feature, 0.0)  # eta = 0: two dimensions are matched soon
    caps = compute_capacities(torch.bincount(dom, minlength=4), 10)
    settled = []
    add = ActiveSetState.add

    def spy(self, j1, g_j=None):
        j = add(self, j1, g_j)
        settled.append(self.settled)
        return j

    monkeypatch.setattr(ActiveSetState, "add", spy)
    fast = ps.omp_select(gram, mu, dom, caps, 10, ridge_abs=1e-6)
    assert any(settled) and len(settled) < 10, "the instance must settle before its last pick"
    # The full rounds: a GramRows marked lazy (its rows all present) takes the penalty path, no settling.
    rows = ps.GramRows(gram_NN=gram)
    rows.lazy, rows._have = True, set(range(16))
    settled.clear()
    full = ps.omp_select(rows, mu, dom, caps, 10, ridge_abs=1e-6)
    assert len(settled) == 10
    assert fast[0].tolist() == full[0].tolist()
    assert torch.equal(fast[1], full[1]) and torch.equal(fast[2], full[2])
    ref_sel, _ = omp_greedy_loop(gram, mu, dom, caps, 10, ridge=1e-6)  # the picks in order, from loops
    assert fast[0].tolist() == ref_sel


def _settled_picks_in_turn(scores_N, dom_N, rem, picks):
    # The rounds' way: the largest score, then the pick (or its full domain) masked, in turn.
    scores_N, rem, out = scores_N.clone(), list(rem), []
    for _ in range(picks):
        j = int(torch.max(scores_N, 0).indices)
        out.append(j)
        d = int(dom_N[j])
        rem[d] -= 1
        if rem[d] == 0:
            scores_N[dom_N == d] = float("-inf")
        else:
            scores_N[j] = float("-inf")
    return out


@pytest.mark.parametrize("seed", range(40))
def test_the_settled_tail_picks_at_once_what_rounds_pick_in_turn(seed):
    from composer_algos.selection.partitionsel import _settled_picks

    g = torch.Generator().manual_seed(seed)
    n, num_domains = 40, 5
    dom_N = torch.randint(0, num_domains, (n,), generator=g)
    counts = torch.bincount(dom_N, minlength=num_domains).tolist()
    rem = [int(torch.randint(0, c + 1, (1,), generator=g)) for c in counts]
    # Integer scores (many ties, broken towards the lower position), some elements already taken.
    scores_N = torch.randint(-3, 4, (n,), generator=g).to(torch.float64)
    taken = torch.rand(n, generator=g) < 0.2
    rem = [max(r - int((taken & (dom_N == d)).sum()), 0) for d, r in enumerate(rem)]
    scores_N[taken] = float("-inf")
    for d, r in enumerate(rem):
        if r == 0:
            scores_N[dom_N == d] = float("-inf")
    available = sum(min(r, int(((dom_N == d) & ~taken).sum())) for d, r in enumerate(rem))
    picks = int(torch.randint(0, available + 1, (1,), generator=g))
    assert _settled_picks(scores_N, dom_N, rem, picks) == _settled_picks_in_turn(scores_N, dom_N, rem, picks)


def test_the_settled_tail_refuses_more_picks_than_room():
    from composer_algos.selection.partitionsel import _settled_picks

    dom_N = torch.tensor([0, 0, 1])
    scores_N = torch.tensor([1.0, float("-inf"), 2.0])
    with pytest.raises(RuntimeError, match="only 2 elements have room"):
        _settled_picks(scores_N, dom_N, [2, 1], 3)
