"""Random baselines: a uniform subset of the pool, or uniform within per-domain capacities."""

# Shape legend: N pool size, C domains, S selected count.

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from composer_algos.selection.capacities import resolve_capacities
from composer_algos.selection.types import (
    SelectionInputs,
    SelectionResult,
    empty_result,
    finish_result,
    parse_options,
    validate_inputs,
)

log = logging.getLogger(__name__)

__all__ = ["select_random", "select_random_stratified"]


@dataclass(frozen=True, kw_only=True)
class _NoOptions:
    """The random baselines take no options."""


def select_random(
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
    """A uniformly random subset of ``k = min(kappa, n)`` pool examples.

    Draws one ``randperm(n)`` from ``generator`` on the generator's device (a fresh default
    generator, hence a fixed sequence, when None). Features, ``eta`` and ``capacities`` are unused
    and the features are not checked, so this is the fallback when they are broken.

    Args:
        features: unused.
        val_feature: unused.
        domain_ids: ``(N,)`` domain ids.
        num_domains: ``C``.
        kappa: the budget.
        eta: unused (validated).
        generator: the randomness.
        capacities: ignored.
        gram: unused.
        **options: none are accepted.

    Returns:
        The selection, with ``weights`` and ``objective`` None.
    """
    parse_options("random", _NoOptions, options)
    inputs = _inputs("random", domain_ids, num_domains, kappa, eta, capacities, features, gram)
    if inputs.k == 0:
        return empty_result(inputs, num_domains, with_weights=False)
    gen = generator if generator is not None else torch.Generator(device=inputs.device)
    perm_N = torch.randperm(inputs.n, generator=gen, device=gen.device).to(inputs.device)
    return finish_result(perm_N[: inputs.k], inputs.domain_ids, num_domains)


def select_random_stratified(
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
    """Uniformly random within the same per-domain capacities as PartitionSel.

    Every example gets a uniform random key from ``generator`` (one ``rand(n)`` on the generator's
    device); the examples are scanned in key order and kept while their domain has capacity, until
    ``k`` are kept. When the capacities sum to ``k`` this is a uniform sample of ``kappa_c``
    examples from every domain. Vectorised: two stable sorts give each example its key rank inside
    its domain.

    Args:
        features: unused.
        val_feature: unused.
        domain_ids: ``(N,)`` domain ids.
        num_domains: ``C``.
        kappa: the budget.
        eta: unused (validated).
        generator: the randomness.
        capacities: ``(C,)`` capacities; proportional ones when None.
        gram: unused.
        **options: none are accepted.

    Returns:
        The selection, with ``weights`` and ``objective`` None.
    """
    parse_options("random_stratified", _NoOptions, options)
    inputs = _inputs("random_stratified", domain_ids, num_domains, kappa, eta, capacities, features, gram)
    if inputs.k == 0:
        return empty_result(inputs, num_domains, with_weights=False)
    dom_N = inputs.domain_ids
    caps_C = resolve_capacities("random_stratified", inputs.capacities, dom_N, num_domains, inputs.k)
    gen = generator if generator is not None else torch.Generator(device=inputs.device)
    keys_N = torch.rand(inputs.n, generator=gen, device=gen.device).to(inputs.device)
    by_key_N = torch.sort(keys_N, stable=True).indices
    by_domain_N = torch.sort(dom_N[by_key_N], stable=True).indices
    perm_N = by_key_N[by_domain_N]  # grouped by domain, key ascending inside each domain
    counts_C = torch.bincount(dom_N, minlength=num_domains)
    starts_C = torch.cumsum(counts_C, 0) - counts_C
    rank_N = torch.empty_like(perm_N)
    rank_N[perm_N] = torch.arange(inputs.n, device=inputs.device) - starts_C[dom_N[perm_N]]
    keep_N = rank_N < caps_C[dom_N]
    # Among the keepable examples take the k with the smallest keys (the scan stops at k).
    masked_keys_N = torch.where(keep_N, keys_N, torch.full_like(keys_N, 2.0))
    sel_S = torch.sort(masked_keys_N, stable=True).indices[: inputs.k]
    return finish_result(sel_S, dom_N, num_domains)


def _inputs(
    strategy: str,
    domain_ids: torch.Tensor,
    num_domains: int,
    kappa: int,
    eta: float,
    capacities: torch.Tensor | None,
    features: torch.Tensor | None,
    gram: torch.Tensor | None,
) -> SelectionInputs:
    """Validation for the baselines that read no features.

    Features only fix the output device; they are not checked for NaN/inf, so these baselines
    remain a usable fallback when the features are broken.
    """
    anchor = features if features is not None else gram
    if anchor is not None and isinstance(domain_ids, torch.Tensor):
        domain_ids = domain_ids.to(anchor.device)
    return validate_inputs(
        strategy,
        features=None,
        val_feature=None,
        domain_ids=domain_ids,
        num_domains=num_domains,
        kappa=kappa,
        eta=eta,
        capacities=capacities,
        gram=None,
        needs_features=False,
        needs_validation=False,
    )
