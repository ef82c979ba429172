"""Per-step data selection strategies (PartitionSel and its baselines) as pure tensor functions.

Every strategy has the keyword-only signature::

    fn(*, features, val_feature, domain_ids, num_domains, kappa, eta, generator,
       capacities=None, gram=None, **options) -> SelectionResult

and is looked up by name with ``get_strategy``: the built-in ``STRATEGIES``, then the entry-point
group ``partitionsel.strategies``, through which another installed package adds a strategy (a
``StrategySpec``; the ``@strategy`` decorator gives a body the signature and the shared prologue)::

    # the plugin's pyproject.toml
    [project.entry-points."partitionsel.strategies"]
    first_k = "my_package.first_k:SPEC"

Unknown or invalid options raise ``ValueError``. Strategies without randomness never touch the
generator. See docs/selection.md.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points

from composer_algos.selection.apga import refit_apga
from composer_algos.selection.capacities import compute_capacities, resolve_capacities
from composer_algos.selection.colm import select_colm
from composer_algos.selection.conflicts import conflict_fraction
from composer_algos.selection.domain_greedy import select_id, select_iwd
from composer_algos.selection.facloc import select_facloc
from composer_algos.selection.gradnorm import select_gradnorm
from composer_algos.selection.gram_rows import GramRows
from composer_algos.selection.greats import select_greats
from composer_algos.selection.objective import build_objective, compute_gram
from composer_algos.selection.partitionsel import PartitionSelOptions, omp_select, select_partitionsel
from composer_algos.selection.random_select import select_random, select_random_stratified
from composer_algos.selection.refit import refit_exact
from composer_algos.selection.swap import refine_swap
from composer_algos.selection.types import (
    DeferredChecks,
    NoOptions,
    SelectionInputs,
    SelectionNumericsError,
    SelectionResult,
    StrategySpec,
    check_or_defer,
    count_domains,
    deferring_checks,
    finish_result,
    strategy,
)
from composer_algos.selection.uniprot import select_uniprot

log = logging.getLogger(__name__)

__all__ = [
    "ENTRY_POINT_GROUP",
    "SelectionInputs",
    "SelectionResult",
    "SelectionNumericsError",
    "StrategySpec",
    "NoOptions",
    "STRATEGIES",
    "get_strategy",
    "strategy_names",
    "strategy",
    "finish_result",
    "DeferredChecks",
    "deferring_checks",
    "check_or_defer",
    "count_domains",
    "compute_capacities",
    "resolve_capacities",
    "conflict_fraction",
    "compute_gram",
    "GramRows",
    "build_objective",
    "PartitionSelOptions",
    "omp_select",
    "refine_swap",
    "refit_exact",
    "refit_apga",
    "select_partitionsel",
    "select_greats",
    "select_id",
    "select_iwd",
    "select_gradnorm",
    "select_colm",
    "select_facloc",
    "select_uniprot",
    "select_random",
    "select_random_stratified",
]

STRATEGIES: dict[str, StrategySpec] = {
    "partitionsel": StrategySpec(select_partitionsel, needs_features=True, needs_validation=True, uses_capacities=True),
    "greats": StrategySpec(select_greats, needs_features=True, needs_validation=True, uses_capacities=False),
    "id": StrategySpec(select_id, needs_features=True, needs_validation=True, uses_capacities=True),
    "iwd": StrategySpec(select_iwd, needs_features=True, needs_validation=True, uses_capacities=True),
    "gradnorm": StrategySpec(select_gradnorm, needs_features=True, needs_validation=False, uses_capacities=False),
    "colm": StrategySpec(select_colm, needs_features=True, needs_validation=False, uses_capacities=False),
    "facloc": StrategySpec(select_facloc, needs_features=True, needs_validation=True, uses_capacities=False),
    "uniprot": StrategySpec(select_uniprot, needs_features=True, needs_validation=True, uses_capacities=False),
    "random": StrategySpec(select_random, needs_features=False, needs_validation=False, uses_capacities=False),
    "random_stratified": StrategySpec(
        select_random_stratified, needs_features=False, needs_validation=False, uses_capacities=True
    ),
}


ENTRY_POINT_GROUP = "partitionsel.strategies"


def strategy_names() -> list[str]:
    """Every strategy name: the built-ins, then those installed packages declare (none is imported)."""
    plugins = sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} - set(STRATEGIES))
    return [*STRATEGIES, *plugins]


def get_strategy(name: str) -> StrategySpec:
    """The registry entry for a strategy name: a built-in, else an entry point of ``ENTRY_POINT_GROUP``.

    A built-in name wins over an entry point of the same name (a plugin cannot replace a built-in).

    Args:
        name: one of ``strategy_names()``.

    Returns:
        Its ``StrategySpec``.

    Raises:
        ValueError: for an unknown name, listing the known ones.
        TypeError: when the entry point does not load a ``StrategySpec``, naming the entry point.
    """
    if name in STRATEGIES:
        return STRATEGIES[name]
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
    if not found:
        raise ValueError(f"unknown selection strategy {name!r}; choose one of {strategy_names()}")
    ep = found[0]
    spec = ep.load()
    if not isinstance(spec, StrategySpec):
        raise TypeError(
            f"entry point {name!r} = {ep.value!r} of group {ENTRY_POINT_GROUP!r} loads a "
            f"{type(spec).__name__}, not a composer_algos.selection.StrategySpec"
        )
    log.debug("strategy %r from entry point %s", name, ep.value)
    return spec
