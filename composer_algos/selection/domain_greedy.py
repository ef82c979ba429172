"""Independent per-domain baselines: ID (GREATS inside each domain) and IWD (weighted OMP inside each domain)."""

# Shape legend: N pool size, D feature dim, C domains, S selected count.

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from composer_algos.selection.capacities import resolve_capacities
from composer_algos.selection.greats import greats_greedy
from composer_algos.selection.objective import binary_utility, compute_gram
from composer_algos.selection.partitionsel import PartitionSelOptions, run_weighted_selection
from composer_algos.selection.types import (
    SelectionResult,
    check_finite,
    empty_result,
    finish_result,
    parse_options,
    validate_inputs,
)

log = logging.getLogger(__name__)

__all__ = ["select_id", "select_iwd"]


@dataclass(frozen=True, kw_only=True)
class _NoOptions:
    """ID takes no options."""


def select_id(
    *,
    features: torch.Tensor | None,
    val_feature: torch.Tensor | None,
    domain_ids: torch.Tensor,
    num_domains: int,
    kappa: int,
    eta: float,
    generator: torch.Generator | None,
    capacities: torch.Tensor | None = None,
    gram: torch.Tensor | None = None,
    **options,
) -> SelectionResult:
    """ID: GREATS run separately inside each domain with budget ``kappa_c``.

    Implemented as one greedy over the partition matroid with the block-diagonal Gram (pairs from
    different domains do not interact), which gives every domain exactly its own GREATS pick
    sequence. The generator is never used.

    Args:
        features: ``(N, D)`` features (required).
        val_feature: ``(D,)`` validation feature (required).
        domain_ids: ``(N,)`` domain ids.
        num_domains: ``C``.
        kappa: the budget.
        eta: the learning rate (>= 0).
        generator: unused.
        capacities: ``(C,)`` budgets; proportional ones when None.
        gram: optional precomputed ``G G^T``.
        **options: none are accepted.

    Returns:
        The selection; ``objective`` is ``f_ID(S) = sum_c U_c(1_{S_c})``, the sum over domains
        of each domain's GREATS utility (no cross-domain pair terms); ``weights`` is None.
    """
    parse_options("id", _NoOptions, options)
    inputs = validate_inputs(
        "id",
        features=features,
        val_feature=val_feature,
        domain_ids=domain_ids,
        num_domains=num_domains,
        kappa=kappa,
        eta=eta,
        capacities=capacities,
        gram=gram,
        needs_features=True,
        needs_validation=True,
    )
    if inputs.k == 0:
        return empty_result(inputs, num_domains, with_weights=False)
    assert inputs.features is not None and inputs.val_feature is not None
    dom_N = inputs.domain_ids
    gram_NN = inputs.gram if inputs.gram is not None else compute_gram(inputs.features)
    block_NN = gram_NN * (dom_N.unsqueeze(1) == dom_N.unsqueeze(0))
    align_N = inputs.features @ inputs.val_feature
    check_finite("id", diag_K=torch.diagonal(gram_NN), align=align_N)
    caps_C = resolve_capacities("id", inputs.capacities, dom_N, num_domains, inputs.k)
    sel_S = greats_greedy(block_NN, align_N, inputs.eta, inputs.k, domain_ids_N=dom_N, capacities_C=caps_C)
    objective = binary_utility(sel_S, block_NN, align_N, inputs.eta)
    return finish_result(sel_S, dom_N, num_domains, objective=objective)


def select_iwd(
    *,
    features: torch.Tensor | None,
    val_feature: torch.Tensor | None,
    domain_ids: torch.Tensor,
    num_domains: int,
    kappa: int,
    eta: float,
    generator: torch.Generator | None,
    capacities: torch.Tensor | None = None,
    gram: torch.Tensor | None = None,
    **options,
) -> SelectionResult:
    """IWD: the weighted objective with independent domains, OMP inside each domain with ``kappa_c``.

    ``f_IWD(S) = sum_c max { U_c(w_c) : w_c >= 0, supp(w_c) in S_c }``, i.e. PartitionSel with the
    cross-domain blocks of ``K`` set to zero: the OMP then never couples domains, and each domain
    gets the pick sequence of its own OMP. Same options as ``partitionsel``.

    Args:
        features: ``(N, D)`` features (required).
        val_feature: ``(D,)`` validation feature (required).
        domain_ids: ``(N,)`` domain ids.
        num_domains: ``C``.
        kappa: the budget.
        eta: the learning rate (>= 0).
        generator: used only by ``pick="randomized"``.
        capacities: ``(C,)`` budgets; proportional ones when None.
        gram: optional precomputed ``G G^T`` (the full one; the blocks are taken here).
        **options: see ``PartitionSelOptions``.

    Returns:
        The selection with weights (``w``; ``v`` at ``eta == 0``) and ``objective = f_IWD(S)``.
    """
    opts = parse_options("iwd", PartitionSelOptions, options)
    inputs = validate_inputs(
        "iwd",
        features=features,
        val_feature=val_feature,
        domain_ids=domain_ids,
        num_domains=num_domains,
        kappa=kappa,
        eta=eta,
        capacities=capacities,
        gram=gram,
        needs_features=True,
        needs_validation=True,
    )
    return run_weighted_selection("iwd", inputs, num_domains, opts, generator, block_diagonal=True)
