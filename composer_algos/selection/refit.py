"""Exact refit of the weights on a fixed support: Lawson–Hanson non-negative least squares in Gram form."""

# Shape legend: N pool size, S support size, A active-set size, M buffer capacity (max support).
#
# The refits maximise the scale-free Phi(v) = <v, mu> - (1/2) v^T (K + ridge I) v over v >= 0 on a
# support (v = eta * w, see objective.py). K is PSD but need not be PD (duplicates, D < N): the
# ridge keeps every Cholesky factor well defined. With ridge = 0 a candidate that is numerically
# dependent on the active set (its Cholesky pivot vanishes) is left at weight 0.

from __future__ import annotations

import logging
import math

import torch

log = logging.getLogger(__name__)

__all__ = ["refit_exact", "default_grad_tol"]


def default_grad_tol(mu_N: torch.Tensor) -> torch.Tensor:
    """Gradients below this count as zero in KKT checks: ``100 * eps * max|mu|`` (0-dim tensor)."""
    eps = torch.finfo(mu_N.dtype).eps
    scale = torch.linalg.vector_norm(mu_N, float("inf")) if mu_N.numel() else mu_N.new_zeros(())  # max |mu|
    return 100.0 * eps * torch.clamp(scale, min=torch.finfo(mu_N.dtype).tiny)


def refit_exact(
    gram_SS: torch.Tensor,
    mu_S: torch.Tensor,
    *,
    ridge_abs: float = 0.0,
    v0_S: torch.Tensor | None = None,
    grad_tol: torch.Tensor | float | None = None,
    stats: dict | None = None,
) -> torch.Tensor:
    """Exact non-negative maximiser of ``Phi(v) = <v, mu> - (1/2) v^T (K + ridge I) v`` on a support.

    Lawson–Hanson active-set method in Gram form: grow the passive (positive) set by the most
    violating KKT coordinate, solve the passive system by Cholesky, and step back to feasibility
    when a coordinate turns non-positive. Warm-started from ``v0_S`` when given. Terminates in at
    most ``3 S + 10`` outer iterations; candidates whose Cholesky pivot vanishes (dependent
    columns at ``ridge_abs = 0``) or that cannot enter numerically are left at zero. Host-side
    control flow with one Cholesky factorisation per active-set change (``O(P^3)`` each): cheap
    warm-started, but a cold start on a large support costs about ``S^4 / 12``; the OMP builds
    large supports with ``active_set.ActiveSetState`` and calls this only as a fallback.

    Args:
        gram_SS: ``(S, S)`` PSD Gram block of the support.
        mu_S: ``(S,)`` linear term on the support.
        ridge_abs: absolute value added to the diagonal (default 0.0).
        v0_S: optional ``(S,)`` non-negative warm start.
        grad_tol: gradients at or below this are treated as zero (default ``default_grad_tol``).
        stats: optional dict; the support positions left at zero because their pivot was
            numerically singular (or that could not enter) are added to its set ``"blocked"``.

    Returns:
        ``(S,)`` optimal ``v >= 0`` in the dtype of ``gram_SS``.
    """
    m = gram_SS.shape[0]
    if m == 0:
        return mu_S.new_zeros(0)
    tol = default_grad_tol(mu_S) if grad_tol is None else torch.as_tensor(grad_tol, dtype=mu_S.dtype)
    kr_SS = gram_SS + ridge_abs * torch.eye(m, dtype=gram_SS.dtype, device=gram_SS.device)
    v_S = mu_S.new_zeros(m) if v0_S is None else v0_S.clamp_min(0.0).to(mu_S.dtype).clone()
    passive = torch.nonzero(v_S > 0).flatten().tolist()
    blocked: set[int] = set()
    # Without a ridge an exactly dependent column can still factor, with a pivot at rounding level
    # and weights of 1e16: treat pivots below 64 eps of their diagonal entry as singular too.
    pivot_tol = 64.0 * torch.finfo(kr_SS.dtype).eps if ridge_abs == 0 else 0.0
    passive = _solve_passive(kr_SS, mu_S, v_S, passive, blocked, pivot_tol)
    for _ in range(3 * m + 10):
        grad_S = mu_S - kr_SS @ v_S
        cand_S = grad_S > tol
        if passive:
            cand_S[passive] = False
        if blocked:
            cand_S[list(blocked)] = False
        if not bool(cand_S.any()):
            break
        j = int(torch.where(cand_S, grad_S, torch.full_like(grad_S, -math.inf)).argmax())
        passive.append(j)
        after = _solve_passive(kr_SS, mu_S, v_S, passive, blocked, pivot_tol)
        if j not in after:
            # The entering coordinate left at once: rounding broke the Lawson–Hanson invariant.
            blocked.add(j)
        passive = after
    else:
        log.warning("refit_exact: active-set iteration cap (%d) reached; the refit may be inexact", 3 * m + 10)
    if stats is not None:
        stats.setdefault("blocked", set()).update(blocked)
    return v_S


def _solve_passive(
    kr_SS: torch.Tensor,
    mu_S: torch.Tensor,
    v_S: torch.Tensor,
    passive: list[int],
    blocked: set[int],
    pivot_tol: float = 0.0,
) -> list[int]:
    """Lawson–Hanson inner loop: make ``v`` the optimum on a passive set with positive entries.

    Updates ``v_S`` in place and returns the (possibly smaller) passive set.
    """
    while passive:
        idx_P = torch.tensor(passive, dtype=torch.long, device=kr_SS.device)
        kr_PP = kr_SS[idx_P][:, idx_P]
        chol_PP, info = torch.linalg.cholesky_ex(kr_PP)
        bad = int(info)
        if bad == 0 and pivot_tol > 0:
            small_P = torch.diagonal(chol_PP).square() <= pivot_tol * torch.diagonal(kr_PP)
            if bool(small_P.any()):
                bad = int(torch.nonzero(small_P)[0]) + 1
        if bad != 0:
            # Leading minor `bad` is singular: that coordinate depends on the earlier ones.
            drop = passive[bad - 1]
            blocked.add(drop)
            v_S[drop] = 0.0
            passive = [p for p in passive if p != drop]
            continue
        z_P = torch.cholesky_solve(mu_S[idx_P].unsqueeze(1), chol_PP).squeeze(1)
        if bool((z_P > 0).all()):
            v_S.zero_()
            v_S[idx_P] = z_P
            return passive
        # Step from the feasible v towards z until the first coordinate hits zero.
        v_P = v_S[idx_P]
        neg_P = z_P <= 0
        step_P = v_P / (v_P - z_P).clamp_min(torch.finfo(v_P.dtype).tiny)
        ratio_P = torch.where(neg_P, step_P, torch.full_like(v_P, math.inf))
        alpha = ratio_P.min().clamp(0.0, 1.0)
        v_P = v_P + alpha * (z_P - v_P)
        kill_P = (neg_P & (ratio_P <= alpha)) | (v_P <= 0)
        v_P = torch.where(kill_P, torch.zeros_like(v_P), v_P)
        v_S[idx_P] = v_P
        keep = (~kill_P).tolist()
        passive = [p for p, k in zip(passive, keep) if k]
    return passive
