"""Two-sided sketches: parity with explicit P_out G P_in^T, unbiased Gram, error shrinking with the sketch size."""

from __future__ import annotations

import pytest
import torch

from composer_algos.features import (
    capture_layer_signals,
    choose_cut_module,
    per_example_grads,
    resolve_targets,
    sketch_layer_grads,
    sketch_matrices,
)
from tests.common.models import tiny_llama
from tests.features.helpers import make_batch


@pytest.mark.parametrize("with_bias", [False, True])
def test_sketch_matches_explicit_projection_of_full_gradient(with_bias):
    gen = torch.Generator().manual_seed(0)
    n, T, O, I, K, J = 3, 7, 10, 6, 4, 5
    a = torch.randn(n, T, I, generator=gen, dtype=torch.float64)
    delta = torch.randn(n, T, O, generator=gen, dtype=torch.float64)
    P_out, P_in = sketch_matrices(3, 1, O, I + with_bias, K, J, dtype=torch.float64)
    got = sketch_layer_grads(a, delta, P_out, P_in)
    for i in range(n):
        G = torch.zeros(O, I + with_bias, dtype=torch.float64)
        for t in range(T):
            a_t = torch.cat([a[i, t], torch.ones(1, dtype=torch.float64)]) if with_bias else a[i, t]
            G += torch.outer(delta[i, t], a_t)
        torch.testing.assert_close(got[i], (P_out @ G @ P_in.T).reshape(-1))


def test_sketch_matrices_seeded_rademacher():
    P_out, P_in = sketch_matrices(7, 2, 20, 30, 8, 6)
    again_out, again_in = sketch_matrices(7, 2, 20, 30, 8, 6)
    other_out, _ = sketch_matrices(7, 3, 20, 30, 8, 6)
    assert torch.equal(P_out, again_out) and torch.equal(P_in, again_in)
    assert not torch.equal(P_out, other_out), "the layer index must change the projection"
    assert not torch.equal(P_out[:, :20], P_in[:, :20]), "the two sides must be independent"
    torch.testing.assert_close(P_out.abs(), torch.full_like(P_out, 8**-0.5))
    torch.testing.assert_close(P_in.abs(), torch.full_like(P_in, 6**-0.5))


def _grams(k: int, seeds: range):
    model = tiny_llama(seed=4, dtype=torch.float64).eval()
    batch = make_batch(n=8, seed=5)
    targets = resolve_targets(model, target_modules=["down_proj", "gate_proj"])
    exact = per_example_grads(model, batch, targets, mode="exact")
    exact_gram = sum(x @ x.T for x in exact.values())
    # The end-to-end sketch path once (checked against the capture below), then cheap re-sketches.
    first = per_example_grads(model, batch, targets, mode="sketch", sketch_dim=k, seed=seeds[0])
    signals, _ = capture_layer_signals(model, batch, targets, choose_cut_module(model, targets))
    sketch_grams = []
    for s in seeds:
        sk = {}
        for t, (a, delta) in zip(targets, signals):
            P_out, P_in = sketch_matrices(s, t.index, t.d_out, t.d_in, k, k, dtype=torch.float64)
            sk[t.name] = sketch_layer_grads(a, delta, P_out, P_in)
        if s == seeds[0]:
            for name, x in first.items():
                torch.testing.assert_close(sk[name], x)
        assert all(x.shape == (8, k * k) for x in sk.values())
        sketch_grams.append(sum(x @ x.T for x in sk.values()))
    return exact_gram, torch.stack(sketch_grams)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_sketched_gram_is_unbiased():
    exact_gram, grams = _grams(k=16, seeds=range(200))
    err = _rel(grams.mean(dim=0), exact_gram)
    print(f"seed-averaged relative Gram error {err:.4f}")
    assert err < 0.05, f"seed-averaged sketched Gram is {err:.3f} (Frobenius, relative) from the exact Gram"


def test_sketch_error_shrinks_with_sketch_size():
    errors = []
    for k in (4, 16, 48):
        exact_gram, grams = _grams(k=k, seeds=range(20))
        errors.append(sum(_rel(g, exact_gram) for g in grams) / len(grams))
    print(f"mean single-seed Gram errors for k=4,16,48: {errors}")
    assert errors[0] > errors[1] > errors[2], f"mean single-seed Gram errors by sketch size: {errors}"
    assert errors[2] < 0.5 * errors[0]
