"""Random baselines: a uniform subset of the pool, or uniform within per-domain capacities."""

# Shape legend: N pool size, C domains, S selected count.

from __future__ import annotations

import logging

import torch

from composer_algos.selection.types import NoOptions, SelectionInputs, SelectionResult, strategy

log = logging.getLogger(__name__)

__all__ = ["select_random", "select_random_stratified"]


@strategy("random", needs_features=False, needs_validation=False)
def select_random(
    inputs: SelectionInputs, opts: NoOptions, *, num_domains: int, generator: torch.Generator | None
) -> SelectionResult:
    """A uniformly random subset of ``k = min(kappa, n)`` pool examples.

    Draws one ``randperm(n)`` from ``generator`` on the generator's device (a fresh default
    generator, hence a fixed sequence, when None). Features, ``eta`` and ``capacities`` are unused
    and the features are not checked, so this is the fallback when they are broken. Takes no options.

    Returns:
        The selection, with ``weights`` and ``objective`` None.
    """
    gen = generator if generator is not None else torch.Generator(device=inputs.device)
    perm_N = torch.randperm(inputs.n, generator=gen, device=gen.device).to(inputs.device, non_blocking=True)
    return inputs.finish(perm_N[: inputs.k])


@strategy("random_stratified", needs_features=False, needs_validation=False)
def select_random_stratified(
    inputs: SelectionInputs, opts: NoOptions, *, num_domains: int, generator: torch.Generator | None
) -> SelectionResult:
    """Uniformly random within the same per-domain capacities as PartitionSel.

    Every example gets a uniform random key from ``generator`` (one ``rand(n)`` on the generator's
    device); the examples are scanned in key order and kept while their domain has capacity, until
    ``k`` are kept. When the capacities sum to ``k`` this is a uniform sample of ``kappa_c``
    examples from every domain. Vectorised: two stable sorts give each example its key rank inside
    its domain. ``capacities`` are proportional ones when None; features are unused and not
    checked. Takes no options.

    Returns:
        The selection, with ``weights`` and ``objective`` None.
    """
    dom_N = inputs.domain_ids
    caps_C = inputs.resolve_capacities().to(inputs.device, non_blocking=True)
    gen = generator if generator is not None else torch.Generator(device=inputs.device)
    keys_N = torch.rand(inputs.n, generator=gen, device=gen.device).to(inputs.device, non_blocking=True)
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
    return inputs.finish(sel_S)
