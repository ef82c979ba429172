"""Per-domain capacities of the partition matroid: proportional or fixed fractions, rounded without bias."""

# Shape legend: N pool size, C domains.

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from fractions import Fraction

import torch

log = logging.getLogger(__name__)

__all__ = ["compute_capacities", "resolve_capacities"]

# The offset u of systematic rounding is drawn on a grid of this many points when the quotas'
# common denominator is larger (float fractions): E[cap_c] is then quota_c within 2**-62.
_MAX_GRID = 2**62


def compute_capacities(
    pool_counts: torch.Tensor,
    kappa: int,
    fractions: torch.Tensor | Sequence[float] | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Split the budget ``min(kappa, n)`` over the domains of a pool.

    Proportional (``fractions=None``, the paper's "uniform constraints"): domain ``c`` has the
    exact quota ``q_c = k * n_c / n``, ``k = min(kappa, n)``. Fixed fractions: domain ``c`` has the
    quota ``k * fractions[c]``; a domain whose quota exceeds what the pool holds is capped at
    ``n_c`` and the freed budget is spread over the other domains with a positive fraction, again
    proportionally (water-filling). A domain with fraction 0 never receives capacity.

    Rounding. With a ``generator`` (what training uses), the quotas are rounded by systematic
    randomized rounding: the domains are put in a random order, one offset ``u`` is drawn, and
    domain ``c`` gets ``floor(S_c + u) - floor(S_c - q_c + u)`` where ``S_c`` is the running sum of
    the quotas in that order. Every capacity is ``floor(q_c)`` or ``ceil(q_c)``, they sum to ``k``,
    and ``E[cap_c] = q_c`` exactly, so over many steps each domain's share of the selection equals
    its share of the pools. Without a generator the rounding is deterministic largest remainder
    with ties to the larger domain, then the lower index (fractions: the lower index). That is
    biased: with a pool of ``2 kappa`` every odd ``n_c`` has remainder 0.5 and the larger domains
    win every tie, so small domains get less than their pool share step after step. Keep it only
    to reproduce old runs.

    The capacities never exceed ``n_c``: the exact quotas satisfy ``q_c <= n_c`` and ``n_c`` is an
    integer, so ``ceil(q_c) <= n_c`` too.

    Edge cases: a domain absent from the pool gets 0; ``kappa >= n`` gives every domain ``n_c``
    (proportional) and ``kappa = 0`` gives zeros; a single domain gets ``min(kappa, n)``. Domains
    with integer quotas consume no randomness beyond the one permutation and offset per call.

    Args:
        pool_counts: ``(C,)`` non-negative integer counts of each domain in the pool.
        kappa: the budget, an int >= 0.
        fractions: optional ``(C,)`` non-negative finite fractions summing to 1 (within 1e-6).
        generator: the (CPU) generator of the step, for unbiased rounding; None (default) for the
            deterministic, biased largest remainder.

    Returns:
        ``(C,)`` int64 capacities on ``pool_counts.device``, summing to ``min(kappa, n)``.

    Raises:
        ValueError: on a bad argument. When the domains with a positive fraction hold fewer than
            ``min(kappa, n)`` examples of the pool, the rest comes from the others (`_spill`, with a
            warning).
    """
    if not isinstance(pool_counts, torch.Tensor) or pool_counts.dim() != 1 or pool_counts.dtype.is_floating_point:
        raise ValueError(f"`pool_counts` must be a 1-D integer tensor, got {pool_counts!r}")
    if isinstance(kappa, bool) or not isinstance(kappa, int) or kappa < 0:
        raise ValueError(f"`kappa` must be an int >= 0, got {kappa!r}")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"`generator` must be a torch.Generator or None, got {generator!r}")
    counts = [int(c) for c in pool_counts.tolist()]
    if any(c < 0 for c in counts):
        raise ValueError(f"`pool_counts` must be >= 0, got {counts}")
    num_domains = len(counts)
    n = sum(counts)
    k = min(kappa, n)
    if generator is not None:
        if fractions is None:
            quotas = [Fraction(k * c, n) if n else Fraction(0) for c in counts]
        else:
            quotas = _water_fill(counts, k, _check_fractions(fractions, num_domains))
        caps = _systematic_round(quotas, k, generator)
    elif fractions is None:
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
    generator: torch.Generator | None = None,
    *,
    counts_C: torch.Tensor | None = None,
) -> torch.Tensor:
    """The capacities a strategy works with: proportional ones, or the caller's clipped to the pool.

    Args:
        strategy: the strategy name, used in error messages.
        capacities: ``(C,)`` caller capacities or None for proportional ones.
        domain_ids_N: ``(N,)`` int64 domain ids.
        num_domains: ``C``.
        k: the number of examples to select, ``min(kappa, n)``.
        generator: for unbiased rounding of proportional ones (see ``compute_capacities``); None
            (default) for the deterministic largest remainder.
        counts_C: the pool's ``(C,)`` count per domain when the caller has it on the host
            (``SelectionInputs.domain_counts_host``); with host capacities everything is then
            computed on the host, without a sync on an accelerator.

    Returns:
        ``(C,)`` int64 capacities, each at most the domain's pool count, summing to at least ``k``,
        on the device of the counts (the host with ``counts_C``).

    Raises:
        ValueError: when the caller's capacities admit fewer than ``k`` examples.
    """
    if counts_C is None:
        counts_C = torch.bincount(domain_ids_N, minlength=num_domains)
    if capacities is None:
        return compute_capacities(counts_C, k, generator=generator)
    caps_C = torch.minimum(capacities.to(counts_C.device, torch.long), counts_C)
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


def _systematic_round(quotas: list[Fraction], k: int, generator: torch.Generator) -> list[int]:
    """Round quotas summing to the integer ``k``: floor or ceil each, sum ``k``, ``E[cap_c] = q_c``."""
    num_domains = len(quotas)
    if num_domains == 0:
        return []
    grid = math.lcm(*(q.denominator for q in quotas))
    grid = min(grid, _MAX_GRID)
    device = generator.device
    # The order only decorrelates which domains round up together; the marginals hold for any order.
    order = torch.randperm(num_domains, generator=generator, device=device).tolist()
    # u uniform on {0, 1/grid, ..., (grid-1)/grid}: when grid is a common denominator of the
    # running sums S, P(floor(S + u) = floor(S) + 1) = frac(S) exactly, hence E[floor(S + u)] = S.
    u = Fraction(int(torch.randint(0, grid, (1,), generator=generator, device=device)), grid)
    caps = [0] * num_domains
    running, prev = Fraction(0), 0
    for c in order:
        running += quotas[c]
        cur = math.floor(running + u)
        caps[c] = cur - prev
        prev = cur
    assert running == k, (quotas, k)
    return caps


def _water_fill(counts: list[int], k: int, fractions: list[float]) -> list[Fraction]:
    """Exact quotas for ``fractions``: ``k f_c``, capped at ``counts`` with the excess re-spread (`_spill`)."""
    fractions = _spill(counts, k, fractions)
    weights = [Fraction(f) for f in fractions]
    quotas = [Fraction(0)] * len(counts)
    open_ = [c for c in range(len(counts)) if weights[c] > 0]
    remaining = Fraction(k)
    while open_:
        total = sum(weights[c] for c in open_)
        over = [c for c in open_ if remaining * weights[c] / total > counts[c]]
        if not over:
            for c in open_:
                quotas[c] = remaining * weights[c] / total
            break
        # `_spill` leaves room for k in the open domains, so some open domain absorbs the rest: the loop ends.
        for c in over:
            quotas[c] = Fraction(counts[c])
            remaining -= counts[c]
        open_ = [c for c in open_ if c not in over]
    return quotas


_SPILL_WARNING = (
    "capacities: the domains with a positive fraction held fewer than kappa examples of a pool; the rest came from "
    "the domains of fraction 0, in proportion to their pool counts (logged once)"
)


def _spill(counts: list[int], k: int, fractions: list[float]) -> list[float]:
    """`fractions`, or, when the domains with a positive fraction hold fewer than ``k`` examples of this pool, with
    the domains of fraction 0 given the rest.

    Each of those gets a weight in proportion to its pool count, so small (1e-9 of the smallest positive fraction
    over the pool) that water-filling fills every weighted domain first. Whether a pool has the room depends on
    the draw, so refusing it (as this did) stopped a run at whichever step first drew such a pool.
    """
    room = sum(c for c, f in zip(counts, fractions) if f > 0)
    if room >= k:
        return fractions
    warnings.warn(_SPILL_WARNING, RuntimeWarning, stacklevel=4)
    tiny = min(f for f in fractions if f > 0) * 1e-9 / max(sum(counts), 1)
    return [f if f > 0 else tiny * c for c, f in zip(counts, fractions)]


def _from_fractions(counts: list[int], k: int, fractions: list[float]) -> list[int]:
    """Water-filling: apportion ``k`` by ``fractions``, capping at ``counts`` and re-spreading."""
    num_domains = len(counts)
    fractions = _spill(counts, k, fractions)
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
