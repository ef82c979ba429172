"""Randomized-FFT compression: JL tolerance on inner products, unbiasedness, determinism, embedding when d >= D."""

from __future__ import annotations

import math

import pytest
import torch

from composer_algos.features import apply_fjlt, fjlt_project, make_fjlt_plan
from composer_algos.features.projection import next_fast_len


def _jl_eps(n_points: int, d: int) -> float:
    """Smallest eps with d >= 4 ln(n) / (eps^2/2 - eps^3/3) (Dasgupta & Gupta's JL bound)."""
    lo, hi = 1e-6, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if d >= 4 * math.log(n_points) / (mid**2 / 2 - mid**3 / 3):
            hi = mid
        else:
            lo = mid
    return hi


def _points(kind: str, n: int, D: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "gaussian":
        return torch.randn(n, D, generator=gen, dtype=torch.float64)
    if kind == "spiky":  # one-hot-ish rows: the worst case for plain subsampling, fixed by the random signs + FFT
        x = torch.zeros(n, D, dtype=torch.float64)
        x[torch.arange(n), torch.randint(0, D, (n,), generator=gen)] = 1.0
        x[:, 0] += 0.5
        return x
    if kind == "low_rank":  # correlated rows, like per-example gradients
        basis = torch.randn(3, D, generator=gen, dtype=torch.float64)
        return torch.randn(n, 3, generator=gen, dtype=torch.float64) @ basis + 0.1 * torch.randn(
            n, D, generator=gen, dtype=torch.float64
        )
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["gaussian", "spiky", "low_rank"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("D", "d"), [(3000, 256), (4099, 512)])
def test_inner_products_within_jl_tolerance(kind, seed, D, d):
    n = 24
    x = _points(kind, n, D, seed)
    x = x / x.norm(dim=1, keepdim=True)
    y = fjlt_project(x, d, seed=seed, layer_index=3)
    assert y.shape == (n, d)
    eps = _jl_eps(n, d)
    # Unit rows: the JL guarantee on the n + n^2 difference vectors bounds inner-product errors by eps.
    err = (y @ y.T - x @ x.T).abs().max().item()
    assert err <= eps, f"max inner-product error {err:.3f} exceeds the JL tolerance {eps:.3f} (n={n}, d={d})"
    norm_ratio = y.norm(dim=1)
    assert ((norm_ratio - 1).abs() <= eps).all()


def test_unbiased_over_seeds():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 777, generator=gen, dtype=torch.float64)
    gram = x @ x.T
    grams = torch.stack([(lambda y: y @ y.T)(fjlt_project(x, 64, seed=s)) for s in range(150)])
    err = ((grams.mean(0) - gram).norm() / gram.norm()).item()
    single = ((grams[0] - gram).norm() / gram.norm()).item()
    assert err < 0.05 and err < single / 5, f"seed-averaged error {err:.3f}, single-seed {single:.3f}"


def test_plan_is_a_function_of_seed_layer_and_dims():
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    a = fjlt_project(x, 100, seed=5, layer_index=2)
    torch.testing.assert_close(a, fjlt_project(x, 100, seed=5, layer_index=2), rtol=0, atol=0)
    assert not torch.allclose(a, fjlt_project(x, 100, seed=5, layer_index=1))
    assert not torch.allclose(a, fjlt_project(x, 100, seed=6, layer_index=2))
    # Rows are projected independently: projecting a subset gives the same rows.
    torch.testing.assert_close(fjlt_project(x[2:], 100, seed=5, layer_index=2), a[2:])


def test_embedding_when_target_is_wider_is_exactly_isometric():
    x = torch.randn(6, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = fjlt_project(x, 64)
    torch.testing.assert_close(y @ y.T, x @ x.T)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_summed_layer_projections_within_jl_tolerance(seed):
    gen = torch.Generator().manual_seed(seed)
    n, d = 16, 400
    full = torch.randn(n, 900 + 40 + 2500, generator=gen, dtype=torch.float64)
    full = full / full.norm(dim=1, keepdim=True)
    parts = full.split([900, 40, 2500], dim=1)
    out = torch.zeros(n, d, dtype=torch.float64)
    for i, p in enumerate(parts):
        apply_fjlt(p, make_fjlt_plan(seed, i, p.shape[1], d, dtype=torch.float64), out)
    err = (out @ out.T - full @ full.T).abs().max().item()
    eps = _jl_eps(n, d)
    assert err <= eps, f"summed per-layer projections: max inner-product error {err:.3f} > JL tolerance {eps:.3f}"


@pytest.mark.parametrize("n", [1, 2, 7, 97, 1000, 4099, 65537])
def test_next_fast_len(n):
    def smooth(m: int) -> bool:
        for p in (2, 3, 5):
            while m % p == 0:
                m //= p
        return m == 1

    got = next_fast_len(n)
    assert got >= n and smooth(got)
    assert not any(smooth(m) for m in range(n, got))
