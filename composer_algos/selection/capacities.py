"""Per-domain capacities of the partition matroid: proportional (largest remainder) or fixed fractions."""

# Shape legend: N pool size, C domains.

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

__all__ = ["compute_capacities", "resolve_capacities"]


def compute_capacities(
    pool_counts: torch.Tensor,
    kappa: int,
    fractions: torch.Tensor | Sequence[float] | None = None,
) -> torch.Tensor:
    """Split the budget ``min(kappa, n)`` over the domains of a pool.

    Proportional (``fractions=None``, the paper's "uniform constraints"): domain ``c`` gets
    ``k * n_c / n`` rounded by largest remainder, so the capacities sum to ``k = min(kappa, n)``
    and never exceed ``n_c`` (the exact quotas already satisfy ``k n_c / n <= n_c``). Ties between
    equal remainders go to the larger domain, then to the lower domain index.

    Fixed fractions: domain ``c`` gets ``k * fractions[c]`` by largest remainder; a domain whose
    share exceeds what the pool holds is capped at ``n_c`` and the freed capacity is spread over
    the other domains with a positive fraction, again proportionally (water-filling). A domain with
    fraction 0 never receives capacity.

    Edge cases: a domain absent from the pool gets 0; ``kappa >= n`` gives every domain ``n_c``
    (proportional) and ``kappa = 0`` gives zeros; a single domain gets ``min(kappa, n)``.

    Args:
        pool_counts: ``(C,)`` non-negative integer counts of each domain in the pool.
        kappa: the budget, an int >= 0.
        fractions: optional ``(C,)`` non-negative finite fractions summing to 1 (within 1e-6).

    Returns:
        ``(C,)`` int64 capacities on ``pool_counts.device``, summing to ``min(kappa, n)``.

    Raises:
        ValueError: on a bad argument, or when the fractions put all their mass on domains that
            together hold fewer than ``min(kappa, n)`` examples (the request is impossible).
    """
    if not isinstance(pool_counts, torch.Tensor) or pool_counts.dim() != 1 or pool_counts.dtype.is_floating_point:
        raise ValueError(f"`pool_counts` must be a 1-D integer tensor, got {pool_counts!r}")
    if isinstance(kappa, bool) or not isinstance(kappa, int) or kappa < 0:
        raise ValueError(f"`kappa` must be an int >= 0, got {kappa!r}")
    counts = [int(c) for c in pool_counts.tolist()]
    if any(c < 0 for c in counts):
        raise ValueError(f"`pool_counts` must be >= 0, got {counts}")
    num_domains = len(counts)
    n = sum(counts)
    k = min(kappa, n)
    if fractions is None:
        caps = _proportional(counts, k)
    else:
        caps = _from_fractions(counts, k, _check_fractions(fractions, num_domains))
    assert sum(caps) == k and all(0 <= c <= m for c, m in zip(caps, counts)), (caps, counts, k)
    return torch.tensor(caps, dtype=torch.long, device=pool_counts.device)


def resolve_capacities(
    strategy: str,
    capacities: torch.Tensor | None,
    domain_ids_N: torch.Tensor,
    num_domains: int,
    k: int,
) -> torch.Tensor:
    """The capacities a strategy works with: proportional ones, or the caller's clipped to the pool.

    Args:
        strategy: the strategy name, used in error messages.
        capacities: ``(C,)`` caller capacities or None for proportional ones.
        domain_ids_N: ``(N,)`` int64 domain ids.
        num_domains: ``C``.
        k: the number of examples to select, ``min(kappa, n)``.

    Returns:
        ``(C,)`` int64 capacities, each at most the domain's pool count, summing to at least ``k``.

    Raises:
        ValueError: when the caller's capacities admit fewer than ``k`` examples.
    """
    counts_C = torch.bincount(domain_ids_N, minlength=num_domains)
    if capacities is None:
        return compute_capacities(counts_C, k)
    caps_C = torch.minimum(capacities.to(counts_C.device), counts_C)
    room = int(caps_C.sum())
    if room < k:
        raise ValueError(
            f"{strategy}: `capacities` {capacities.tolist()} admit only {room} examples of this pool "
            f"(per-domain counts {counts_C.tolist()}) but {k} must be selected; raise the capacities "
            "or leave them None for proportional ones"
        )
    return caps_C


def _proportional(counts: list[int], k: int) -> list[int]:
    """Largest-remainder apportionment of ``k`` in proportion to ``counts`` (exact integers)."""
    n = sum(counts)
    if k == 0 or n == 0:
        return [0] * len(counts)
    base = [k * c // n for c in counts]
    rem = [k * c % n for c in counts]
    deficit = k - sum(base)
    # Every remainder is < n and they sum to deficit * n, so at least `deficit` are positive.
    order = sorted(range(len(counts)), key=lambda c: (-rem[c], -counts[c], c))
    for c in order[:deficit]:
        base[c] += 1
    return base


def _check_fractions(fractions: torch.Tensor | Sequence[float], num_domains: int) -> list[float]:
    """Validate and normalise user fractions."""
    if isinstance(fractions, torch.Tensor):
        values = [float(f) for f in fractions.reshape(-1).tolist()]
        shape_ok = fractions.dim() == 1
    else:
        try:
            values = [float(f) for f in fractions]
        except (TypeError, ValueError):
            raise ValueError(f"`fractions` must be a sequence of floats, got {fractions!r}") from None
        shape_ok = True
    if not shape_ok or len(values) != num_domains:
        raise ValueError(f"`fractions` must have one entry per domain ({num_domains}), got {values}")
    if any(not math.isfinite(f) or f < 0 for f in values):
        raise ValueError(f"`fractions` must be finite and >= 0, got {values}")
    total = sum(values)
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"`fractions` must sum to 1, got {values} (sum {total})")
    return [f / total for f in values]


def _from_fractions(counts: list[int], k: int, fractions: list[float]) -> list[int]:
    """Water-filling: apportion ``k`` by ``fractions``, capping at ``counts`` and re-spreading."""
    num_domains = len(counts)
    room = sum(c for c, f in zip(counts, fractions) if f > 0)
    if room < k:
        wanted = [c for c in range(num_domains) if fractions[c] > 0]
        raise ValueError(
            f"`fractions` {fractions} put all their mass on domains {wanted}, which hold only {room} "
            f"examples of this pool (counts {counts}), but {k} must be selected; give the other "
            "domains a positive fraction or lower kappa"
        )
    caps = [0] * num_domains
    open_ = [c for c in range(num_domains) if fractions[c] > 0]
    while k - sum(caps) > 0:
        remaining = k - sum(caps)
        alloc = _largest_remainder(remaining, [fractions[c] for c in open_])
        over = [c for c, a in zip(open_, alloc) if a > counts[c]]
        if not over:
            for c, a in zip(open_, alloc):
                caps[c] += a
            break
        for c in over:
            caps[c] = counts[c]
        open_ = [c for c in open_ if c not in over]
    return caps


def _largest_remainder(total: int, weights: list[float]) -> list[int]:
    """Split the integer ``total`` in proportion to positive ``weights``; ties go to the lower index."""
    w_sum = sum(weights)
    quotas = [total * w / w_sum for w in weights]
    base = [math.floor(q) for q in quotas]
    deficit = total - sum(base)
    order = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - base[i]), i))
    for i in order[:deficit]:
        base[i] += 1
    return base
