"""Gradient conflicts inside a selection: the fraction of selected pairs with a negative inner product."""

# Shape legend: N pool size, D feature dim, S selected count.

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

__all__ = ["conflict_fraction"]


def conflict_fraction(
    features_or_gram: torch.Tensor, indices: torch.Tensor, *, is_gram: bool = False
) -> torch.Tensor:
    """Fraction of selected unordered pairs ``i < j`` with ``<g_i, g_j> < 0``.

    Args:
        features_or_gram: ``(N, D)`` features, or the ``(N, N)`` Gram matrix with ``is_gram=True``.
        indices: ``(S,)`` selected pool positions.
        is_gram: whether the first argument is the Gram matrix (default False).

    Returns:
        0-dim float tensor in ``[0, 1]`` on the input's device; 0 when fewer than 2 are selected.

    Raises:
        ValueError: when ``is_gram`` is set and the matrix is not square.
    """
    if is_gram and (features_or_gram.dim() != 2 or features_or_gram.shape[0] != features_or_gram.shape[1]):
        raise ValueError(
            "`features_or_gram` must be a square Gram matrix when is_gram=True, "
            f"got shape {tuple(features_or_gram.shape)}"
        )
    dtype = features_or_gram.dtype if features_or_gram.dtype.is_floating_point else torch.float32
    idx_S = indices.to(device=features_or_gram.device, dtype=torch.long)
    s = idx_S.shape[0]
    if s < 2:
        return torch.zeros((), dtype=dtype, device=features_or_gram.device)
    if is_gram:
        block_SS = features_or_gram[idx_S.unsqueeze(1), idx_S.unsqueeze(0)]
    else:
        rows_SD = features_or_gram[idx_S]
        block_SS = rows_SD @ rows_SD.T
    # The pairs i < j: the block's strict upper triangle (the rest zeroed, and 0 is no conflict).
    conflicts = (torch.triu(block_SS, diagonal=1) < 0).sum()
    pairs = s * (s - 1) // 2
    if dtype == torch.get_default_dtype():
        # An integer tensor divides in the default dtype, casting both sides as `.to(dtype)` would: one op fewer.
        return conflicts / pairs
    return conflicts.to(dtype) / pairs
