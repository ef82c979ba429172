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
