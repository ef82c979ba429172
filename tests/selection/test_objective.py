"""The Gram matrix: the panelled lower-triangle GEMMs give G G^T, exactly symmetric, in every size regime."""

from __future__ import annotations

import pytest
import torch

from composer_algos.selection import compute_gram
from tests.selection.reference import objective_terms


@pytest.mark.parametrize("n", [1, 7, 255, 256, 300, 1031])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compute_gram_is_the_exactly_symmetric_gram(n, dtype):
    gen = torch.Generator().manual_seed(n)
    features = torch.randn(n, 24, generator=gen, dtype=torch.float64)
    gram = compute_gram(features.to(dtype))
    assert gram.dtype == dtype and gram.shape == (n, n)
    assert torch.equal(gram, gram.T)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(gram.double(), features @ features.T, rtol=tol, atol=tol)


def test_compute_gram_matches_the_row_by_row_reference():
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(40, 6, generator=gen, dtype=torch.float64)
    ref, _ = objective_terms(features, torch.zeros(6, dtype=torch.float64), eta=0.0)
    torch.testing.assert_close(compute_gram(features), ref, rtol=1e-13, atol=1e-13)


def _gram_block_by_block(features_ND: torch.Tensor) -> torch.Tensor:
    """compute_gram as it was before its diagonal blocks were symmetrised as one batch (2026-11-28): each block in turn."""
    n = features_ND.shape[0]
    panel = max(128, n // 8)
    gram_NN = torch.empty(n, n, dtype=features_ND.dtype)
    for lo in range(0, n, panel):
        hi = min(lo + panel, n)
        gram_NN[lo:hi, :hi] = features_ND[lo:hi] @ features_ND[:hi].T
    for lo in range(0, n, panel):
        hi = min(lo + panel, n)
        gram_NN[:lo, lo:hi] = gram_NN[lo:hi, :lo].T
        block = gram_NN[lo:hi, lo:hi]
        gram_NN[lo:hi, lo:hi] = 0.5 * (block + block.T)
    return gram_NN


@pytest.mark.parametrize("n", [256, 300, 1031, 2048])
def test_the_batched_diagonal_blocks_give_the_block_by_block_gram_bit_for_bit(n):
    """The diagonal blocks symmetrised as one strided batch (fewer kernels on a GPU) are the same arithmetic: the
    Gram, and so every selection made from it, is unchanged bit for bit, with a remainder block (300, 1031) or none."""
    features = torch.randn(n, 64, generator=torch.Generator().manual_seed(n)) / 8
    assert torch.equal(compute_gram(features), _gram_block_by_block(features))
