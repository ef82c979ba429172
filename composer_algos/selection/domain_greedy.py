"""Independent per-domain baselines: ID (GREATS inside each domain) and IWD (weighted OMP inside each domain)."""

# Shape legend: N pool size, D feature dim, C domains, S selected count.

from __future__ import annotations

import logging

import torch

from composer_algos.selection.greats import greats_greedy
from composer_algos.selection.objective import binary_utility, compute_gram
from composer_algos.selection.partitionsel import PartitionSelOptions, run_weighted_selection
from composer_algos.selection.types import NoOptions, SelectionInputs, SelectionResult, strategy

log = logging.getLogger(__name__)

__all__ = ["select_id", "select_iwd"]


@strategy("id", needs_features=True, needs_validation=True)
def select_id(
    inputs: SelectionInputs, opts: NoOptions, *, num_domains: int, generator: torch.Generator | None
) -> SelectionResult:
    """ID: GREATS run separately inside each domain with budget ``kappa_c``.

    Implemented as one greedy over the partition matroid with the block-diagonal Gram (pairs from
    different domains do not interact), which gives every domain exactly its own GREATS pick
    sequence. The generator is never used.

    Returns:
        The selection; ``objective`` is ``f_ID(S) = sum_c U_c(1_{S_c})``, the sum over domains
        of each domain's GREATS utility (no cross-domain pair terms); ``weights`` is None.
    """
    assert inputs.features is not None and inputs.val_feature is not None
    dom_N = inputs.domain_ids
    gram_NN = inputs.gram if inputs.gram is not None else compute_gram(inputs.features)
    block_NN = gram_NN * (dom_N.unsqueeze(1) == dom_N.unsqueeze(0))
    align_N = inputs.features @ inputs.val_feature
    inputs.check_finite(diag_K=torch.diagonal(gram_NN), align=align_N)
    caps_C = inputs.resolve_capacities().to(inputs.device, non_blocking=True)
    sel_S = greats_greedy(block_NN, align_N, inputs.eta, inputs.k, domain_ids_N=dom_N, capacities_C=caps_C)
    objective = binary_utility(sel_S, block_NN, align_N, inputs.eta)
    return inputs.finish(sel_S, objective=objective)


@strategy("iwd", options=PartitionSelOptions, needs_features=True, needs_validation=True, weighted=True)
def select_iwd(
    inputs: SelectionInputs, opts: PartitionSelOptions, *, num_domains: int, generator: torch.Generator | None
) -> SelectionResult:
    """IWD: the weighted objective with independent domains, OMP inside each domain with ``kappa_c``.

    ``f_IWD(S) = sum_c max { U_c(w_c) : w_c >= 0, supp(w_c) in S_c }``, i.e. PartitionSel with the
    cross-domain blocks of ``K`` set to zero: the OMP then never couples domains, and each domain
    gets the pick sequence of its own OMP. Same options as ``partitionsel``.

    Returns:
        The selection with weights (``w``; ``v`` at ``eta == 0``) and ``objective = f_IWD(S)``.
    """
    return run_weighted_selection("iwd", inputs, num_domains, opts, generator, block_diagonal=True)
