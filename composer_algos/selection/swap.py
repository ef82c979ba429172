"""Swap refinement: exchange a selected example for an unselected one of its domain while f(S) rises."""

# Shape legend: N pool size, S selected count, A active (positive-weight) count, U unselected count.

from __future__ import annotations

import logging
import math
import time

import torch

from composer_algos.selection.gram_rows import GramRows, as_gram_rows
from composer_algos.selection.refit import default_grad_tol, refit_exact
from composer_algos.selection.threads import single_thread_on_cpu

log = logging.getLogger(__name__)

__all__ = ["refine_swap", "estimate_swap_gains"]


def refine_swap(
    gram: torch.Tensor | GramRows,
    mu_N: torch.Tensor,
    domain_ids_N: torch.Tensor,
    sel_S: torch.Tensor,
    v_S: torch.Tensor,
    *,
    ridge_abs: float = 0.0,
    max_rounds: int = 32,
    max_checks: int = 16,
    time_budget_s: float | None = None,
    grad_tol: torch.Tensor | None = None,
    cpu_single_thread: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Local search over same-domain swaps, with closed-form estimates and exact verification.

    Each round estimates the gain of every swap (selected ``i`` out, unselected ``j`` of the same
    domain in) in closed form (``estimate_swap_gains``, ``O(U A^2)``), then walks the
    ``max_checks`` most promising ones in order. Each is verified exactly against the CURRENT
    selection: with ``P = (K_AA + ridge I)^{-1}`` kept up to date by two rank-one updates per
    swap, the new optimum on ``A - i + j`` follows in ``O(A^2)``; it is the exact NNLS optimum on
    the new support when all its weights are positive and every zero-weight selected element keeps
    a non-positive gradient (otherwise an exact ``refit_exact`` decides, ``O(A^3)``, rare). A swap
    is made when it raises ``Phi`` by more than ``100 eps |Phi|``; several can be made per round
    (a candidate whose ``i`` or ``j`` already moved this round is skipped). The search stops after
    a round without a swap, after ``max_rounds`` rounds, or when the time budget runs out. Domain
    counts never change and ``f(S)`` never decreases. When every selected weight is positive the
    estimates are upper bounds of the true gains, so a round whose candidates all have
    non-positive estimates proves a local optimum.

    With a lazy ``GramRows`` only the rows of the selected elements and of the verified
    candidates are read (the candidates' missing rows are computed in one GEMM per round).

    Args:
        gram: ``(N, N)`` Gram matrix (no ridge), or its ``GramRows``.
        mu_N: ``(N,)`` linear term.
        domain_ids_N: ``(N,)`` int64 domain ids.
        sel_S: ``(S,)`` current selection.
        v_S: ``(S,)`` its optimal scale-free weights.
        ridge_abs: absolute ridge of the refits (default 0.0).
        max_rounds: the most estimate rounds (default 32).
        max_checks: candidate swaps verified per round (default 16).
        time_budget_s: optional wall-clock budget (makes the result machine-dependent).
        grad_tol: KKT tolerance of the refits (default ``default_grad_tol(mu_N)``).
        cpu_single_thread: run the verifications with one intra-op thread on CPU (process-wide,
            restored afterwards; see ``single_thread_on_cpu``); the estimate GEMM keeps the
            caller's thread count. Default False.

    Returns:
        ``(sel_S, v_S, phi, info)`` with the scale-free objective ``Phi`` (true K, no ridge) and
        ``info`` holding ``swaps`` and ``swap_rounds``.
    """
    rows = as_gram_rows(gram)
    gram_NN, n, k, device = rows.gram_NN, rows.n, sel_S.shape[0], mu_N.device
    tol = default_grad_tol(mu_N) if grad_tol is None else grad_tol
    rel_tol = 100.0 * torch.finfo(mu_N.dtype).eps
    start = time.perf_counter()
    swaps = rounds = 0
    sel_S, v_S = sel_S.clone(), v_S.clone()
    while 0 < k < n and rounds < max_rounds:
        if time_budget_s is not None and time.perf_counter() - start > time_budget_s:
            break
        rounds += 1
        with single_thread_on_cpu(device, cpu_single_thread):
            state = _SwapState(rows, mu_N, sel_S, v_S, ridge_abs, float(tol))
        if not state.ok:
            log.warning("refine_swap: singular active Gram block (ridge %g); stopping the swap search", ridge_abs)
            break
        unsel_U, est_US = estimate_swap_gains(rows, mu_N, domain_ids_N, sel_S, v_S, ridge_abs=ridge_abs, p_AA=state.p_AA)
        sel_S, v_S, made = _verify_swaps(state, rows, unsel_U, est_US, k, max_checks, rel_tol, device, cpu_single_thread)
        swaps += made
        if made == 0:
            break
    v_S, phi_true = _polished(gram_NN, mu_N, sel_S, v_S, ridge_abs, tol, refit=swaps > 0)
    info = {"swaps": torch.tensor(swaps, device=device), "swap_rounds": torch.tensor(rounds, device=device)}
    return sel_S, v_S, phi_true, info


def _polished(
    gram_NN: torch.Tensor,
    mu_N: torch.Tensor,
    sel_S: torch.Tensor,
    v_S: torch.Tensor,
    ridge_abs: float,
    tol: torch.Tensor,
    *,
    refit: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights (refit when swaps were made) and the true objective ``Phi`` (no ridge) of the selection."""
    if refit:
        # Polish: the rank-one updates accumulate rounding; one warm-started exact refit removes it.
        gram_SS = gram_NN[sel_S.unsqueeze(1), sel_S.unsqueeze(0)]
        v_S = refit_exact(gram_SS, mu_N[sel_S], ridge_abs=ridge_abs, v0_S=v_S, grad_tol=tol)
    gram_SS = gram_NN[sel_S.unsqueeze(1), sel_S.unsqueeze(0)]
    return v_S, torch.dot(v_S, mu_N[sel_S]) - 0.5 * torch.dot(v_S, gram_SS @ v_S)


def _verify_swaps(
    state: _SwapState,
    rows: GramRows,
    unsel_U: torch.Tensor,
    est_US: torch.Tensor,
    k: int,
    max_checks: int,
    rel_tol: float,
    device: torch.device,
    cpu_single_thread: bool,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One round's verification: the `max_checks` best estimates in order, each swap made where it gains.

    A candidate whose ``i`` or ``j`` already moved this round is skipped. Returns the selection, its
    weights and the swaps made.
    """
    top = torch.topk(est_US.flatten(), min(max_checks, est_US.numel()))
    moved_i: set[int] = set()
    moved_u: set[int] = set()
    made = 0
    unsel = unsel_U.tolist()
    top_values, top_indices = top.values.tolist(), top.indices.tolist()
    # The K rows of every candidate that may be verified, in one batch.
    rows.ensure([unsel[flat // k] for est, flat in zip(top_values, top_indices) if math.isfinite(est)])
    with single_thread_on_cpu(device, cpu_single_thread):
        for est, flat in zip(top_values, top_indices):
            if not math.isfinite(est) or est <= rel_tol * abs(state.phi):
                break
            u, i = divmod(flat, k)
            if i in moved_i or u in moved_u:
                continue
            if state.ok and state.try_swap(i, unsel[u], rel_tol):
                moved_i.add(i)
                moved_u.add(u)
                made += 1
        sel_S, v_S = state.selection()
    return sel_S, v_S, made


def estimate_swap_gains(
    gram: torch.Tensor | GramRows,
    mu_N: torch.Tensor,
    domain_ids_N: torch.Tensor,
    sel_S: torch.Tensor,
    v_S: torch.Tensor,
    *,
    ridge_abs: float = 0.0,
    p_AA: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form gain of every same-domain swap, assuming the positive weights stay positive.

    With ``A`` the positive-weight part of ``S``, ``P = (K_AA + ridge I)^{-1}``, ``B = K_UA P``,
    the gradient ``g_j = mu_j - K_jA v_A`` and the Schur complement ``s_j = K_jj + ridge - B_j K_Aj``:
    removing ``i in A`` costs ``v_i^2 / (2 P_ii)`` and moves ``g_j`` to ``g_j + (v_i / P_ii) B_ji``
    and ``s_j`` to ``s_j + B_ji^2 / P_ii``; adding ``j`` then gains ``max(0, g)^2 / (2 s)``.
    Removing a zero-weight ``i`` costs nothing. Exact when the unconstrained optimum on
    ``A - i + j`` is positive, an upper bound otherwise when ``A = S``. ``O(U A^2)``.

    Args:
        gram: ``(N, N)`` Gram matrix, or its ``GramRows`` (the selected rows must be available).
        mu_N: ``(N,)`` linear term.
        domain_ids_N: ``(N,)`` domain ids.
        sel_S: ``(S,)`` selection.
        v_S: ``(S,)`` its optimal weights.
        ridge_abs: absolute ridge.
        p_AA: optional precomputed ``P`` for the positive positions of ``v_S`` in order.

    Returns:
        ``(unsel_U, est_US)``: the unselected pool positions and the estimated gain of swapping
        ``unsel_U[u]`` in for ``sel_S[i]`` (``-inf`` across domains).
    """
    rows = as_gram_rows(gram)
    gram_NN = rows.gram_NN
    n = rows.n
    dt = gram_NN.dtype
    unsel_mask_N = torch.ones(n, dtype=torch.bool, device=gram_NN.device)
    unsel_mask_N.index_fill_(0, sel_S, False)
    unsel_U = torch.nonzero(unsel_mask_N).flatten()
    ia_A = torch.nonzero(v_S > 0).flatten()
    act_A = sel_S[ia_A]
    v_A = v_S[ia_A]
    a = act_A.shape[0]
    diag_U = rows.diag_N[unsel_U] + ridge_abs
    # K_UA via whole rows of A (contiguous copies; K is symmetric), then the U columns.
    k_UA = gram_NN.index_select(0, act_A).index_select(1, unsel_U).T
    grad_U = mu_N[unsel_U] - k_UA @ v_A
    if a > 0:
        if p_AA is None:
            eye_AA = torch.eye(a, dtype=dt, device=gram_NN.device)
            kr_AA = gram_NN[act_A.unsqueeze(1), act_A.unsqueeze(0)] + ridge_abs * eye_AA
            p_AA = torch.cholesky_inverse(torch.linalg.cholesky(kr_AA))
        b_UA = k_UA @ p_AA
        schur_U = diag_U - (b_UA * k_UA).sum(1)
    else:
        b_UA = k_UA
        schur_U = diag_U
    floor_U = 64.0 * torch.finfo(dt).eps * diag_U.clamp_min(torch.finfo(dt).tiny)
    schur_U = torch.maximum(schur_U, floor_U)
    add_only_U = grad_U.clamp_min(0.0).square() / (2.0 * schur_U)
    est_US = add_only_U.unsqueeze(1).expand(-1, sel_S.shape[0]).contiguous()
    if a > 0:
        pd_A = torch.diagonal(p_AA)
        g_UA = torch.addcmul(grad_U.unsqueeze(1), b_UA, (v_A / pd_A).unsqueeze(0))
        s_UA = torch.addcdiv(schur_U.unsqueeze(1), b_UA.square(), pd_A.unsqueeze(0))
        gain_UA = g_UA.clamp_min_(0.0).square_().div_(2.0 * s_UA).sub_((v_A.square() / (2.0 * pd_A)).unsqueeze(0))
        est_US.index_copy_(1, ia_A, gain_UA)
    same_US = domain_ids_N[unsel_U].unsqueeze(1) == domain_ids_N[sel_S].unsqueeze(0)
    est_US.masked_fill_(~same_US, float("-inf"))
    return unsel_U, est_US


class _SwapState:
    """The selection during one swap round: active set, ``P = (K_AA + ridge I)^{-1}``, weights, Phi.

    ``sel`` and the active positions live on the host; ``P`` and ``v_A`` on the device.
    """

    def __init__(
        self,
        gram: GramRows,
        mu_N: torch.Tensor,
        sel_S: torch.Tensor,
        v_S: torch.Tensor,
        ridge: float,
        tol: float,
    ) -> None:
        self.gram_NN = gram.gram_NN
        self.diag_N = gram.diag_N
        self.mu_N = mu_N
        self.ridge = ridge
        self.tol = tol
        self.sel = sel_S.tolist()
        self._refactor(v_S)

    def _refactor(self, v_S: torch.Tensor) -> None:
        """Rebuild the active set, ``P`` and Phi from weights aligned with ``self.sel``."""
        weights = v_S.tolist()
        self.act_pos = [p for p, w in enumerate(weights) if w > 0]  # positions in sel
        act = torch.tensor([self.sel[p] for p in self.act_pos], dtype=torch.long, device=self.mu_N.device)
        self.v_A = v_S[self.act_pos] if self.act_pos else v_S.new_zeros(0)
        a = len(self.act_pos)
        kr_AA = self.gram_NN[act.unsqueeze(1), act.unsqueeze(0)] + self.ridge * torch.eye(
            a, dtype=v_S.dtype, device=v_S.device
        )
        self.ok = True
        if a:
            chol_AA, info = torch.linalg.cholesky_ex(kr_AA)
            # A numerically singular active block (possible only at ridge 0) ends the search.
            self.ok = int(info) == 0
            self.p_AA = torch.cholesky_inverse(chol_AA)
        else:
            self.p_AA = kr_AA
        # At the ridge optimum (K_AA + ridge I) v_A = mu_A, so Phi_ridge = <v_A, mu_A> / 2.
        self.phi = 0.5 * float(torch.dot(self.v_A, self.mu_N[act])) if a else 0.0

    def _act_tensor(self) -> torch.Tensor:
        return torch.tensor([self.sel[p] for p in self.act_pos], dtype=torch.long, device=self.mu_N.device)

    def selection(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sel_S, v_S)`` as device tensors."""
        device = self.mu_N.device
        v_S = torch.zeros(len(self.sel), dtype=self.mu_N.dtype, device=device)
        if self.act_pos:
            v_S[self.act_pos] = self.v_A
        return torch.tensor(self.sel, dtype=torch.long, device=device), v_S

    def try_swap(self, i_pos: int, j: int, rel_tol: float) -> bool:
        """Replace ``sel[i_pos]`` by ``j`` if that raises Phi; exact either way (see ``refine_swap``)."""
        act = self._act_tensor()
        gram, mu = self.gram_NN, self.mu_N
        k_A = gram[j].index_select(0, act)
        b_A = self.p_AA @ k_A
        k_jj = float(self.diag_N[j]) + self.ridge
        if i_pos in self.act_pos:
            p = self.act_pos.index(i_pos)
            p_col = self.p_AA[:, p]
            p_pp = p_col[p]
            v_rest = self.v_A - (self.v_A[p] / p_pp) * p_col
            q_A = b_A - (b_A[p] / p_pp) * p_col  # K_{A-i}^{-1} k_{A-i,j}, zero at position p
            schur = k_jj - torch.dot(k_A, b_A) + b_A[p] ** 2 / p_pp
            loss = self.v_A[p] ** 2 / (2 * p_pp)
        else:
            p = None
            v_rest, q_A = self.v_A, b_A
            schur = k_jj - torch.dot(k_A, b_A)
            loss = torch.zeros((), dtype=mu.dtype, device=mu.device)
        g_j = mu[j] - torch.dot(k_A, v_rest)
        z_j = g_j / schur
        z_A = v_rest - z_j * q_A
        if p is not None:
            z_A = z_A.clone()
            z_A[p] = z_j
            new_act_pos = list(self.act_pos)
            z_new = z_A
        else:
            new_act_pos = self.act_pos + [i_pos]
            z_new = torch.cat([z_A, z_j.view(1)])
        active = set(self.act_pos)
        zero_pos = []
        if len(active) < len(self.sel):
            zero_pos = [q for q in range(len(self.sel)) if q not in active and q != i_pos]
        checks = [g_j, schur, loss, z_new.min() if z_new.numel() else g_j]
        if zero_pos:
            z_idx = torch.tensor([self.sel[q] for q in zero_pos], dtype=torch.long, device=mu.device)
            new_act = torch.tensor(
                [self.sel[q] if q != i_pos else j for q in new_act_pos], dtype=torch.long, device=mu.device
            )
            grad_z = mu[z_idx] - gram[z_idx.unsqueeze(1), new_act.unsqueeze(0)] @ z_new
            checks.append(grad_z.max())
        vals = torch.stack(checks).tolist()
        g_f, schur_f, loss_f, zmin_f = vals[:4]
        if not (g_f > self.tol and schur_f > 0):
            return False
        phi_new = self.phi - loss_f + g_f * g_f / (2.0 * schur_f)
        if zmin_f > 0 and (len(vals) == 4 or vals[4] <= self.tol):
            if not phi_new - self.phi > rel_tol * abs(self.phi):
                return False
            # Exact optimum on the new support: update P by two rank-one terms (remove i, add j).
            if p is not None:
                q_ext = q_A.clone()
                q_ext[p] = -1.0
                self.p_AA = self.p_AA - torch.outer(p_col, p_col) / p_pp + torch.outer(q_ext, q_ext) / schur
            else:
                top = torch.cat([self.p_AA + torch.outer(b_A, b_A) / schur, (-b_A / schur).unsqueeze(1)], 1)
                bottom = torch.cat([-b_A / schur, (1.0 / schur).view(1)]).unsqueeze(0)
                self.p_AA = torch.cat([top, bottom], 0)
            self.v_A = z_new
            self.act_pos = new_act_pos
            self.sel[i_pos] = j
            self.phi = phi_new
            return True
        # A weight would leave the support or a zero weight would want to enter: refit exactly.
        cand = list(self.sel)
        cand[i_pos] = j
        cand_t = torch.tensor(cand, dtype=torch.long, device=mu.device)
        _, v_S = self.selection()
        v_S[i_pos] = 0.0
        gram_SS = gram[cand_t.unsqueeze(1), cand_t.unsqueeze(0)]
        v_new = refit_exact(gram_SS, mu[cand_t], ridge_abs=self.ridge, v0_S=v_S, grad_tol=self.tol)
        phi_exact = float(_phi(cand_t, v_new, gram, mu, self.ridge))
        if not phi_exact - self.phi > rel_tol * abs(self.phi):
            return False
        self.sel = cand
        self._refactor(v_new)
        return True


def _phi(
    sel_S: torch.Tensor, v_S: torch.Tensor, gram_NN: torch.Tensor, mu_N: torch.Tensor, ridge_abs: float
) -> torch.Tensor:
    """``Phi`` including the ridge, the quantity the refits maximise."""
    gram_SS = gram_NN[sel_S.unsqueeze(1), sel_S.unsqueeze(0)]
    return torch.dot(v_S, mu_N[sel_S]) - 0.5 * (torch.dot(v_S, gram_SS @ v_S) + ridge_abs * torch.dot(v_S, v_S))
