"""Capacities: proportional largest remainder, fixed fractions with water-filling, edge cases and errors."""

from __future__ import annotations

import warnings

import pytest
import torch

from composer_algos.selection import compute_capacities, resolve_capacities
from tests.selection.reference import largest_remainder_loop


def _caps(counts, kappa, fractions=None):
    return compute_capacities(torch.tensor(counts), kappa, fractions).tolist()


def test_proportional_hand_example():
    # quotas 4 * (5, 3, 2) / 10 = (2, 1.2, 0.8): floors (2, 1, 0), the one left goes to remainder 0.8.
    assert _caps([5, 3, 2], 4) == [2, 1, 1]


@pytest.mark.parametrize("seed", range(40))
def test_proportional_matches_exact_fraction_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    num_domains = int(torch.randint(1, 9, (1,), generator=gen))
    counts = torch.randint(0, 30, (num_domains,), generator=gen).tolist()
    kappa = int(torch.randint(0, sum(counts) + 5, (1,), generator=gen))
    caps = _caps(counts, kappa)
    assert caps == largest_remainder_loop(counts, kappa)
    assert sum(caps) == min(kappa, sum(counts))
    assert all(0 <= c <= m for c, m in zip(caps, counts))


def test_proportional_ties_go_to_larger_domain_then_lower_index():
    # k * n_c / n = 3 * (2, 2, 2) / 6 = (1, 1, 1): exact; with k = 2 all remainders tie -> lower indices.
    assert _caps([2, 2, 2], 2) == [1, 1, 0]
    # quotas 1 * (1, 3) / 4 = (0.25, 0.75): the larger remainder wins.
    assert _caps([1, 3], 1) == [0, 1]


@pytest.mark.parametrize(
    "counts,kappa,expected",
    [
        ([4, 0, 6], 5, [2, 0, 3]),  # absent domain gets 0
        ([4, 0, 6], 50, [4, 0, 6]),  # kappa >= n: everything
        ([4, 0, 6], 0, [0, 0, 0]),  # kappa = 0
        ([7], 3, [3]),  # single domain
        ([7], 9, [7]),  # single domain, kappa > n
        ([0, 0], 3, [0, 0]),  # empty pool
        ([1, 1, 98], 10, [0, 0, 10]),  # tiny domains lose to the largest remainder
    ],
)
def test_proportional_edge_cases(counts, kappa, expected):
    assert _caps(counts, kappa) == expected


def test_fractions_basic_and_tensor_input():
    assert _caps([10, 10, 10], 8, [0.5, 0.25, 0.25]) == [4, 2, 2]
    assert _caps([10, 10, 10], 8, torch.tensor([0.5, 0.25, 0.25])) == [4, 2, 2]


def test_fractions_cap_small_domain_and_respread():
    # Domain 0 wants 0.6 * 10 = 6 but holds 2; the 4 freed go to domains 1 and 2 in ratio 3:1.
    assert _caps([2, 20, 20], 10, [0.6, 0.3, 0.1]) == [2, 6, 2]


def test_fractions_zero_fraction_domain_gets_nothing():
    assert _caps([5, 5, 5], 6, [0.5, 0.5, 0.0]) == [3, 3, 0]


def test_fractions_absent_domain_with_positive_fraction():
    assert _caps([0, 8, 8], 6, [0.5, 0.25, 0.25]) == [0, 3, 3]


def test_a_pool_the_weighted_domains_cannot_fill_takes_the_rest_from_the_others():
    # It raised, stopping a run at whichever step first drew such a pool (a second new-user review: the docs'
    # `{algebra: 2, numbers: 1}` on dm_math). The weighted domains are filled first, the rest comes from the
    # domains of fraction 0 in proportion to their counts, with a warning; unbiased rounding alike.
    with pytest.warns(RuntimeWarning, match="the rest came from the domains of fraction 0"):
        assert _caps([1, 2, 50], 5, [0.5, 0.5, 0.0]) == [1, 2, 2]
    with pytest.warns(RuntimeWarning):
        assert _caps([1, 2, 30, 10], 7, [0.5, 0.5, 0.0, 0.0]) == [1, 2, 3, 1]
    with pytest.warns(RuntimeWarning):
        caps = compute_capacities(torch.tensor([1, 2, 50]), 5, [0.5, 0.5, 0.0], generator=torch.Generator().manual_seed(0))
    assert caps.tolist() == [1, 2, 2]
    with warnings.catch_warnings():  # a pool with the room: nothing spilt, no warning
        warnings.simplefilter("error")
        assert _caps([4, 4, 50], 5, [0.5, 0.5, 0.0]) in ([3, 2, 0], [2, 3, 0])


@pytest.mark.parametrize(
    "fractions,match",
    [
        ([0.5, 0.5], "one entry per domain"),
        ([0.5, 0.7, -0.2], "finite and >= 0"),
        ([0.2, 0.2, 0.2], "sum to 1"),
        ([float("nan"), 0.5, 0.5], "finite"),
    ],
)
def test_bad_fractions_raise(fractions, match):
    with pytest.raises(ValueError, match=match):
        compute_capacities(torch.tensor([3, 3, 3]), 3, fractions)


@pytest.mark.parametrize("kappa", [-1, 2.5, True])
def test_bad_kappa_raises(kappa):
    with pytest.raises(ValueError, match="kappa"):
        compute_capacities(torch.tensor([3, 3]), kappa)


def test_negative_counts_raise():
    with pytest.raises(ValueError, match="pool_counts"):
        compute_capacities(torch.tensor([3, -1]), 2)


def test_resolve_clips_to_pool_and_rejects_too_small():
    dom = torch.tensor([0, 0, 1, 2, 2, 2])
    caps = resolve_capacities("x", torch.tensor([5, 0, 1]), dom, 3, 3)
    assert caps.tolist() == [2, 0, 1]
    with pytest.raises(ValueError, match="admit only 3 examples"):
        resolve_capacities("x", torch.tensor([5, 0, 1]), dom, 3, 4)
    assert resolve_capacities("x", None, dom, 3, 3).tolist() == _caps([2, 1, 3], 3)


# ---------------------------------------------------------------- unbiased (randomized) rounding
# The issue's shape: 10 domains, pool 32 = 2 kappa, so every odd count has remainder exactly 0.5.
_ISSUE_COUNTS = [9, 7, 5, 3, 3, 1, 1, 1, 1, 1]
_ISSUE_PROBS = [0.25, 0.2, 0.15, 0.1, 0.1, 0.06, 0.05, 0.04, 0.03, 0.02]


def _long_run(pool_counts_fn, kappa, steps, fractions=None):
    """Sum of capacities and of exact quotas over ``steps`` seeded steps (the algorithm's per-step generator)."""
    caps_sum, quota_sum = None, None
    for step in range(steps):
        counts = pool_counts_fn(step)
        caps = compute_capacities(
            torch.tensor(counts), kappa, fractions, generator=torch.Generator().manual_seed(1000 + step)
        )
        n = sum(counts)
        k = min(kappa, n)
        quota = torch.tensor([k * c / n for c in counts], dtype=torch.float64)
        caps_sum = caps.double() if caps_sum is None else caps_sum + caps.double()
        quota_sum = quota if quota_sum is None else quota_sum + quota
    return caps_sum, quota_sum


def _assert_unbiased(caps_sum, quota_sum, steps):
    # Each step's rounding error cap_c - q_c lies in (-1, 1) with mean 0 and variance <= 1/4, so the
    # sum over `steps` independent steps has standard error <= sqrt(steps) / 2. Allow 5 of them.
    tol = 5 * 0.5 * steps**0.5
    err = (caps_sum - quota_sum).abs()
    assert (err <= tol).all(), (
        f"long-run capacity - quota per domain {(caps_sum - quota_sum).tolist()} > {tol:.1f}"
    )


def test_unbiased_long_run_share_equals_pool_share_fixed_odd_counts():
    steps = 2000
    caps_sum, quota_sum = _long_run(lambda step: _ISSUE_COUNTS, 16, steps)
    _assert_unbiased(caps_sum, quota_sum, steps)
    # In shares: every domain, the smallest (1 of 32) included, gets its pool share within 10%.
    share = caps_sum / caps_sum.sum()
    pool_share = torch.tensor(_ISSUE_COUNTS, dtype=torch.float64) / sum(_ISSUE_COUNTS)
    torch.testing.assert_close(share / pool_share, torch.ones(10, dtype=torch.float64), atol=0.1, rtol=0)


def test_unbiased_long_run_share_equals_pool_share_random_pools():
    # Pools of 32 drawn from a skewed mixture each step, as a real loader delivers them.
    steps = 2000
    probs = torch.tensor(_ISSUE_PROBS)

    def pool(step):
        gen = torch.Generator().manual_seed(step)
        return torch.bincount(
            torch.multinomial(probs, 32, replacement=True, generator=gen), minlength=10
        ).tolist()

    caps_sum, quota_sum = _long_run(pool, 16, steps)
    _assert_unbiased(caps_sum, quota_sum, steps)


def test_deterministic_rounding_is_the_biased_legacy():
    # Documents why training passes a generator: without one, the 0.5 ties all go to larger domains.
    caps = _caps(_ISSUE_COUNTS, 16)
    assert caps == [5, 4, 3, 2, 2, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("seed", range(60))
def test_unbiased_invariants_floor_or_ceil_sum_and_pool_limit(seed):
    gen = torch.Generator().manual_seed(seed)
    num_domains = int(torch.randint(1, 9, (1,), generator=gen))
    counts = torch.randint(0, 30, (num_domains,), generator=gen).tolist()
    kappa = int(torch.randint(0, sum(counts) + 5, (1,), generator=gen))
    caps = compute_capacities(torch.tensor(counts), kappa, generator=gen).tolist()
    n, k = sum(counts), min(kappa, sum(counts))
    assert sum(caps) == k
    for cap, c in zip(caps, counts):
        lo = k * c // n if n else 0
        hi = -(-k * c // n) if n else 0
        assert lo <= cap <= hi and 0 <= cap <= c, (caps, counts, kappa)


def test_unbiased_edge_cases_match_the_exact_answers():
    gen = torch.Generator().manual_seed(0)
    for counts, kappa, expected in [
        ([4, 0, 6], 50, [4, 0, 6]),
        ([4, 0, 6], 0, [0, 0, 0]),
        ([7], 3, [3]),
        ([0, 0], 3, [0, 0]),
        ([2, 4, 6], 6, [1, 2, 3]),  # integer quotas: no rounding
    ]:
        assert compute_capacities(torch.tensor(counts), kappa, generator=gen).tolist() == expected


def test_unbiased_is_deterministic_per_seed_and_varies_across_seeds():
    results = {
        tuple(
            compute_capacities(
                torch.tensor(_ISSUE_COUNTS), 16, generator=torch.Generator().manual_seed(s)
            ).tolist()
        )
        for s in range(20)
    }
    again = compute_capacities(torch.tensor(_ISSUE_COUNTS), 16, generator=torch.Generator().manual_seed(3))
    assert (
        again.tolist()
        == compute_capacities(
            torch.tensor(_ISSUE_COUNTS), 16, generator=torch.Generator().manual_seed(3)
        ).tolist()
    )
    assert len(results) > 1


def test_unbiased_fractions_long_run_and_water_filling():
    # Domain 0 wants 0.6 * 7 = 4.2 but holds 2: the 2.2 freed go to domains 1 and 2 in ratio 3:1,
    # so the exact quotas are (2, 3.75, 1.25); the rounding keeps their means and never exceeds 2.
    steps = 2000
    total = torch.zeros(3, dtype=torch.float64)
    for step in range(steps):
        caps = compute_capacities(
            torch.tensor([2, 20, 20]), 7, [0.6, 0.3, 0.1], generator=torch.Generator().manual_seed(step)
        )
        assert caps[0] == 2 and caps.sum() == 7 and caps[1] in (3, 4) and caps[2] in (1, 2)
        total += caps.double()
    expected = torch.tensor([2.0, 3.75, 1.25], dtype=torch.float64) * steps
    assert ((total - expected).abs() <= 5 * 0.5 * steps**0.5).all(), (total / steps).tolist()
    # A zero fraction never receives capacity, whatever the draw.
    for s in range(20):
        caps = compute_capacities(
            torch.tensor([5, 5, 5]), 7, [0.5, 0.5, 0.0], generator=torch.Generator().manual_seed(s)
        )
        assert caps[2] == 0 and sorted(caps[:2].tolist()) == [3, 4]


def test_bad_generator_raises():
    with pytest.raises(ValueError, match="generator"):
        compute_capacities(torch.tensor([3, 3]), 2, generator=7)


def test_resolve_passes_the_generator_to_proportional_ones():
    dom = torch.tensor([0] * 9 + [1] * 7 + [2] * 5 + [3] * 3 + [4] * 3 + [5, 6, 7, 8, 9])
    draws = {
        tuple(resolve_capacities("x", None, dom, 10, 16, generator=torch.Generator().manual_seed(s)).tolist())
        for s in range(20)
    }
    assert any(d[5:] != (0, 0, 0, 0, 0) for d in draws)
