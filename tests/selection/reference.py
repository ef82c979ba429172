"""Slow, obviously-correct loop references for the selection tests (never used by the library)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import torch

__all__ = [
    "make_instance",
    "objective_terms",
    "brute_force_refit",
    "brute_force_matroid_opt",
    "unconstrained_phi",
    "omp_greedy_loop",
    "apga_pool_loop",
    "omp_apga_pool_loop",
    "greats_loop",
    "largest_remainder_loop",
]


def make_instance(seed: int, n: int, dim: int = 32, num_domains: int = 3, dtype=torch.float64):
    """The issue's family: G ~ N(0, 1/D), gbar = 0.3 mean row + N(0, 1/D), uniform domains."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(n, dim, generator=gen, dtype=dtype) / dim**0.5
    val_feature = 0.3 * features.mean(0) + torch.randn(dim, generator=gen, dtype=dtype) / dim**0.5
    domain_ids = torch.randint(0, num_domains, (n,), generator=gen)
    return features, val_feature, domain_ids


def objective_terms(features, val_feature, eta):
    """K = G G^T and mu = G gbar + (eta/2) diag K, computed row by row."""
    n = features.shape[0]
    gram = torch.zeros(n, n, dtype=features.dtype)
    for i in range(n):
        for j in range(n):
            gram[i, j] = torch.dot(features[i], features[j])
    mu = torch.stack([torch.dot(features[i], val_feature) + 0.5 * eta * gram[i, i] for i in range(n)])
    return gram, mu


def unconstrained_phi(gram, mu, support, ridge=0.0):
    """(Phi, v) of the unconstrained optimum on `support` (a list of pool positions)."""
    idx = torch.tensor(list(support), dtype=torch.long)
    block = gram[idx][:, idx] + ridge * torch.eye(len(support), dtype=gram.dtype)
    v = torch.linalg.solve(block, mu[idx])
    phi = float(torch.dot(v, mu[idx]) - 0.5 * torch.dot(v, block @ v))
    return phi, v


def brute_force_refit(gram, mu, support, ridge=0.0):
    """max Phi(v) over v >= 0 on `support`: the best positive unconstrained optimum of any subset.

    The NNLS optimum is the unconstrained optimum on its positive support, and every positive
    unconstrained optimum of a subset is feasible, so the maximum over subsets is the NNLS value.

    Returns:
        (phi, v) with v aligned with `support`.
    """
    support = list(support)
    best_phi, best_v = 0.0, torch.zeros(len(support), dtype=gram.dtype)
    for r in range(1, len(support) + 1):
        for sub in itertools.combinations(range(len(support)), r):
            phi, v = unconstrained_phi(gram, mu, [support[i] for i in sub], ridge)
            if bool((v > 0).all()) and phi > best_phi:
                best_phi = phi
                best_v = torch.zeros(len(support), dtype=gram.dtype)
                best_v[list(sub)] = v
    return best_phi, best_v


def brute_force_matroid_opt(gram, mu, domain_ids, capacities):
    """max f(S) over the partition matroid (f is monotone, so over independent sets of any size).

    Enumerates every independent set R (at most capacities[c] per domain) and keeps the best
    positive unconstrained optimum, batched by size for speed; each batch entry is one plain solve.
    """
    n = gram.shape[0]
    caps = capacities.tolist()
    dom = domain_ids.tolist()
    kappa = sum(caps)
    best = 0.0
    for r in range(1, kappa + 1):
        subsets = []
        for sub in itertools.combinations(range(n), r):
            counts = [0] * len(caps)
            for i in sub:
                counts[dom[i]] += 1
            if all(c <= cap for c, cap in zip(counts, caps)):
                subsets.append(sub)
        if not subsets:
            continue
        idx = torch.tensor(subsets, dtype=torch.long)
        blocks = gram[idx.unsqueeze(2), idx.unsqueeze(1)]
        rhs = mu[idx]
        v = torch.linalg.solve(blocks, rhs)
        phi = (v * rhs).sum(1) - 0.5 * torch.einsum("bi,bij,bj->b", v, blocks, v)
        ok = (v > 0).all(1)
        if bool(ok.any()):
            best = max(best, float(phi[ok].max()))
    return best


def omp_greedy_loop(gram, mu, domain_ids, capacities, kappa, ridge=0.0):
    """Greedy OMP with a brute-force refit (with `ridge` on the diagonal) and per-candidate Python loops."""
    n = gram.shape[0]
    dom = domain_ids.tolist()
    rem = capacities.tolist()
    selected, v = [], []
    for _ in range(kappa):
        best_j, best_g = None, None
        for i in range(n):
            if i in selected or rem[dom[i]] <= 0:
                continue
            g = float(mu[i]) - sum(float(gram[i, s]) * float(w) for s, w in zip(selected, v))
            if best_g is None or g > best_g:
                best_j, best_g = i, g
        selected.append(best_j)
        rem[dom[best_j]] -= 1
        _, v_t = brute_force_refit(gram, mu, selected, ridge)
        v = v_t.tolist()
    return selected, v


def apga_pool_loop(kr, mu, support, w0, lipschitz, iters):
    """The paper's Alg. 3 written out element by element on the whole pool vector.

    `kr` is K + ridge I (nested lists or a tensor), `support` a set of pool positions, `w0` the
    start (a list over the pool). Projection onto {w >= 0, supp(w) in support}.
    """
    n = len(mu)
    w = [float(x) for x in w0]
    y = list(w)
    t = 1.0
    for _ in range(iters):
        grad = [float(mu[i]) - sum(float(kr[i][l]) * y[l] for l in range(n)) for i in range(n)]
        w_plus = [max(0.0, y[i] + grad[i] / lipschitz) if i in support else 0.0 for i in range(n)]
        t_plus = (1.0 + math.sqrt(1.0 + 4.0 * t * t)) / 2.0
        y = [w_plus[i] + (t - 1.0) / t_plus * (w_plus[i] - w[i]) for i in range(n)]
        w, t = w_plus, t_plus
    return w


def omp_apga_pool_loop(gram, mu, domain_ids, capacities, kappa, lipschitz, iters, ridge=0.0):
    """Greedy OMP (argmax of mu - K w over feasible elements) with the loop Alg. 3 refit, warm-started."""
    n = gram.shape[0]
    dom = domain_ids.tolist()
    rem = capacities.tolist()
    kr = [[float(gram[i, j]) + (ridge if i == j else 0.0) for j in range(n)] for i in range(n)]
    w = [0.0] * n
    selected = []
    for _ in range(kappa):
        grad = [float(mu[i]) - sum(float(gram[i, l]) * w[l] for l in range(n)) for i in range(n)]
        best = max((i for i in range(n) if i not in selected and rem[dom[i]] > 0), key=lambda i: (grad[i], -i))
        selected.append(best)
        rem[dom[best]] -= 1
        w = apga_pool_loop(kr, mu, set(selected), w, lipschitz, iters)
    return selected, w


def greats_loop(gram, align, eta, kappa, domain_ids=None, capacities=None):
    """GREATS greedy with explicit loops; with capacities, eligibility per domain."""
    n = gram.shape[0]
    rem = capacities.tolist() if capacities is not None else None
    dom = domain_ids.tolist() if domain_ids is not None else None
    selected = []
    for _ in range(kappa):
        best_j, best_s = None, None
        for i in range(n):
            if i in selected or (rem is not None and rem[dom[i]] <= 0):
                continue
            score = float(align[i]) - eta * sum(float(gram[i, j]) for j in selected)
            if best_s is None or score > best_s:
                best_j, best_s = i, score
        selected.append(best_j)
        if rem is not None:
            rem[dom[best_j]] -= 1
    return selected


def largest_remainder_loop(counts, kappa):
    """Proportional apportionment with exact fractions; ties to the larger domain, then lower index."""
    n = sum(counts)
    k = min(kappa, n)
    if n == 0:
        return [0] * len(counts)
    quotas = [Fraction(k * c, n) for c in counts]
    caps = [int(q) for q in quotas]
    while sum(caps) < k:
        rest = [(quotas[c] - caps[c], counts[c], -c) for c in range(len(counts)) if quotas[c] - caps[c] > 0 and caps[c] == int(quotas[c])]
        _, _, neg_c = max(rest)
        caps[-neg_c] += 1
    return caps
