"""Registry contract: names and flags, feasibility of every strategy, input validation, conflict_fraction."""

from __future__ import annotations

import pytest
import torch

from composer_algos.selection import (
    STRATEGIES,
    SelectionResult,
    compute_capacities,
    conflict_fraction,
    get_strategy,
)
from tests.selection.reference import make_instance

NAMES = ["partitionsel", "greats", "id", "iwd", "gradnorm", "colm", "random", "random_stratified"]


# Strategies guided by the validation rows one by one (tests/selection/test_anchor_strategies.py).
ANCHOR_NAMES = ["facloc", "uniprot"]


def test_registry_names_and_flags():
    assert sorted(STRATEGIES) == sorted(NAMES + ANCHOR_NAMES)
    flags = {name: (s.needs_features, s.needs_validation, s.uses_capacities) for name, s in STRATEGIES.items()}
    assert flags["partitionsel"] == (True, True, True)
    assert flags["greats"] == (True, True, False)
    assert flags["id"] == (True, True, True) and flags["iwd"] == (True, True, True)
    assert flags["gradnorm"] == (True, False, False) and flags["colm"] == (True, False, False)
    assert flags["random"] == (False, False, False) and flags["random_stratified"] == (False, False, True)
    assert flags["facloc"] == flags["uniprot"] == (True, True, False)
    assert [n for n, s in STRATEGIES.items() if s.needs_validation_rows] == ANCHOR_NAMES
    assert get_strategy("iwd") is STRATEGIES["iwd"]
    with pytest.raises(ValueError, match="unknown selection strategy 'doremi'"):
        get_strategy("doremi")


SCENARIOS = {
    # name: (n, num_domains, kappa, domain pattern, capacities)
    "typical": (40, 4, 10, "uniform", None),
    "kappa_ge_n": (9, 3, 20, "uniform", None),
    "kappa_zero": (12, 3, 0, "uniform", None),
    "single_domain": (15, 1, 6, "uniform", None),
    "absent_domain": (20, 5, 7, "skip_2", None),
    "tiny_domain": (30, 3, 12, "tiny_0", None),
    "user_caps": (30, 3, 9, "uniform", [2, 4, 9]),
    "empty_pool": (0, 3, 5, "uniform", None),
}


def _scenario(name):
    n, num_domains, kappa, pattern, caps = SCENARIOS[name]
    features, val_feature, _ = make_instance(7, n, num_domains=num_domains)
    gen = torch.Generator().manual_seed(1)
    dom = torch.randint(0, num_domains, (n,), generator=gen)
    if pattern == "skip_2":
        dom = torch.where(dom == 2, torch.zeros_like(dom), dom)
    if pattern == "tiny_0":
        dom = torch.where(dom == 0, torch.ones_like(dom), dom)
        dom[0] = 0
    caps_t = torch.tensor(caps) if caps is not None else None
    return features, val_feature, dom, num_domains, kappa, caps_t


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("name", NAMES)
def test_every_strategy_is_feasible(name, scenario):
    features, val_feature, dom, num_domains, kappa, caps = _scenario(scenario)
    spec = STRATEGIES[name]
    res = spec.fn(
        features=features,
        val_feature=val_feature,
        domain_ids=dom,
        num_domains=num_domains,
        kappa=kappa,
        eta=0.5,
        generator=torch.Generator().manual_seed(0),
        capacities=caps,
    )
    n = dom.numel()
    k = min(kappa, n)
    assert isinstance(res, SelectionResult)
    assert res.indices.dtype == torch.long and res.indices.shape == (k,)
    assert res.indices.unique().numel() == k
    assert res.indices.tolist() == sorted(res.indices.tolist())
    assert bool((res.indices >= 0).all()) and bool((res.indices < n).all())
    assert res.domain_counts.tolist() == torch.bincount(dom[res.indices], minlength=num_domains).tolist()
    if spec.uses_capacities:
        limit = caps if caps is not None else compute_capacities(torch.bincount(dom, minlength=num_domains), kappa)
        assert bool((res.domain_counts <= limit).all()), (res.domain_counts, limit)
    if res.weights is not None:
        assert res.weights.shape == (k,) and bool((res.weights >= 0).all())
    if res.objective is not None:
        assert res.objective.dim() == 0 and bool(torch.isfinite(res.objective))
    # SelectionResult.info: tensors computed on the device, or Python numbers the solver counted on the host.
    assert all(isinstance(v, (torch.Tensor, int, float, bool)) for v in res.info.values())


@pytest.mark.parametrize("name", NAMES)
def test_unknown_option_raises(name):
    features, val_feature, dom = make_instance(0, 10)
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['bogus'\]"):
        STRATEGIES[name].fn(
            features=features, val_feature=val_feature, domain_ids=dom, num_domains=3, kappa=3, eta=0.1, generator=None, bogus=1
        )


@pytest.mark.parametrize("name", [n for n in NAMES if STRATEGIES[n].needs_features])
def test_non_finite_features_raise(name):
    features, val_feature, dom = make_instance(0, 10)
    features[3, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        STRATEGIES[name].fn(features=features, val_feature=val_feature, domain_ids=dom, num_domains=3, kappa=3, eta=0.1, generator=None)


@pytest.mark.parametrize("name", ["random", "random_stratified"])
def test_random_baselines_work_with_broken_features(name):
    features, val_feature, dom = make_instance(0, 10)
    features[:] = float("inf")
    res = STRATEGIES[name].fn(features=features, val_feature=val_feature, domain_ids=dom, num_domains=3, kappa=4, eta=0.1, generator=None)
    assert res.indices.numel() == 4


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(kappa=-1), "`kappa` must be an int >= 0"),
        (dict(eta=-0.1), "`eta` must be a finite float >= 0"),
        (dict(eta=float("nan")), "`eta` must be a finite float >= 0"),
        (dict(num_domains=0), "`num_domains` must be an int >= 1"),
        (dict(domain_ids=torch.tensor([0, 1, 2, 3, 0, 1, 2, 0, 1, 2])), r"must lie in \[0, num_domains=3\)"),
        (dict(domain_ids=torch.zeros(9, dtype=torch.long)), "`features` must be a \\(9, D\\)"),
        (dict(domain_ids=torch.zeros(10)), "integer dtype"),
        (dict(val_feature=torch.zeros(31, dtype=torch.float64)), "`val_feature` must be a 1-D floating tensor of length D=32"),
        (dict(val_feature=None), "needs `val_feature`"),
        (dict(features=None), "needs `features`"),
        (dict(capacities=torch.tensor([1, 2])), "`capacities` must be an integer tensor of shape \\(3,\\)"),
        (dict(capacities=torch.tensor([1, -2, 3])), "`capacities` must be >= 0"),
        (dict(capacities=torch.tensor([0, 1, 1])), "admit only 2 examples"),
        (dict(gram=torch.zeros(4, 4)), "`gram` must be a floating \\(10, 10\\)"),
    ],
)
def test_bad_inputs_raise(change, match):
    features, val_feature, dom = make_instance(0, 10)
    kw = dict(features=features, val_feature=val_feature, domain_ids=dom, num_domains=3, kappa=3, eta=0.1, generator=None)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        STRATEGIES["partitionsel"].fn(**kw)


def test_precomputed_gram_gives_the_same_selection():
    features, val_feature, dom = make_instance(4, 30)
    for name in ["partitionsel", "greats", "id", "iwd", "gradnorm", "colm"]:
        kw = dict(features=features, val_feature=val_feature, domain_ids=dom, num_domains=3, kappa=8, eta=0.2, generator=None)
        plain = STRATEGIES[name].fn(**kw)
        with_gram = STRATEGIES[name].fn(gram=features @ features.T, **kw)
        assert plain.indices.tolist() == with_gram.indices.tolist(), name


def test_conflict_fraction_hand_example_and_paths():
    g = torch.tensor([[1.0, 0.0], [-1.0, 0.1], [0.0, 1.0], [1.0, 1.0]])
    # Pairs of {0, 1, 3}: <g0,g1> = -1 (conflict), <g0,g3> = 1, <g1,g3> = -0.9 (conflict): 2 of 3.
    idx = torch.tensor([0, 1, 3])
    frac = conflict_fraction(g, idx)
    assert frac.dim() == 0 and abs(float(frac) - 2 / 3) < 1e-7
    assert abs(float(conflict_fraction(g @ g.T, idx, is_gram=True)) - 2 / 3) < 1e-7
    assert float(conflict_fraction(g, torch.tensor([2]))) == 0.0
    assert float(conflict_fraction(g, torch.tensor([], dtype=torch.long))) == 0.0
    with pytest.raises(ValueError, match="square"):
        conflict_fraction(g, idx, is_gram=True)


@pytest.mark.parametrize("seed", range(3))
def test_conflict_fraction_matches_pair_loop(seed):
    features, _, _ = make_instance(seed, 20, dim=4)
    idx = torch.randperm(20, generator=torch.Generator().manual_seed(seed))[:9]
    pairs = [(i, j) for a, i in enumerate(idx.tolist()) for j in idx.tolist()[a + 1 :]]
    expected = sum(float(features[i] @ features[j]) < 0 for i, j in pairs) / len(pairs)
    assert abs(float(conflict_fraction(features, idx)) - expected) < 1e-12
