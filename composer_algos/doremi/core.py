"""DoReMi's pure functional core: per-token losses, per-domain sums, excess losses and the Group DRO update."""

# Shapes: B examples, T tokens per example (T-1 after the causal shift), V vocabulary, C domains.

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from composer_algos.losses import IGNORE_INDEX
from composer_algos.losses import per_token_losses as _token_losses

log = logging.getLogger(__name__)

__all__ = [
    "IGNORE_INDEX",
    "doremi_update",
    "per_token_losses",
    "domain_sums",
    "domain_token_counts",
    "clipped_excess_sums",
    "excess_per_domain",
    "weighted_domain_loss",
    "resolve_initial_weights",
]


def doremi_update(
    alpha_C: torch.Tensor, lam_C: torch.Tensor, *, eta_dro: float = 1.0, smoothing: float = 1e-3
) -> torch.Tensor:
    """One exponentiated-gradient (Group DRO) step on the domain weights.

    `alpha' = alpha * exp(eta_dro * lam) / Z`, then `(1 - smoothing) * alpha' + smoothing / C`
    (Xie et al. 2023, Alg. 1). Computed as a softmax in log space so that large
    `eta_dro * lam` cannot overflow; a zero weight stays zero before smoothing.

    Args:
        alpha_C: Current weights on the simplex, shape (C,).
        lam_C: Per-domain excess losses (any real values), shape (C,).
        eta_dro: Step size of the exponentiated-gradient update (default 1.0).
        smoothing: Mixing weight `c` of the uniform distribution, in [0, 1] (default 1e-3).

    Returns:
        The new weights, shape (C,), same dtype and device as `alpha_C`.

    Raises:
        ValueError: If shapes differ or `smoothing` is outside [0, 1].
    """
    if alpha_C.shape != lam_C.shape or alpha_C.dim() != 1:
        raise ValueError(
            f"alpha_C and lam_C must both have shape (C,), got {tuple(alpha_C.shape)} and {tuple(lam_C.shape)}"
        )
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"`smoothing` must be in [0, 1], got {smoothing}")
    num_domains = alpha_C.shape[0]
    logits_C = torch.log(alpha_C) + eta_dro * lam_C.to(alpha_C.dtype)
    new_C = torch.softmax(logits_C, dim=0)
    return (1.0 - smoothing) * new_C + smoothing / num_domains


def per_token_losses(logits_BTV: torch.Tensor, labels_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal-LM per-token cross-entropy (``composer_algos.losses``) in DoReMi's ``(B, T-1)`` layout.

    Labels are unshifted (position t predicts label t+1) with `-100` on masked positions, as
    `transformers` causal LMs take them. The loss is computed in float32.

    Args:
        logits_BTV: Model logits, shape (B, T, V).
        labels_BT: Labels, shape (B, T), `-100` where no loss is taken.

    Returns:
        `(loss_BT1, mask_BT1)`: the per-token loss (0 on masked positions) and the float mask of
        target tokens, both of shape (B, T-1).
    """
    loss_BT, mask_BT = _token_losses(logits_BTV, labels_BT)
    # The last position has no target (loss and mask 0): drop it to keep the (B, T-1) layout.
    loss_BT1 = loss_BT[:, :-1]
    return loss_BT1, mask_BT[:, :-1].to(loss_BT1.dtype)


def domain_sums(values_BT: torch.Tensor, domain_id_B: torch.Tensor, num_domains: int) -> torch.Tensor:
    """Sum per-token values over each domain's examples (values must already be masked).

    Args:
        values_BT: Per-token values, shape (B, T); differentiable.
        domain_id_B: Domain id of each example in `[0, num_domains)`, shape (B,).
        num_domains: C.

    Returns:
        Per-domain sums, shape (C,), dtype of `values_BT`.
    """
    rows_B = values_BT.sum(dim=1)
    out_C = torch.zeros(num_domains, dtype=rows_B.dtype, device=rows_B.device)
    return out_C.index_add(0, domain_id_B.to(rows_B.device), rows_B)


def domain_token_counts(labels_BT: torch.Tensor, domain_id_B: torch.Tensor, num_domains: int) -> torch.Tensor:
    """Number of target tokens (after the causal shift) of each domain.

    Args:
        labels_BT: Unshifted labels with `-100` on masked positions, shape (B, T).
        domain_id_B: Domain ids, shape (B,).
        num_domains: C.

    Returns:
        Token counts, float64, shape (C,) (float so that they travel in the same all-reduce as the
        loss sums; exact up to 2**53 tokens).
    """
    mask_BT1 = (labels_BT[:, 1:] != IGNORE_INDEX).to(torch.float64)
    return domain_sums(mask_BT1, domain_id_B, num_domains)


def clipped_excess_sums(
    proxy_loss_BT: torch.Tensor,
    ref_loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    domain_id_B: torch.Tensor,
    num_domains: int,
) -> torch.Tensor:
    """Per-domain sums of the per-token clipped excess loss `max(0, l_proxy - l_ref)`.

    Clipping is per token, as in DoReMi. No gradient flows (the proxy loss is detached).

    Args:
        proxy_loss_BT: Proxy per-token losses, shape (B, T).
        ref_loss_BT: Reference per-token losses, shape (B, T).
        mask_BT: 1 on target tokens, 0 elsewhere, shape (B, T).
        domain_id_B: Domain ids, shape (B,).
        num_domains: C.

    Returns:
        Per-domain sums of clipped excess, float64, shape (C,).
    """
    excess_BT = (proxy_loss_BT.detach().float() - ref_loss_BT.float()).clamp_min(0.0) * mask_BT
    return domain_sums(excess_BT.to(torch.float64), domain_id_B, num_domains)


def excess_per_domain(
    excess_sum_C: torch.Tensor, count_C: torch.Tensor, last_lam_C: torch.Tensor
) -> torch.Tensor:
    """Token-mean clipped excess per domain; domains with no tokens keep their last score.

    Args:
        excess_sum_C: Per-domain sums of clipped excess (already reduced across ranks), (C,).
        count_C: Per-domain target-token counts (already reduced across ranks), (C,).
        last_lam_C: The previous step's scores, (C,).

    Returns:
        `lam_C`, shape (C,), dtype of `last_lam_C`.
    """
    present_C = count_C > 0
    mean_C = excess_sum_C / count_C.clamp_min(1.0)
    return torch.where(present_C, mean_C.to(last_lam_C.dtype), last_lam_C)


def weighted_domain_loss(loss_sum_C: torch.Tensor, count_C: torch.Tensor, alpha_C: torch.Tensor) -> torch.Tensor:
    """The Group DRO objective `sum_c alpha_c * loss_sum_c / count_c` (0 for absent domains).

    Args:
        loss_sum_C: Per-domain sums of proxy per-token losses, (C,); differentiable.
        count_C: Per-domain target-token counts, (C,).
        alpha_C: Domain weights, (C,); treated as constants.

    Returns:
        A scalar tensor in the dtype of `loss_sum_C`.
    """
    scale_C = alpha_C.detach().to(torch.float64) / count_C.to(torch.float64).clamp_min(1.0)
    return (loss_sum_C * scale_C.to(loss_sum_C.dtype)).sum()


def resolve_initial_weights(
    initial_weights: str | Mapping[str, float],
    domain_names: Sequence[str],
    natural_weights: Sequence[float] | None = None,
) -> torch.Tensor:
    """Turn the `initial_weights` option into a float64 tensor on the simplex.

    Args:
        initial_weights: "uniform", "natural" (uses `natural_weights`) or a mapping from every
            domain name to a non-negative weight (normalised here).
        domain_names: The domains, in domain-id order.
        natural_weights: Natural shares of the data in `domain_names` order; required for
            "natural".

    Returns:
        Weights, float64, shape (C,), strictly positive (a zero weight could never grow again
        under a multiplicative update, so zeros are rejected).

    Raises:
        ValueError: On an unknown option, a missing `natural_weights`, unknown or missing domain
            names, non-finite, negative or zero weights, or a wrong length.
    """
    names = list(domain_names)
    num_domains = len(names)
    if isinstance(initial_weights, str):
        if initial_weights == "uniform":
            return torch.full((num_domains,), 1.0 / num_domains, dtype=torch.float64)
        if initial_weights != "natural":
            raise ValueError(
                f"`initial_weights` must be 'uniform', 'natural' or a mapping name -> weight, got {initial_weights!r}"
            )
        if natural_weights is None:
            raise ValueError(
                "`initial_weights: natural` needs `natural_weights` (the domains' shares of the training data)"
            )
        raw = [float(x) for x in natural_weights]
        if len(raw) != num_domains:
            raise ValueError(f"`natural_weights` has {len(raw)} values for {num_domains} domains {names}")
        source = "natural_weights"
    else:
        unknown = sorted(set(initial_weights) - set(names))
        missing = [n for n in names if n not in initial_weights]
        if unknown or missing:
            raise ValueError(
                f"`initial_weights` must give a weight for every domain {names}; "
                f"unknown: {unknown}, missing: {missing}"
            )
        raw = [float(initial_weights[n]) for n in names]
        source = "initial_weights"
    w_C = torch.tensor(raw, dtype=torch.float64)
    if not torch.isfinite(w_C).all() or (w_C <= 0).any():
        raise ValueError(f"`{source}` must be finite and > 0 for every domain, got {dict(zip(names, raw))}")
    return w_C / w_C.sum()
