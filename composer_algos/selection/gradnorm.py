"""GradNorm (Katharopoulos & Fleuret, 2018): keep the kappa examples with the largest gradient-feature norm."""

# Shape legend: N pool size, D feature dim, S selected count.

from __future__ import annotations

import logging

import torch

from composer_algos.selection.types import NoOptions, SelectionInputs, SelectionResult, strategy

log = logging.getLogger(__name__)

__all__ = ["select_gradnorm"]


@strategy("gradnorm", needs_features=True, needs_validation=False, gram_suffices=True)
def select_gradnorm(
    inputs: SelectionInputs, opts: NoOptions, *, num_domains: int, generator: torch.Generator | None
) -> SelectionResult:
    """Top-``k`` examples by ``||g_i||``, one global constraint.

    The paper's variant scores the Adam-normalised gradient; that normalisation belongs to the
    feature extraction, so pass the normalised features. Ties go to the lower pool position.
    ``val_feature``, ``eta``, ``capacities`` and the generator are unused.

    Returns:
        The selection; ``objective`` is the sum of the selected norms; ``weights`` is None.
    """
    if inputs.features is not None:
        norms_N = torch.linalg.vector_norm(inputs.features, dim=1)
    else:
        assert inputs.gram is not None
        norms_N = torch.diagonal(inputs.gram).clamp_min(0.0).sqrt()
    inputs.check_finite(norms=norms_N)
    # A stable descending sort keeps ties in pool order (topk does not promise that).
    sel_S = torch.sort(norms_N, descending=True, stable=True).indices[: inputs.k]
    return inputs.finish(sel_S, objective=norms_N[sel_S].sum())
