"""Capacity policies (issue 21): slack bounds, the official adaptive curriculum, DoReMi weights files, minority_full."""

from __future__ import annotations

import json
import math

import pytest
import torch

from composer_algos.data_selection.capacity_policy import (
    AdaptivePolicy,
    FractionsPolicy,
    MinorityFullPolicy,
    ProportionalPolicy,
    SlackPolicy,
    adaptive_budgets,
    adaptive_gain_update,
    domain_balanced_mean,
    parse_capacity_policy,
    per_domain_utilities,
    read_domain_weights_file,
)
from composer_algos.mixture_io import write_mixture_json
from composer_algos.selection import STRATEGIES, compute_capacities


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- slack
def test_slack_bounds_by_hand():
    # q = proportional capacities of k = 6 over counts (6, 3, 3): (3, 1.5, 1.5) -> the rounding of the
    # generator; the bounds are min(n_c, ceil(2 q_c)).
    counts = torch.tensor([6, 3, 3])
    q = compute_capacities(counts, 6, generator=_gen(5))
    bounds = SlackPolicy(factor=2.0).capacities(counts, 6, _gen(5))
    expected = [min(n, math.ceil(2 * c)) for n, c in zip(counts.tolist(), q.tolist())]
    assert bounds.tolist() == expected
    assert SlackPolicy(factor=1.5).capacities(torch.tensor([8, 4]), 6, _gen(0)).tolist() == [6, 3]  # q = (4, 2)


@pytest.mark.parametrize("seed", range(20))
def test_slack_at_one_is_proportional_and_bounds_are_respected(seed):
    g = torch.Generator().manual_seed(1000 + seed)
    counts = torch.randint(0, 9, (5,), generator=g)
    k = int(torch.randint(0, int(counts.sum()) + 1, (1,), generator=g))
    prop = compute_capacities(counts, k, generator=_gen(seed))
    assert SlackPolicy(factor=1.0).capacities(counts, k, _gen(seed)).tolist() == prop.tolist()
    for factor in (1.5, 2.0, math.inf):
        bounds = SlackPolicy(factor=factor).capacities(counts, k, _gen(seed))
        assert (bounds >= prop).all() and (bounds <= counts).all()
        assert int(bounds.sum()) >= k
        if math.isinf(factor):
            assert bounds.tolist() == torch.minimum(counts, torch.full_like(counts, k)).tolist()


def _problem(seed: int, n: int = 40, d: int = 12, c: int = 4):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, d, generator=g, dtype=torch.float64)
    dom = torch.randint(0, c, (n,), generator=g)
    gbar = torch.randn(d, generator=g, dtype=torch.float64)
    return feats, gbar, dom


def _select(name, feats, gbar, dom, caps, k, seed=0, **opts):
    return STRATEGIES[name].fn(
        features=feats, val_feature=gbar, domain_ids=dom, num_domains=int(caps.shape[0]), kappa=k, eta=0.05,
        generator=_gen(seed), capacities=caps, **opts,
    )


@pytest.mark.parametrize(
    ("strategy", "pick"),
    [(s, "greedy") for s in ("partitionsel", "id", "iwd", "random_stratified")]
    + [("partitionsel", "randomized"), ("iwd", "randomized")],
)
def test_slack_selections_fill_kappa_within_the_bounds(strategy, pick):
    opts = {"pick": pick} if strategy in ("partitionsel", "iwd") else {}
    for seed in range(6):
        feats, gbar, dom = _problem(seed)
        counts = torch.bincount(dom, minlength=4)
        k = 15
        bounds = SlackPolicy(factor=2.0).capacities(counts, k, _gen(seed))
        assert int(bounds.sum()) > k
        res = _select(strategy, feats, gbar, dom, bounds, k, seed, **opts)
        assert res.indices.numel() == k and res.indices.unique().numel() == k
        assert (res.domain_counts <= bounds).all(), (res.domain_counts, bounds)


def test_slack_at_one_selects_what_proportional_selects():
    for seed in range(6):
        feats, gbar, dom = _problem(seed)
        counts = torch.bincount(dom, minlength=4)
        for pick in ("greedy", "randomized"):
            prop = _select("partitionsel", feats, gbar, dom, compute_capacities(counts, 13, generator=_gen(seed)), 13, seed, pick=pick)
            slack = _select("partitionsel", feats, gbar, dom, SlackPolicy(factor=1.0).capacities(counts, 13, _gen(seed)), 13, seed, pick=pick)
            assert slack.indices.tolist() == prop.indices.tolist()


def test_unbounded_slack_is_domain_free_selection():
    # With bounds at the pool counts the domains constrain nothing: a single-domain labelling selects the same.
    for seed in range(4):
        feats, gbar, dom = _problem(seed)
        counts = torch.bincount(dom, minlength=4)
        free = _select("partitionsel", feats, gbar, dom, SlackPolicy(factor=math.inf).capacities(counts, 12, _gen(0)), 12)
        one = _select("partitionsel", feats, gbar, torch.zeros_like(dom), torch.tensor([12]), 12)
        assert free.indices.tolist() == one.indices.tolist()


def test_randomized_pick_draws_from_the_truncated_base():
    # Two domains with bounds (3, 3) and k = 3: the base of the truncated matroid is the 3 heaviest
    # elements overall, not the 3 best of each domain. Domain 1's elements are all worse than domain 0's.
    feats = torch.eye(6, dtype=torch.float64)
    gbar = torch.tensor([5.0, 4.0, 3.0, 0.3, 0.2, 0.1], dtype=torch.float64)
    dom = torch.tensor([0, 0, 0, 1, 1, 1])
    for seed in range(10):
        res = _select("partitionsel", feats, gbar, dom, torch.tensor([3, 3]), 3, seed, pick="randomized")
        assert res.indices.tolist() == [0, 1, 2]


# ---------------------------------------------------------------------------------------------- adaptive
def test_adaptive_update_equals_a_hand_computation_of_the_official_formula():
    # Selected G_S = [[1, 0], [0, 2]], refit v = [0.5, 0.1], eta = 0.1; validation rows [2, 0] and
    # [0, 0] of domain 0 (gbar_0 = [1, 0]) and [0, 1] of domain 1 (gbar_1 = [0, 1]).
    # K = diag(1, 4); mu_0 = [1, 0] + 0.05 [1, 4] = [1.05, 0.2]; mu_1 = [0, 2] + [0.05, 0.2] = [0.05, 2.2];
    # v^T K v / 2 = (0.25 + 0.04) / 2 = 0.145; U_0 = 0.525 + 0.02 - 0.145 = 0.4; U_1 = 0.025 + 0.22 - 0.145 = 0.1.
    features = torch.tensor([[9.0, 9.0], [1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    rows = torch.tensor([[2.0, 0.0], [0.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    util, observed = per_domain_utilities(
        features, torch.tensor([1, 2]), torch.tensor([0.5, 0.1]), rows, torch.tensor([0, 0, 1]), 2, 0.1
    )
    torch.testing.assert_close(util, torch.tensor([0.4, 0.1], dtype=torch.float64))
    assert observed.tolist() == [True, True]
    # prev = [0.5, 0.2], gain = [0.1, 0]: r = [-0.2, -0.5]; gain = 0.9 r + 0.1 gain = [-0.17, -0.45].
    policy = AdaptivePolicy(beta=0.9, lamb=0.5)
    policy.load_state_dict({"gain": [0.1, 0.0], "prev": [0.5, 0.2]})
    policy.update(util, observed)
    torch.testing.assert_close(policy.gain_C, torch.tensor([-0.17, -0.45], dtype=torch.float64))
    torch.testing.assert_close(policy.prev_C, torch.tensor([0.4, 0.1], dtype=torch.float64))
    # Budgets for counts (20, 20), k = 10: standardize(gain) = [1, -1]; 10/2 - (10/0.5) [1, -1] = [-15, 25],
    # clipped to [0, 20] and rounded: (0, 20), 10 over budget, removed from the only domain above 0: (0, 10).
    assert policy.capacities(torch.tensor([20, 20]), 10, _gen(0)).tolist() == [0, 10]


def test_adaptive_budgets_without_adjustment_by_hand():
    # gain (0.01, 0, -0.01): standardize = (1.2247, 0, -1.2247); 12/3 - (12/10) z = (2.53, 4, 5.47) -> (3, 4, 5).
    caps = adaptive_budgets(torch.tensor([0.01, 0.0, -0.01], dtype=torch.float64), torch.tensor([100] * 3), 12, 10.0, _gen(0))
    assert caps.tolist() == [3, 4, 5]
    # Zero gain: k / C each; absent domains get 0 and do not count in C.
    caps = adaptive_budgets(torch.zeros(3, dtype=torch.float64), torch.tensor([5, 0, 5]), 6, 0.5, _gen(0))
    assert caps.tolist() == [3, 0, 3]


@pytest.mark.parametrize("seed", range(10))
def test_adaptive_budgets_sum_to_kappa_within_the_pool(seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 10, (6,), generator=g)
    k = int(torch.randint(0, int(counts.sum()) + 1, (1,), generator=g))
    gain = torch.randn(6, generator=g, dtype=torch.float64)
    caps = adaptive_budgets(gain, counts, k, 0.5, _gen(seed))
    assert int(caps.sum()) == k and (caps >= 0).all() and (caps <= counts).all()
    assert caps.tolist() == adaptive_budgets(gain, counts, k, 0.5, _gen(seed)).tolist()  # a pure function


def test_adaptive_gain_update_skips_domains_without_validation_and_zero_prev():
    gain, prev = adaptive_gain_update(
        torch.tensor([0.3, 0.2], dtype=torch.float64),
        torch.tensor([0.0, 2.0], dtype=torch.float64),
        torch.tensor([1.0, 5.0], dtype=torch.float64),
        torch.tensor([True, False]),
        0.9,
    )
    assert gain.tolist() == pytest.approx([0.1 * 0.3, 0.2])  # r = 0 where prev = 0
    assert prev.tolist() == [1.0, 2.0]


def test_adaptive_state_round_trips():
    policy = AdaptivePolicy()
    policy.update(torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([True, True]))
    policy.update(torch.tensor([1.5, 1.0], dtype=torch.float64), torch.tensor([True, True]))
    other = AdaptivePolicy()
    other.load_state_dict(json.loads(json.dumps(policy.state_dict())))
    assert other.gain_C.tolist() == policy.gain_C.tolist() and other.prev_C.tolist() == policy.prev_C.tolist()
    counts = torch.tensor([9, 9])
    assert other.capacities(counts, 8, _gen(3)).tolist() == policy.capacities(counts, 8, _gen(3)).tolist()


# ---------------------------------------------------------------------------------------------- fractions
def test_doremi_weights_file_in_both_formats(tmp_path):
    ours = tmp_path / "mixture.json"
    write_mixture_json(ours, method="doremi", domain_names=["a", "b", "c"], weights=[0.5, 0.3, 0.2], steps=10)
    official = tmp_path / "official.json"
    official.write_text(json.dumps({"train_domain_weights": {"a": 5, "b": 3, "c": 2}, "eval_domain_weights": {"a": 1}}))
    for path in (ours, official, tmp_path):  # a run directory stands for its mixture.json
        assert read_domain_weights_file(path) == pytest.approx({"a": 0.5, "b": 0.3, "c": 0.2})
        policy = parse_capacity_policy({"policy": "fractions", "file": str(path)})
        policy.bind(["a", "b", "c"], ["a", "b", "c"])
        assert policy.fractions() == pytest.approx([0.5, 0.3, 0.2])
    # A DoReMi proxy run's directory holds the mixture it was fed (MixtureMonitor's mixture.json) beside the weights
    # it learnt: the directory stands for the learnt ones (it gave the fed mixture, a second review found).
    proxy = tmp_path / "proxy"
    (proxy / "doremi").mkdir(parents=True)
    write_mixture_json(proxy / "mixture.json", method="natural", domain_names=["a", "b", "c"], weights=[0.2, 0.2, 0.6],
                       steps=10)
    write_mixture_json(proxy / "doremi" / "mixture.json", method="doremi", domain_names=["a", "b", "c"],
                       weights=[0.5, 0.3, 0.2], steps=10)
    assert read_domain_weights_file(proxy) == pytest.approx({"a": 0.5, "b": 0.3, "c": 0.2})


def test_doremi_weights_file_missing_a_trained_domain_is_named(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"train_domain_weights": {"a": 0.6, "b": 0.4}}))
    policy = parse_capacity_policy({"policy": "fractions", "file": str(path)})
    with pytest.raises(ValueError, match=r"no weight for domains \['wiki'\]"):
        policy.bind(["a", "b", "wiki"], ["a", "b", "wiki"])
    policy.bind(["a", "b", "wiki"], ["a", "b"])  # a domain the run does not train may be missing
    assert policy.fractions() == pytest.approx([0.6, 0.4, 0.0])


def test_weights_file_in_neither_format_is_rejected(tmp_path):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"weights": {"a": 1}}))
    with pytest.raises(ValueError, match="neither.*train_domain_weights"):
        read_domain_weights_file(path)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_domain_weights_file(tmp_path / "absent.json")


def test_fractions_and_uniform_policies_are_compute_capacities_with_fractions():
    policy = parse_capacity_policy({"policy": "fractions", "weights": {"a": 2, "b": 1, "c": 1}})
    policy.bind(["a", "b", "c"])
    assert policy.fractions() == pytest.approx([0.5, 0.25, 0.25]) and policy.simple()
    uniform = parse_capacity_policy("uniform")
    uniform.bind(["a", "b", "c", "d"])
    assert uniform.fractions() == pytest.approx([0.25] * 4)
    assert isinstance(parse_capacity_policy(None), ProportionalPolicy)


# ---------------------------------------------------------------------------------------------- minority_full
def test_minority_full_keeps_listed_domains_whole():
    policy = parse_capacity_policy({"policy": "minority_full", "domains": ["small"]})
    assert isinstance(policy, MinorityFullPolicy)
    policy.bind(["big", "mid", "small"])
    caps = policy.capacities(torch.tensor([20, 10, 3]), 12, _gen(0))
    assert caps[2] == 3 and int(caps.sum()) == 12 and (caps <= torch.tensor([20, 10, 3])).all()
    # The rest (9) proportionally over big and mid: quotas 6 and 3.
    assert caps.tolist() == [6, 3, 3]


def test_minority_full_by_share_and_with_uniform_base():
    policy = parse_capacity_policy({"policy": "minority_full", "max_share": 0.1, "base": "uniform"})
    policy.bind(["a", "b", "c", "d"])
    counts = torch.tensor([40, 10, 2, 0])  # c holds 2/52 < 0.1 of the pool; d is absent
    caps = policy.capacities(counts, 12, _gen(0))
    assert caps.tolist() == [5, 5, 2, 0]  # 10 left over a and b at equal shares


def test_minority_full_kept_domains_beyond_the_budget_share_it():
    policy = parse_capacity_policy({"policy": "minority_full", "domains": ["a", "b"]})
    policy.bind(["a", "b", "c"])
    caps = policy.capacities(torch.tensor([6, 6, 30]), 8, _gen(1))
    assert int(caps.sum()) == 8 and caps[2] == 0


# ---------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("bogus", "unknown policy 'bogus'"),
        ("slack", "needs options"),
        ({"policy": "slack", "factor": 0.5}, r"factor must be a number >= 1"),
        ({"policy": "slack", "factor": 2, "beta": 1}, r"does not take \['beta'\]"),
        ({"policy": "adaptive", "beta": 0}, r"beta must be in \(0, 1\]"),
        ({"policy": "fractions"}, "exactly one of `weights`"),
        ({"policy": "fractions", "weights": {"a": -1}}, "weights must be numbers >= 0"),
        ({"policy": "minority_full", "domains": ["a"], "base": {"policy": "slack", "factor": 2}}, "base must be"),
        ({"policy": "minority_full"}, "exactly one of `domains`"),
        ({"policy": "wat"}, "policy must be one of"),
    ],
)
def test_bad_policies_are_rejected_naming_the_key(value, match):
    with pytest.raises(ValueError, match=match):
        parse_capacity_policy(value)


def test_slack_accepts_an_infinite_factor():
    assert math.isinf(parse_capacity_policy({"policy": "slack", "factor": "inf"}).factor)
    assert math.isinf(parse_capacity_policy({"policy": "slack", "factor": float("inf")}).factor)


# ---------------------------------------------------------------------------------------------- target
def test_domain_balanced_mean_by_hand():
    rows = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
    dom = torch.tensor([0, 0, 1])
    # Domain 0's rows weigh 1/(2*2) each, domain 1's row 1/(2*1): [0.25 + 0.75, 2.0].
    torch.testing.assert_close(domain_balanced_mean(rows, dom), torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(domain_balanced_mean(rows, dom, 5), torch.tensor([1.0, 2.0]))
    # One domain: the plain mean.
    torch.testing.assert_close(domain_balanced_mean(rows, torch.zeros(3, dtype=torch.long)), rows.mean(0))


def test_fractions_policy_is_simple_and_others_are_not():
    assert FractionsPolicy(weights={"a": 1.0}).simple()
    assert not SlackPolicy(factor=2.0).simple() and not AdaptivePolicy().simple()
