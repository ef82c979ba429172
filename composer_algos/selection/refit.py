"""Exact refits of the weights on a fixed support: Lawson–Hanson NNLS and the incremental active-set state of OMP."""

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

from composer_algos.selection.gram_rows import GramRows

log = logging.getLogger(__name__)

__all__ = ["refit_exact", "default_grad_tol", "ActiveSetState"]


def default_grad_tol(mu_N: torch.Tensor) -> torch.Tensor:
    """Gradients below this count as zero in KKT checks: ``100 * eps * max|mu|`` (0-dim tensor)."""
    eps = torch.finfo(mu_N.dtype).eps
    scale = mu_N.abs().max() if mu_N.numel() else mu_N.new_zeros(())
    return 100.0 * eps * torch.clamp(scale, min=torch.finfo(mu_N.dtype).tiny)


def refit_exact(
    gram_SS: torch.Tensor,
    mu_S: torch.Tensor,
    *,
    ridge_abs: float = 0.0,
    v0_S: torch.Tensor | None = None,
    grad_tol: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Exact non-negative maximiser of ``Phi(v) = <v, mu> - (1/2) v^T (K + ridge I) v`` on a support.

    Lawson–Hanson active-set method in Gram form: grow the passive (positive) set by the most
    violating KKT coordinate, solve the passive system by Cholesky, and step back to feasibility
    when a coordinate turns non-positive. Warm-started from ``v0_S`` when given. Terminates in at
    most ``3 S + 10`` outer iterations; candidates whose Cholesky pivot vanishes (dependent
    columns at ``ridge_abs = 0``) or that cannot enter numerically are left at zero. Host-side
    control flow with one Cholesky factorisation per active-set change (``O(P^3)`` each): cheap
    warm-started, but a cold start on a large support costs about ``S^4 / 12``; the OMP builds
    large supports with ``ActiveSetState`` and calls this only when the active set shrinks.

    Args:
        gram_SS: ``(S, S)`` PSD Gram block of the support.
        mu_S: ``(S,)`` linear term on the support.
        ridge_abs: absolute value added to the diagonal (default 0.0).
        v0_S: optional ``(S,)`` non-negative warm start.
        grad_tol: gradients at or below this are treated as zero (default ``default_grad_tol``).

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
    passive = _solve_passive(kr_SS, mu_S, v_S, passive, blocked)
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
        after = _solve_passive(kr_SS, mu_S, v_S, passive, blocked)
        if j not in after:
            # The entering coordinate left at once: rounding broke the Lawson–Hanson invariant.
            blocked.add(j)
        passive = after
    else:
        log.warning("refit_exact: active-set iteration cap (%d) reached; the refit may be inexact", 3 * m + 10)
    return v_S


class ActiveSetState:
    """Exact refit state that OMP grows one element at a time (inverse-Cholesky updates).

    Keeps the active set ``A`` (positive weights) of the selected set ``S``, the NEGATED inverse
    Cholesky factor ``Wn = -L^{-1}`` of ``K_AA + ridge I = L L^T``, the K rows of the active
    elements, the optimal ``v_A`` and the gradient ``grad = mu - K_{:,A} v_A`` over the pool.

    ``add(j)`` selects ``j``. Appending ``j`` to ``A`` costs two matrix-vector products with ``Wn``
    (``r = Wn k_Aj``, ``q = Wn^T r = K_AA^{-1} k_Aj``; the signs cancel), the Schur complement
    ``s = K_jj + ridge - r.r`` and, in closed form, the new optimum ``z_j = grad_j / s``,
    ``z_A = v_A - z_j q`` and gradient ``grad - z_j (K_{:,j} - K_{:,A} q)``; the new row of ``Wn``
    is ``[q^T, -1] / sqrt(s)``. No triangular solve, ``O(N A)`` work and about 20 small kernels
    per round, written into preallocated buffers. ONE host sync per round confirms that
    ``z > 0`` and that every selected-but-inactive element keeps a non-positive gradient, so
    ``v`` is the exact NNLS optimum on ``S``; the same sync returns ``j`` so the selection and
    the active set are tracked on the host. Otherwise (a weight hit zero, a dependent column) it
    falls back to ``refit_exact`` warm-started at the current ``v`` and refactors: ``O(A^3)``,
    rare. ``finalize()`` re-solves the final active system with a fresh Cholesky factor to remove
    the rounding the updates accumulate.

    Args:
        gram: the Gram rows (no ridge); the row of each added element must be available.
        mu_N: ``(N,)`` linear term.
        capacity: the most elements that will be selected (buffer size ``M``).
        ridge_abs: absolute ridge added to the diagonal of ``K_AA``.
        grad_tol: 0-dim tensor, gradients at or below it count as zero.
    """

    def __init__(
        self,
        gram: GramRows,
        mu_N: torch.Tensor,
        capacity: int,
        ridge_abs: float,
        grad_tol: torch.Tensor,
    ) -> None:
        n = gram.n
        dev, dt = mu_N.device, mu_N.dtype
        # Rows of K (row i valid once ensured; every selected element's row is) and diag(K).
        self.gram_NN = gram.gram_NN
        self.mu_N = mu_N
        self.ridge_abs = float(ridge_abs)
        self.grad_tol = grad_tol
        self.grad_tol_f = float(grad_tol)
        # Schur complements at or below this (relative to K_jj) mean j depends on the active set.
        self.pivot_tol = 64.0 * torch.finfo(dt).eps
        self.diag_ridge_N = gram.diag_N + self.ridge_abs
        cap1 = capacity + 1
        self.rows_MN = torch.zeros(cap1, n, dtype=dt, device=dev)  # K rows of active elements
        self.wneg_MM = torch.zeros(cap1, cap1, dtype=dt, device=dev)  # -L^{-1}, lower triangular
        # Invariants: v_M[a:] == 0 and qext_M[a] == -1, so one addcmul gives (z_A, z_j) and one
        # mul gives the new row of -L^{-1}. z_M is the scratch that becomes v_M on acceptance.
        self.v_M = torch.zeros(cap1, dtype=dt, device=dev)
        self.z_M = torch.zeros(cap1, dtype=dt, device=dev)
        self.qext_M = torch.full((cap1,), -1.0, dtype=dt, device=dev)
        self.grad_N = mu_N.clone()
        self.grad_scratch_N = torch.empty_like(mu_N)
        self.inactive_N = torch.zeros(n, dtype=torch.bool, device=dev)  # selected at weight 0
        self.sel: list[int] = []  # selection order (host)
        self.act: list[int] = []  # active set in factor order (host)
        self.a = 0  # active count
        self.m = 0  # selected count
        self.num_inactive = 0
        self.slow_refits = 0

    @property
    def sel_M(self) -> torch.Tensor:
        """The selection in pick order as a device tensor."""
        return torch.tensor(self.sel, dtype=torch.long, device=self.mu_N.device)

    def add(self, j1: torch.Tensor, g_j: torch.Tensor | None = None) -> int:
        """Select pool element ``j1`` (shape ``(1,)`` int64) and refit exactly on the new support.

        Args:
            j1: the element to add.
            g_j: optional ``(1,)`` ``grad_N[j]`` (saves a gather when the caller has it).

        Returns:
            ``j`` as a Python int (it travels with the round's one host sync).
        """
        a = self.a
        rows_a1 = self.rows_MN[a : a + 1]
        torch.index_select(self.gram_NN, 0, j1, out=rows_a1)
        row_N = rows_a1.view(-1)
        rows_A = self.rows_MN[:a]
        wneg_AA = self.wneg_MM[:a, :a]
        # K_Aj is column j of the active rows (K is symmetric): no index of A needed on device.
        r_A = torch.mv(wneg_AA, rows_A.index_select(1, j1).view(-1))
        q_A = self.qext_M[:a]
        torch.mv(wneg_AA.T, r_A, out=q_A)
        k_jj = self.diag_ridge_N.index_select(0, j1)
        schur = k_jj - torch.dot(r_A, r_A)
        if g_j is None:
            g_j = self.grad_N.index_select(0, j1)
        z_j = g_j / schur
        qext_A1 = self.qext_M[: a + 1]
        z_A1 = torch.addcmul(self.v_M[: a + 1], qext_A1, z_j, value=-1.0, out=self.z_M[: a + 1])
        # grad - z_j (K_{:,j} - K_{:,A} q): the gradient at the new optimum.
        u_N = torch.addmv(row_N, rows_A.T, q_A, alpha=-1.0)
        torch.addcmul(self.grad_N, u_N, z_j, value=-1.0, out=self.grad_scratch_N)
        parts = [g_j, schur, k_jj, z_A1.amin(0, keepdim=True), j1.to(g_j.dtype)]
        if self.num_inactive > 0:
            # Selected elements at weight 0 must keep a non-positive gradient (KKT).
            viol = ((self.grad_scratch_N > self.grad_tol) & self.inactive_N).any()
            parts.append(viol.view(1).to(g_j.dtype))
        flags = torch.cat(parts).tolist()
        g_f, schur_f, kjj_f, zmin_f, j_f = flags[:5]
        j_int = int(j_f)
        self.sel.append(j_int)
        self.m += 1
        if not g_f > self.grad_tol_f:
            # Non-positive gradient: the current v stays optimal on S + j with w_j = 0.
            self._mark_inactive(j1)
            return j_int
        independent = schur_f > self.pivot_tol * kjj_f
        if independent and zmin_f > 0 and (len(flags) == 5 or flags[5] == 0):
            torch.mul(qext_A1, torch.rsqrt(schur), out=self.wneg_MM[a, : a + 1])
            # The scratch buffers become the state; their tails are already zero (see __init__).
            self.v_M, self.z_M = self.z_M, self.v_M
            self.grad_N, self.grad_scratch_N = self.grad_scratch_N, self.grad_N
            self.act.append(j_int)
            self.a = a + 1
            return j_int
        self._mark_inactive(j1)
        self._slow_refit()
        return j_int

    def _mark_inactive(self, j1: torch.Tensor) -> None:
        """Record a selected element that stays at weight 0."""
        self.inactive_N.index_fill_(0, j1, True)
        self.num_inactive += 1

    def finalize(self) -> None:
        """Re-solve the active system with a fresh Cholesky factor; full refit if a weight flips."""
        a = self.a
        if a == 0:
            return
        act_A = self._act_tensor()
        kr_AA = self.rows_MN[:a].index_select(1, act_A)
        kr_AA = kr_AA + self.ridge_abs * torch.eye(a, dtype=kr_AA.dtype, device=kr_AA.device)
        chol_AA, info = torch.linalg.cholesky_ex(kr_AA)
        v_A = torch.cholesky_solve(self.mu_N[act_A].unsqueeze(1), chol_AA).squeeze(1)
        grad_N = torch.addmv(self.mu_N, self.rows_MN[:a].T, v_A, alpha=-1.0)
        ok = (info == 0) & (v_A > 0).all() & ~((grad_N > self.grad_tol) & self.inactive_N).any()
        if bool(ok):
            self.v_M[:a] = v_A
            self.grad_N = grad_N
        else:
            self._slow_refit()

    def _slow_refit(self) -> None:
        """Full Lawson–Hanson on ``S`` from the current ``v``, then rebuild the factor."""
        self.slow_refits += 1
        sel_S = self.sel_M
        v_S = self.weights_on(sel_S)
        gram_SS = self.gram_NN[sel_S.unsqueeze(1), sel_S.unsqueeze(0)]
        v_S = refit_exact(gram_SS, self.mu_N[sel_S], ridge_abs=self.ridge_abs, v0_S=v_S, grad_tol=self.grad_tol)
        self._rebuild(sel_S[v_S > 0])

    def _rebuild(self, act_A: torch.Tensor) -> None:
        """Refactor ``K_AA + ridge I`` for a new active set and re-solve on it."""
        a = act_A.shape[0]
        self.a = a
        self.act = act_A.tolist()
        self.v_M.zero_()
        self.z_M.zero_()
        self.qext_M.fill_(-1.0)
        self.inactive_N.zero_()
        self.inactive_N[self.sel_M] = True
        self.inactive_N[act_A] = False
        self.num_inactive = self.m - a
        self.rows_MN[:a] = self.gram_NN.index_select(0, act_A)
        if a == 0:
            self.grad_N = self.mu_N.clone()
            return
        kr_AA = self.rows_MN[:a].index_select(1, act_A)
        kr_AA = kr_AA + self.ridge_abs * torch.eye(a, dtype=kr_AA.dtype, device=kr_AA.device)
        chol_AA, info = torch.linalg.cholesky_ex(kr_AA)
        if int(info) != 0:
            raise RuntimeError(f"ActiveSetState: active Gram block lost definiteness (info={int(info)})")
        eye_AA = torch.eye(a, dtype=kr_AA.dtype, device=kr_AA.device)
        self.wneg_MM[:a, :a] = -torch.linalg.solve_triangular(chol_AA, eye_AA, upper=False)
        self.v_M[:a] = torch.cholesky_solve(self.mu_N[act_A].unsqueeze(1), chol_AA).squeeze(1)
        self.grad_N = torch.addmv(self.mu_N, self.rows_MN[:a].T, self.v_M[:a], alpha=-1.0)

    def weights_on(self, idx_S: torch.Tensor) -> torch.Tensor:
        """The current ``v`` at pool positions ``idx_S`` (zero for inactive ones)."""
        v_N = self.mu_N.new_zeros(self.mu_N.shape[0])
        v_N[self._act_tensor()] = self.v_M[: self.a]
        return v_N[idx_S]

    def _act_tensor(self) -> torch.Tensor:
        """The active set (factor order) as a device tensor."""
        return torch.tensor(self.act, dtype=torch.long, device=self.mu_N.device)

    def scaled_objective(self) -> torch.Tensor:
        """``Phi(v)`` with the true ``K`` (no ridge), from ``K_AA v_A = mu_A - grad_A``."""
        act_A = self._act_tensor()
        v_A = self.v_M[: self.a]
        mu_A = self.mu_N[act_A]
        return 0.5 * (torch.dot(v_A, mu_A) + torch.dot(v_A, self.grad_N[act_A]))


def _solve_passive(
    kr_SS: torch.Tensor,
    mu_S: torch.Tensor,
    v_S: torch.Tensor,
    passive: list[int],
    blocked: set[int],
) -> list[int]:
    """Lawson–Hanson inner loop: make ``v`` the optimum on a passive set with positive entries.

    Updates ``v_S`` in place and returns the (possibly smaller) passive set.
    """
    while passive:
        idx_P = torch.tensor(passive, dtype=torch.long, device=kr_SS.device)
        chol_PP, info = torch.linalg.cholesky_ex(kr_SS[idx_P][:, idx_P])
        bad = int(info)
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
