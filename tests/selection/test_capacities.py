"""Capacities: proportional largest remainder, fixed fractions with water-filling, edge cases and errors."""

from __future__ import annotations

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


def test_fractions_impossible_request_raises():
    with pytest.raises(ValueError, match="hold only 3 examples"):
        compute_capacities(torch.tensor([1, 2, 50]), 5, [0.5, 0.5, 0.0])


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
