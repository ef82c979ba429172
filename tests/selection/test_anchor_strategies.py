"""facloc and uniprot (issue 21): hand-computed selections over validation anchors, and their contract."""

from __future__ import annotations

import math

import pytest
import torch

from composer_algos.selection import STRATEGIES
from composer_algos.selection.uniprot import partial_ot_value

# Two anchors along the axes: with similarity "dot", S[a, i] is the a-th coordinate of example i.
ANCHORS = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)


def _run(name, features, k, **opts):
    n = features.shape[0]
    return STRATEGIES[name].fn(
        features=features, val_feature=ANCHORS.mean(0), domain_ids=torch.zeros(n, dtype=torch.long), num_domains=1,
        kappa=k, eta=0.1, generator=None, val_rows=ANCHORS, **{"similarity": "dot", **opts},
    )


def test_facloc_by_hand():
    # Columns of S: g0 (1, -0.5) sum 0.5, g1 (0.6, 0.6) sum 1.2, g2 (0.9, 0) 0.9, g3 (0, 0.8) 0.8, g4 (-1, 0.9) -0.1.
    # Round 1: the largest sum, g1; coverage (0.6, 0.6).
    # Round 2: gains sum_a max(0, S - best): g0 0.4, g2 0.3, g3 0.2, g4 0.3 -> g0; coverage (1, 0.6).
    # Round 3: g2 0, g3 0.2, g4 0.3 -> g4; coverage (1, 0.9), F = 1.9. Top-k by mean similarity would take g1, g2, g3.
    feats = torch.tensor([[1.0, -0.5], [0.6, 0.6], [0.9, 0.0], [0.0, 0.8], [-1.0, 0.9]], dtype=torch.float64)
    res = _run("facloc", feats, 3)
    assert res.indices.tolist() == [0, 1, 4]
    assert float(res.objective) == pytest.approx(1.9)
    assert res.weights is None and res.domain_counts.tolist() == [3]


# a1, a2, a3 serve anchor 1 (similarity 1, 0.98, 0.96), c and d anchor 2 (0.3, 0.1); k = 4, two anchors: each
# anchor can receive k / V = 2 units of the picks' mass.
FAIR = torch.tensor([[1.0, 0.0], [0.98, 0.0], [0.96, 0.0], [0.0, 0.3], [0.0, 0.1]], dtype=torch.float64)


def test_uniprot_by_hand_spreads_the_picks_over_the_anchors():
    # Transport values (reg -> 0): {a1} 1; + a2: 1.98 (anchor 1 takes both) beats + c: 1.3; then + a3 gains 0
    # (anchor 1 is full, a3 must go to anchor 2 at similarity 0) and + c gains 0.3: c; then + a3 gains 0 and
    # + d gains 0.1: d. F = 1 + 0.98 + 0.3 + 0.1 = 2.38 up to the entropy (reg 0.01 x 4 picks x log 2 at most).
    res = _run("uniprot", FAIR, 4, reg=0.01, iters=2000)
    assert res.indices.tolist() == [0, 1, 3, 4]
    assert float(res.objective) == pytest.approx(2.38, abs=0.01 * 4 * math.log(2))
    # facloc covers anchor 1 once and anchor 2 once, then every gain is 0 and ties go to the lower index.
    assert _run("facloc", FAIR, 4).indices.tolist() == [0, 1, 2, 3]


def test_partial_ot_value_by_hand():
    reg = 0.05
    # One row, anchors not binding: reg log(sum_a exp(S_a / reg)).
    value, g = partial_ot_value(torch.tensor([[[0.7, 0.2]]], dtype=torch.float64), torch.zeros(1, 2, dtype=torch.float64), 2.0, reg, 50)
    assert float(value) == pytest.approx(reg * math.log(math.exp(0.7 / reg) + math.exp(0.2 / reg)))
    assert g.tolist() == [[0.0, 0.0]]
    # Two rows (s, 0) and anchors of capacity 1: anchor 1 takes half of each row: s + 2 reg log 2, potential g_1 = s.
    rows = torch.tensor([[[0.7, 0.0], [0.7, 0.0]]], dtype=torch.float64)
    value, g = partial_ot_value(rows, torch.zeros(1, 2, dtype=torch.float64), 1.0, reg, 500)
    assert float(value) == pytest.approx(0.7 + 2 * reg * math.log(2), abs=1e-9)
    torch.testing.assert_close(g, torch.tensor([[0.7, 0.0]], dtype=torch.float64))


def test_cosine_similarity_ignores_the_feature_scale():
    # Examples (3, 0), (0, 0.15), (0, 0.7) against anchors 4 e_1, 4 e_2. Cosine: (1, 0), (0, 1), (0, 1): round 1
    # ties at 1 (lowest index, 0), round 2 ties at gain 1 -> 1. Dot: sums 12, 0.6, 2.8 -> 0, then 2.
    feats = torch.tensor([[3.0, 0.0], [0.0, 0.15], [0.0, 0.7]], dtype=torch.float64)
    kw = dict(
        features=feats, val_feature=ANCHORS.mean(0), domain_ids=torch.zeros(3, dtype=torch.long), num_domains=1,
        kappa=2, eta=0.1, generator=None, val_rows=ANCHORS * 4.0,
    )
    assert STRATEGIES["facloc"].fn(**kw).indices.tolist() == [0, 1]
    assert STRATEGIES["facloc"].fn(**kw, similarity="dot").indices.tolist() == [0, 2]


@pytest.mark.parametrize("name", ["facloc", "uniprot"])
def test_anchor_strategies_need_validation_rows_and_reject_bad_options(name):
    feats = FAIR.clone()
    with pytest.raises(ValueError, match="needs `val_rows`"):
        STRATEGIES[name].fn(
            features=feats, val_feature=ANCHORS.mean(0), domain_ids=torch.zeros(5, dtype=torch.long), num_domains=1,
            kappa=2, eta=0.1, generator=None,
        )
    with pytest.raises(ValueError, match="similarity"):
        _run(name, feats, 2, similarity="l2")
    assert STRATEGIES[name].needs_validation_rows and not STRATEGIES[name].uses_capacities


def test_uniprot_rejects_bad_options():
    with pytest.raises(ValueError, match="`reg` must be"):
        _run("uniprot", FAIR, 2, reg=0)
    with pytest.raises(ValueError, match="`iters` must be"):
        _run("uniprot", FAIR, 2, iters=0)


@pytest.mark.parametrize("name", ["facloc", "uniprot"])
def test_anchor_strategies_fill_the_budget_and_are_deterministic(name):
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(30, 8, generator=g, dtype=torch.float64)
    rows = torch.randn(4, 8, generator=g, dtype=torch.float64)
    kw = dict(
        features=feats, val_feature=rows.mean(0), domain_ids=torch.zeros(30, dtype=torch.long), num_domains=1,
        kappa=10, eta=0.1, generator=None, val_rows=rows,
    )
    a, b = STRATEGIES[name].fn(**kw), STRATEGIES[name].fn(**kw)
    assert a.indices.numel() == 10 and a.indices.unique().numel() == 10
    assert a.indices.tolist() == b.indices.tolist()
    assert torch.isfinite(a.objective)
    empty = STRATEGIES[name].fn(**{**kw, "kappa": 0})
    assert empty.indices.numel() == 0
