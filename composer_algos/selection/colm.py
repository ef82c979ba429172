"""CoLM (Nguyen et al., 2024): keep small sources whole, pick facility-location medoids inside the others."""

# Shape legend: N pool size, D feature dim, C domains (sources), S selected count.

from __future__ import annotations

import logging

import torch

from composer_algos.selection.capacities import compute_capacities
from composer_algos.selection.objective import compute_gram
from composer_algos.selection.segments import count_per_domain, segmented_argmax_mask
from composer_algos.selection.types import (
    NoOptions,
    SelectionInputs,
    SelectionResult,
    count_domains,
    strategy,
)

log = logging.getLogger(__name__)

__all__ = ["select_colm", "colm_budgets"]


@strategy("colm", needs_features=True, needs_validation=False, gram_suffices=True)
def select_colm(
    inputs: SelectionInputs, opts: NoOptions, *, num_domains: int, generator: torch.Generator | None
) -> SelectionResult:
    """CoLM mini-batch coreset: small sources whole, facility-location medoids in the big ones.

    A source is *small* when the pool holds fewer of it than an equal share of the budget,
    ``n_c < k / C_present`` (our reading of "fewer than its budget"; an equal share is the only
    per-source budget a source can fall short of, since proportional budgets never exceed
    ``n_c``). Small sources are kept whole; the rest of the budget is split over the big sources
    in proportion to their pool counts, rounded as ``compute_capacities`` rounds PartitionSel's
    capacities (unbiased with the step's ``generator``; largest remainder without one). Inside
    each big source the greedy
    facility-location (medoid) objective ``F(A) = sum_i max_{j in A} (d_max - ||g_i - g_j||)``
    is maximised, ``d_max`` the largest same-source distance, so each pick is the example that
    most reduces the sum of distances to the nearest chosen medoid. The sources run in
    lockstep (one segmented argmax per round, ``O(N^2)`` per round). ``val_feature``, ``eta`` and
    ``capacities`` are unused (CoLM sets its own budgets, see ``colm_budgets``).

    Returns:
        The selection; ``objective`` is the facility-location value ``F`` summed over the big
        sources; ``info["small_sources"]`` is the ``(C,)`` bool mask of sources kept whole.
    """
    dom_N = inputs.domain_ids
    n, device = inputs.n, inputs.device
    gram_NN = inputs.gram
    if gram_NN is None:
        assert inputs.features is not None
        gram_NN = compute_gram(inputs.features)
    inputs.check_finite(diag_K=torch.diagonal(gram_NN))
    # The budgets are host arithmetic: on the host counts when the caller's ids came from there.
    counts_C = inputs.domain_counts_host if inputs.domain_counts_host is not None else count_domains(dom_N, num_domains)
    small_C, budgets_C = colm_budgets(counts_C, inputs.k, generator)
    rounds = int(budgets_C.max()) if budgets_C.numel() else 0
    small_C, budgets_C = small_C.to(device, non_blocking=True), budgets_C.to(device, non_blocking=True)
    small_N = small_C.index_select(0, dom_N)

    same_NN = dom_N.unsqueeze(1) == dom_N.unsqueeze(0)
    nu_N = torch.diagonal(gram_NN)
    dist_NN = (nu_N.unsqueeze(1) + nu_N.unsqueeze(0) - 2.0 * gram_NN).clamp_min(0.0).sqrt()
    big_pair_NN = same_NN & ~small_N.unsqueeze(1)
    d_max = torch.where(big_pair_NN, dist_NN, torch.zeros_like(dist_NN)).max()
    # Similarity within big sources only; zero across sources and on small-source rows.
    sim_NN = torch.where(big_pair_NN, d_max - dist_NN, torch.zeros_like(dist_NN))
    del dist_NN

    best_N = torch.zeros(n, dtype=gram_NN.dtype, device=device)
    taken_N = small_N.clone()
    rem_C = budgets_C.clone()
    for _ in range(rounds):
        open_N = (rem_C.index_select(0, dom_N) > 0) & ~taken_N
        gains_N = (sim_NN - best_N.unsqueeze(1)).clamp_min(0.0).sum(0)
        picked_N = segmented_argmax_mask(gains_N, open_N, dom_N, num_domains)
        taken_N |= picked_N
        rem_C -= count_per_domain(picked_N, dom_N, num_domains)
        best_N = torch.maximum(best_N, torch.where(picked_N.unsqueeze(0), sim_NN, torch.zeros_like(sim_NN)).amax(1))
    # Exactly k are taken (the small sources whole, every budget filled: budgets never exceed a
    # source's count): their positions ascending, without nonzero's host sync.
    sel_S = torch.argsort((~taken_N).to(torch.uint8), stable=True)[: inputs.k]
    return inputs.finish(sel_S, objective=best_N.sum(), info={"small_sources": small_C})


def colm_budgets(
    pool_counts_C: torch.Tensor, k: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which sources are small (kept whole) and the medoid budget of every big source.

    Args:
        pool_counts_C: ``(C,)`` examples of each source in the pool.
        k: the number of examples to select (``<=`` the pool size).
        generator: the step's generator, for the unbiased rounding of ``compute_capacities``; None
            (default) for its deterministic largest remainder.

    Returns:
        ``(small_C, budgets_C)``: a bool mask of small sources (``0 < n_c < k / C_present``) and
        int64 medoid budgets (0 for small and absent sources) summing to ``k - sum_small n_c``.
    """
    present = int((pool_counts_C > 0).sum())
    small_C = (pool_counts_C > 0) & (pool_counts_C * present < k)
    big_counts_C = torch.where(small_C, torch.zeros_like(pool_counts_C), pool_counts_C)
    budget = k - int(pool_counts_C[small_C].sum())
    return small_C, compute_capacities(big_counts_C, budget, generator=generator)
