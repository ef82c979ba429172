"""Properties of f(S): monotone, weakly submodular with the paper's ratio bound, and the GREATS remark."""

from __future__ import annotations

import pytest
import torch

from composer_algos.selection import refit_exact
from composer_algos.selection.greats import greats_scores
from composer_algos.selection.objective import build_objective
from tests.selection.reference import make_instance

ETA = 0.5


def _f(gram, mu, support):
    """f(S) in the scale-free variable (Phi at the exact refit); 0 for the empty set."""
    if len(support) == 0:
        return 0.0
    idx = torch.tensor(sorted(support))
    g_ss = gram[idx][:, idx]
    v = refit_exact(g_ss, mu[idx])
    return float(v @ mu[idx] - 0.5 * v @ g_ss @ v)


def _random_sets(seed, n, sizes):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    out, start = [], 0
    for s in sizes:
        out.append(perm[start : start + s])
        start += s
    return out


@pytest.mark.parametrize("seed", range(20))
def test_f_is_monotone(seed):
    features, val_feature, _ = make_instance(seed, 16)
    gram, mu, _ = build_objective(features, val_feature, ETA)
    base, extra = _random_sets(seed, 16, [seed % 6, 3])
    f_base = _f(gram, mu, base)
    for e in extra:
        assert _f(gram, mu, base + [e]) >= f_base - 1e-12
    assert f_base >= 0.0


@pytest.mark.parametrize("seed", range(20))
def test_f_is_weakly_submodular_with_the_paper_ratio(seed):
    # sum_{a in A} Delta(a | S) >= gamma Delta(A | S) with gamma = lambda_min(K_{S u A}) / max_a K_aa
    # (restricted strong concavity over restricted smoothness on one coordinate).
    features, val_feature, _ = make_instance(seed, 16)
    if seed % 2:
        val_feature = val_feature + 0.8 * features[:4].mean(0)  # more overlap, more redundancy
    gram, mu, _ = build_objective(features, val_feature, ETA)
    base, extra = _random_sets(seed, 16, [1 + seed % 4, 2 + seed % 3])
    f_base = _f(gram, mu, base)
    joint_gain = _f(gram, mu, base + extra) - f_base
    single_gains = [_f(gram, mu, base + [a]) - f_base for a in extra]
    idx = torch.tensor(base + extra)
    gamma = float(torch.linalg.eigvalsh(gram[idx][:, idx])[0]) / float(gram.diagonal()[extra].max())
    assert gamma > 0
    assert sum(single_gains) >= gamma * joint_gain - 1e-12
    # The one-element sandwich: (g+)^2 / (2 K_aa) <= Delta(a | S) <= (g+)^2 / (2 lambda_min(K_{S+a})).
    if base:
        b = torch.tensor(sorted(base))
        v = refit_exact(gram[b][:, b], mu[b])
        grad = mu - gram[:, b] @ v
    else:
        grad = mu.clone()
    for a, gain in zip(extra, single_gains):
        g_pos = max(0.0, float(grad[a]))
        sa = torch.tensor(base + [a])
        lam = float(torch.linalg.eigvalsh(gram[sa][:, sa])[0])
        assert g_pos**2 / (2 * float(gram[a, a])) <= gain + 1e-12
        assert gain <= g_pos**2 / (2 * lam) + 1e-12


@pytest.mark.parametrize("eta", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("seed", range(5))
def test_binary_marginal_gain_equals_the_greats_score(seed, eta):
    # Paper Remark: with w in {0, 1}, U(1_{S+z}) - U(1_S) is the GREATS score of z.
    features, val_feature, _ = make_instance(seed, 12)
    gram, mu, align = build_objective(features, val_feature, eta)
    (chosen,) = _random_sets(seed, 12, [4])

    def u_binary(members):
        # U(w) = <w, mu> - (eta/2) w^T K w written out term by term for a 0/1 vector.
        total = sum(float(mu[i]) for i in members)
        total -= 0.5 * eta * sum(float(gram[i, j]) for i in members for j in members)
        return total

    mask = torch.zeros(12, dtype=torch.bool)
    mask[chosen] = True
    scores = greats_scores(gram, align, eta, mask)
    for z in range(12):
        if z in chosen:
            continue
        gain = u_binary(chosen + [z]) - u_binary(chosen)
        assert abs(gain - float(scores[z])) <= 1e-12
