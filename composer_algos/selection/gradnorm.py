"""GradNorm (Katharopoulos & Fleuret, 2018): keep the kappa examples with the largest gradient-feature norm."""

# Shape legend: N pool size, D feature dim, S selected count.

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from composer_algos.selection.types import (
    SelectionResult,
    check_finite,
    empty_result,
    finish_result,
    parse_options,
    validate_inputs,
)

log = logging.getLogger(__name__)

__all__ = ["select_gradnorm"]


@dataclass(frozen=True, kw_only=True)
class _NoOptions:
    """GradNorm takes no options."""


def select_gradnorm(
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
    """Top-``k`` examples by ``||g_i||``, one global constraint.

    The paper's variant scores the Adam-normalised gradient; that normalisation belongs to the
    feature extraction, so pass the normalised features. Ties go to the lower pool position.
    ``val_feature``, ``eta``, ``capacities`` and the generator are unused.

    Args:
        features: ``(N, D)`` features, or None when ``gram`` is given (norms from its diagonal).
        val_feature: unused.
        domain_ids: ``(N,)`` domain ids (only counted in the result).
        num_domains: ``C``.
        kappa: the budget.
        eta: unused (validated).
        generator: unused.
        capacities: ignored.
        gram: optional ``G G^T``.
        **options: none are accepted.

    Returns:
        The selection; ``objective`` is the sum of the selected norms; ``weights`` is None.
    """
    parse_options("gradnorm", _NoOptions, options)
    inputs = validate_inputs(
        "gradnorm",
        features=features,
        val_feature=None,
        domain_ids=domain_ids,
        num_domains=num_domains,
        kappa=kappa,
        eta=eta,
        capacities=capacities,
        gram=gram,
        needs_features=True,
        needs_validation=False,
        gram_suffices=True,
    )
    if inputs.k == 0:
        return empty_result(inputs, num_domains, with_weights=False)
    if inputs.features is not None:
        norms_N = torch.linalg.vector_norm(inputs.features, dim=1)
    else:
        assert inputs.gram is not None
        norms_N = torch.diagonal(inputs.gram).clamp_min(0.0).sqrt()
    check_finite("gradnorm", norms=norms_N)
    # A stable descending sort keeps ties in pool order (topk does not promise that).
    sel_S = torch.sort(norms_N, descending=True, stable=True).indices[: inputs.k]
    return finish_result(sel_S, inputs.domain_ids, num_domains, objective=norms_N[sel_S].sum())
