"""Segmented reductions over domains (per-domain argmax and counts) without host syncs."""

# Shape legend: N pool size, C domains.

from __future__ import annotations

import torch

__all__ = ["segmented_argmax_mask", "count_per_domain"]


def segmented_argmax_mask(
    score_N: torch.Tensor, open_N: torch.Tensor, domain_ids_N: torch.Tensor, num_domains: int
) -> torch.Tensor:
    """Mark, in every domain with an open element, its open element of largest score.

    Ties go to the lowest pool position. No host sync.

    Returns:
        ``(N,)`` bool mask with at most one True per domain.
    """
    n = score_N.shape[0]
    device = score_N.device
    masked_N = torch.where(open_N, score_N, torch.full_like(score_N, float("-inf")))
    best_C = torch.full((num_domains,), float("-inf"), dtype=score_N.dtype, device=device)
    best_C = best_C.scatter_reduce(0, domain_ids_N, masked_N, reduce="amax", include_self=True)
    is_best_N = open_N & (masked_N == best_C.index_select(0, domain_ids_N))
    positions_N = torch.arange(n, device=device)
    cand_N = torch.where(is_best_N, positions_N, torch.full_like(positions_N, n))
    first_C = torch.full((num_domains,), n, dtype=torch.long, device=device)
    first_C = first_C.scatter_reduce(0, domain_ids_N, cand_N, reduce="amin", include_self=True)
    picked = torch.zeros(n + 1, dtype=torch.bool, device=device)
    picked.index_fill_(0, first_C, True)  # not `picked[first_C] = True`: a sync on CUDA
    return picked[:n]


def count_per_domain(mask_N: torch.Tensor, domain_ids_N: torch.Tensor, num_domains: int) -> torch.Tensor:
    """Per-domain count of a bool mask without a host sync (a masked ``bincount`` would sync)."""
    counts_C = torch.zeros(num_domains, dtype=torch.long, device=mask_N.device)
    return counts_C.index_add_(0, domain_ids_N, mask_N.long())
