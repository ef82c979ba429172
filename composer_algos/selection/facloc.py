"""facloc: greedy facility location of the pool over the validation anchors (the official code's `facloc` mode)."""

# Shape legend: N pool size, V validation anchors, S selected count.

from __future__ import annotations

import logging

import torch

from composer_algos.selection.anchors import AnchorOptions, anchor_similarities
from composer_algos.selection.types import SelectionInputs, SelectionResult, strategy

log = logging.getLogger(__name__)

__all__ = ["select_facloc", "facility_location_greedy"]


@strategy(
    "facloc", options=AnchorOptions, needs_features=True, needs_validation=True, needs_validation_rows=True
)
def select_facloc(
    inputs: SelectionInputs, opts: AnchorOptions, *, num_domains: int, generator: torch.Generator | None
) -> SelectionResult:
    """Facility location over validation-anchor similarities: every anchor is covered by its most similar pick.

    Maximises ``F(A) = sum_a max_{i in A} S[a, i]`` over ``|A| = k`` by the greedy, ``S[a, i]`` the
    similarity of validation example ``a`` and pool example ``i`` (`AnchorOptions`). As in the
    official PartitionSel code (efficiency-learning/PartitionSEL at 9d33660,
    `tunix/sft/subsel/subsel.py::facility_location_old2`, mode `facloc` of
    `tunix/sft/subsel_utils.py::subset_select`), the first pick maximises ``sum_a S[a, i]`` and every
    later one the coverage gain ``sum_a max(0, S[a, i] - best_a)``; ties go to the lower position.
    One cardinality constraint over the whole pool (no per-domain capacities; the official mode is
    global too). ``O(V N)`` per round, no host sync; the generator is never used.

    Returns:
        The selection; ``objective`` is ``F(A)``; ``weights`` is None.
    """
    assert inputs.features is not None and inputs.val_rows is not None
    S_VN = anchor_similarities(inputs.val_rows, inputs.features, opts.similarity)
    inputs.check_finite(similarities=S_VN)
    sel_S, best_V = facility_location_greedy(S_VN, inputs.k)
    return inputs.finish(sel_S, objective=best_V.sum())


def facility_location_greedy(S_VN: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy facility location: ``k`` picks of columns of ``S_VN``; returns the picks and each row's coverage.

    Args:
        S_VN: ``(V, N)`` similarities (rows covered, columns candidates).
        k: picks, ``1 <= k <= N``.

    Returns:
        ``(picks_S, best_V)``: the picks in order and ``max_{i in picks} S[a, i]`` per row.
    """
    n = S_VN.shape[1]
    taken_N = torch.zeros(n, dtype=torch.bool, device=S_VN.device)
    neg_inf = torch.full((), float("-inf"), dtype=S_VN.dtype, device=S_VN.device)
    j = S_VN.sum(0).argmax().view(1)
    best_V = S_VN.index_select(1, j).squeeze(1)
    taken_N.index_fill_(0, j, True)
    picks = [j]
    for _ in range(k - 1):
        gains_N = (S_VN - best_V[:, None]).clamp_min(0.0).sum(0)
        j = torch.where(taken_N, neg_inf, gains_N).argmax().view(1)
        best_V = torch.maximum(best_V, S_VN.index_select(1, j).squeeze(1))
        taken_N.index_fill_(0, j, True)
        picks.append(j)
    return torch.cat(picks), best_V
