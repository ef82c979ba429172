"""GREATS (Wang et al., 2024): greedy on <g_i, gbar> - eta <g_i, sum_{j in S} g_j>, globally or per domain."""

# Shape legend: N pool size, D feature dim, C domains, S selected count.

from __future__ import annotations

import logging

import torch

from composer_algos.selection.objective import binary_utility, compute_gram
from composer_algos.selection.types import NoOptions, SelectionInputs, SelectionResult, strategy

log = logging.getLogger(__name__)

__all__ = ["select_greats", "greats_scores", "greats_greedy"]


@strategy("greats", needs_features=True, needs_validation=True)
def select_greats(
    inputs: SelectionInputs, opts: NoOptions, *, num_domains: int, generator: torch.Generator | None
) -> SelectionResult:
    """GREATS: greedy selection of ``k = min(kappa, n)`` examples under one cardinality constraint.

    Each round adds the unselected example with the largest ``score_i = <g_i, gbar> - eta *
    sum_{j in S} K_ij`` (the Taylor estimate of its validation-loss reduction with the Hessian
    replaced by the identity, divided by ``eta``). Domains and ``capacities`` are ignored; the
    generator is never used. Scores can be negative (the objective is not monotone).

    Returns:
        The selection; ``objective`` is the GREATS utility of the set, ``U(1_S) = sum_{i in S}
        <g_i, gbar> - eta sum_{i<j in S} K_ij`` (the sum of the greedy marginal gains, in the
        ``w`` variable with unit weights); ``weights`` is None.
    """
    assert inputs.features is not None and inputs.val_feature is not None
    gram_NN = inputs.gram if inputs.gram is not None else compute_gram(inputs.features)
    align_N = inputs.features @ inputs.val_feature
    inputs.check_finite(diag_K=torch.diagonal(gram_NN), align=align_N)
    sel_S = greats_greedy(gram_NN, align_N, inputs.eta, inputs.k)
    objective = binary_utility(sel_S, gram_NN, align_N, inputs.eta)
    return inputs.finish(sel_S, objective=objective)


def greats_scores(
    gram_NN: torch.Tensor, align_N: torch.Tensor, eta: float, selected_mask_N: torch.Tensor
) -> torch.Tensor:
    """The GREATS score of every example given a selected set: ``align - eta * K 1_S``.

    Args:
        gram_NN: ``(N, N)`` Gram matrix.
        align_N: ``(N,)`` alignments ``G gbar``.
        eta: the learning rate.
        selected_mask_N: ``(N,)`` bool mask of the selected set.

    Returns:
        ``(N,)`` scores (also defined for selected examples).
    """
    return align_N - eta * (gram_NN @ selected_mask_N.to(gram_NN.dtype))


def greats_greedy(
    gram_NN: torch.Tensor,
    align_N: torch.Tensor,
    eta: float,
    k: int,
    *,
    domain_ids_N: torch.Tensor | None = None,
    capacities_C: torch.Tensor | None = None,
) -> torch.Tensor:
    """GREATS greedy: ``k`` rounds of argmax with a running ``K 1_S`` (``O(N)`` per round, no sync).

    With ``capacities_C`` an example is only eligible while its domain has budget left (ties go
    to the lower pool position). Given a block-diagonal Gram, the domains do not interact, so each
    domain's pick sequence is exactly GREATS on that domain alone (the ``id`` baseline).

    Args:
        gram_NN: ``(N, N)`` Gram matrix.
        align_N: ``(N,)`` alignments ``G gbar``.
        eta: the learning rate.
        k: rounds (``<= N``, and ``<=`` the total capacity when capacities are given).
        domain_ids_N: ``(N,)`` int64 domain ids, required with ``capacities_C``.
        capacities_C: optional ``(C,)`` per-domain budgets.

    Returns:
        ``(k,)`` int64 pool positions in pick order.
    """
    n = gram_NN.shape[0]
    device = gram_NN.device
    penalty_N = torch.zeros(n, dtype=gram_NN.dtype, device=device)
    open_N = torch.ones(n, dtype=torch.bool, device=device)
    neg_inf = torch.full((), float("-inf"), dtype=gram_NN.dtype, device=device)
    rem_C = capacities_C.clone() if capacities_C is not None else None
    minus_one = torch.full((1,), -1, dtype=torch.long, device=device)
    picks = []
    for _ in range(k):
        eligible_N = open_N
        if rem_C is not None:
            assert domain_ids_N is not None
            eligible_N = open_N & (rem_C.index_select(0, domain_ids_N) > 0)
        score_N = torch.where(eligible_N, align_N - eta * penalty_N, neg_inf)
        j1 = score_N.argmax().view(1)
        picks.append(j1)
        open_N.index_fill_(0, j1, False)  # `open_N[j1] = False` would copy the value to the device: a sync
        if rem_C is not None:
            assert domain_ids_N is not None
            rem_C.index_add_(0, domain_ids_N.index_select(0, j1), minus_one)
        penalty_N += gram_NN.index_select(0, j1).squeeze(0)
    return torch.cat(picks) if picks else torch.zeros(0, dtype=torch.long, device=device)
