"""The paper's APGA refit (Alg. 3): on the support system, and verbatim on the full pool vector."""

# Shape legend: N pool size, S support size, M buffer capacity (max support).
#
# Both maximise the scale-free Phi(v) = <v, mu> - (1/2) v^T (K + ridge I) v over v >= 0 with
# supp(v) in S (v = eta * w, see objective.py). In v the paper's step 1/L with L = eta ||K||_op
# becomes 1/||K||_op: the iterates are eta times the paper's.

from __future__ import annotations

import logging
import math

import torch

from composer_algos.selection.gram_rows import GramRows

log = logging.getLogger(__name__)

__all__ = ["refit_apga", "apga_iterate", "estimate_spectral_norm", "APGAState", "APGAPoolState"]

# Power iteration approaches ||K||_op from below; inflate the estimate so that the APGA step
# 1/L stays below the stability limit of Nesterov's method on quadratics (~1.33/||K||).
LIPSCHITZ_SAFETY = 1.05


def refit_apga(
    gram_SS: torch.Tensor,
    mu_S: torch.Tensor,
    *,
    v0_S: torch.Tensor | None = None,
    max_iters: int = 128,
    tol: float = 0.0,
    ridge_abs: float = 0.0,
    lipschitz: torch.Tensor | float | None = None,
    check_every: int = 8,
) -> torch.Tensor:
    """The paper's Alg. 3: accelerated projected gradient ascent on ``Phi`` over ``v >= 0``.

    Nesterov momentum ``t+ = (1 + sqrt(1 + 4 t^2)) / 2``, step ``1 / L`` with ``L`` the spectral
    norm of ``K + ridge I`` (computed exactly here when not given), projection onto ``v >= 0``.
    The paper's vector lives in ``R^N`` with zeros off the support; restricting it to the support
    is the same iteration at ``O(S^2)`` instead of ``O(N^2)`` per step.

    Args:
        gram_SS: ``(S, S)`` Gram block of the support.
        mu_S: ``(S,)`` linear term on the support.
        v0_S: optional ``(S,)`` warm start (projected onto ``v >= 0``); zeros when None.
        max_iters: iteration cap (default 128).
        tol: stop when the objective changed by at most ``tol * |Phi|`` over the last
            ``check_every`` iterations; 0 (default) runs exactly ``max_iters`` iterations with no
            host sync.
        ridge_abs: absolute value added to the diagonal (default 0.0).
        lipschitz: the Lipschitz constant ``L`` of the gradient; ``||K + ridge I||_op`` when None.
        check_every: iterations between convergence checks when ``tol > 0`` (default 8).

    Returns:
        ``(S,)`` weights ``v >= 0``.
    """
    m = gram_SS.shape[0]
    if m == 0:
        return mu_S.new_zeros(0)
    kr_SS = gram_SS + ridge_abs * torch.eye(m, dtype=gram_SS.dtype, device=gram_SS.device)
    if lipschitz is None:
        lipschitz = torch.linalg.eigvalsh(kr_SS)[-1]
    v_S = mu_S.new_zeros(m) if v0_S is None else v0_S.clamp_min(0.0).to(mu_S.dtype)
    v_S, _ = apga_iterate(kr_SS, mu_S, v_S, lipschitz, max_iters=max_iters, tol=tol, check_every=check_every)
    return v_S


def apga_iterate(
    kr_SS: torch.Tensor,
    mu_S: torch.Tensor,
    v_S: torch.Tensor,
    lipschitz: torch.Tensor | float,
    *,
    max_iters: int,
    tol: float,
    check_every: int = 8,
    support_S: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """APGA iterations from a feasible ``v_S`` with the ridge already in ``kr_SS``.

    Four kernels per iteration (``addmv``, ``addcmul``, ``clamp_min_``, ``lerp``; a fifth, the
    support mask, when ``support_S`` is given) and no host sync unless ``tol > 0``.

    Args:
        kr_SS: ``(S, S)`` system matrix ``K + ridge I``.
        mu_S: ``(S,)`` linear term.
        v_S: ``(S,)`` feasible start.
        lipschitz: the step is ``1 / lipschitz``.
        max_iters: iteration cap.
        tol: relative objective-change tolerance (0: run ``max_iters``).
        check_every: iterations between convergence checks when ``tol > 0``.
        support_S: optional ``(S,)`` float mask (1 on the support, 0 off it): the projection is
            then onto ``{v >= 0, supp(v) in support}``.

    Returns:
        ``(v_S, iterations_run)``.
    """
    inv_l = 1.0 / torch.as_tensor(lipschitz, dtype=mu_S.dtype, device=mu_S.device)
    w_S = v_S.clone()
    y_S = v_S.clone()
    t = 1.0
    last_phi = None
    it = 0
    for it in range(1, max_iters + 1):
        grad_S = torch.addmv(mu_S, kr_SS, y_S, alpha=-1.0)
        w_new = torch.addcmul(y_S, grad_S, inv_l).clamp_min_(0.0)
        if support_S is not None:
            w_new.mul_(support_S)
        t_next = 0.5 * (1.0 + math.sqrt(1.0 + 4.0 * t * t))
        # y = w+ + ((t - 1) / t+) (w+ - w) written as one lerp from w towards w+.
        y_S = torch.lerp(w_S, w_new, 1.0 + (t - 1.0) / t_next)
        w_S, t = w_new, t_next
        if tol > 0 and it % check_every == 0:
            phi = torch.dot(w_S, mu_S) - 0.5 * torch.dot(w_S, kr_SS @ w_S)
            if last_phi is not None and bool((phi - last_phi).abs() <= tol * phi.abs()):
                break
            last_phi = phi
    return w_S, it


def estimate_spectral_norm(kr_NN: torch.Tensor, iters: int = 32) -> torch.Tensor:
    """``||K||_op`` of a PSD matrix by power iteration from the all-ones vector, inflated by 5%.

    Power iteration approaches the norm from below; ``LIPSCHITZ_SAFETY`` covers the remaining gap
    (Nesterov's method on a quadratic is stable up to a step of about ``1.33 / ||K||``).

    Args:
        kr_NN: ``(N, N)`` symmetric PSD matrix.
        iters: power iterations (default 32).

    Returns:
        0-dim tensor, ``1.05 * ||K u|| / ||u||`` at the last iterate (at least ``tiny``).
    """
    tiny = torch.finfo(kr_NN.dtype).tiny
    u_N = torch.ones(kr_NN.shape[0], dtype=kr_NN.dtype, device=kr_NN.device)
    u_N = u_N / torch.linalg.vector_norm(u_N)
    est = torch.zeros((), dtype=kr_NN.dtype, device=kr_NN.device)
    for _ in range(iters):
        ku_N = kr_NN @ u_N
        est = torch.linalg.vector_norm(ku_N)
        u_N = ku_N / est.clamp_min(tiny)
    return LIPSCHITZ_SAFETY * est.clamp_min(tiny)


class APGAState:
    """APGA refit on the support system that OMP grows one element at a time.

    The paper's Alg. 3 restricted to the support: keeps the Gram block ``K_SS + ridge I`` of the
    selected set, the K rows of the selected elements and a power-iteration vector for the step
    size: ``||K_SS||_op`` is re-estimated each round by ``power_iters`` warm-started iterations and
    inflated by 5% (power iteration approaches the norm from below); the estimate never decreases
    since adding a row and column cannot lower the top eigenvalue. Each refit is warm-started from
    the previous weights with ``v_j = 0``. ``O(S^2)`` per iteration. ``APGAPoolState`` is the
    verbatim full-pool form.

    Args:
        gram: the Gram rows (the row of each added element must be available).
        mu_N: ``(N,)`` linear term.
        capacity: the most elements that will be selected.
        ridge_abs: absolute ridge added to the diagonal.
        max_iters: APGA iteration cap per refit.
        tol: APGA relative-improvement tolerance (0 runs every iteration).
        power_iters: power iterations per round for the step size (default 8).
    """

    def __init__(
        self,
        gram: GramRows,
        mu_N: torch.Tensor,
        capacity: int,
        ridge_abs: float,
        max_iters: int,
        tol: float,
        power_iters: int = 8,
    ) -> None:
        n = gram.n
        dev, dt = mu_N.device, mu_N.dtype
        self.gram_NN = gram.gram_NN
        self.mu_N = mu_N
        self.ridge_abs = float(ridge_abs)
        self.max_iters = max_iters
        self.tol = tol
        self.power_iters = power_iters
        self.kr_MM = torch.zeros(capacity, capacity, dtype=dt, device=dev)
        self.rows_MN = torch.zeros(capacity, n, dtype=dt, device=dev)
        self.mu_M = torch.zeros(capacity, dtype=dt, device=dev)
        self.v_M = torch.zeros(capacity, dtype=dt, device=dev)
        self.u_M = torch.zeros(capacity, dtype=dt, device=dev)
        self.lip = torch.zeros((), dtype=dt, device=dev)
        self.sel_M = torch.zeros(capacity, dtype=torch.long, device=dev)
        self.grad_N = mu_N.clone()
        self.m = 0
        self.iterations = 0

    def add(self, j1: torch.Tensor, g_j: torch.Tensor | None = None) -> None:
        """Select pool element ``j1`` (shape ``(1,)`` int64) and run APGA on the new support.

        Args:
            j1: the element to add.
            g_j: unused (the exact state's shortcut); accepted for a uniform interface.
        """
        m = self.m
        row_N = self.gram_NN.index_select(0, j1).squeeze(0)
        self.sel_M[m : m + 1] = j1
        self.rows_MN[m] = row_N
        k_S = row_N.index_select(0, self.sel_M[: m + 1])
        self.kr_MM[m, : m + 1] = k_S
        self.kr_MM[: m + 1, m] = k_S
        self.kr_MM[m, m] += self.ridge_abs
        self.mu_M[m] = self.mu_N.index_select(0, j1).squeeze(0)
        self.m = m + 1
        kr_SS = self.kr_MM[: m + 1, : m + 1]
        # Warm-started power iteration for ||K_SS||_op; the new coordinate starts at the mean.
        self.u_M[m] = 1.0 if m == 0 else self.u_M[:m].mean()
        u_S = self.u_M[: m + 1]
        u_S = u_S / torch.linalg.vector_norm(u_S).clamp_min(torch.finfo(u_S.dtype).tiny)
        est = self.lip
        for _ in range(self.power_iters):
            ku_S = kr_SS @ u_S
            est = torch.linalg.vector_norm(ku_S)
            u_S = ku_S / est.clamp_min(torch.finfo(u_S.dtype).tiny)
        self.u_M[: m + 1] = u_S
        self.lip = torch.maximum(self.lip, est)
        v_S, its = apga_iterate(
            kr_SS,
            self.mu_M[: m + 1],
            self.v_M[: m + 1],
            LIPSCHITZ_SAFETY * self.lip.clamp_min(torch.finfo(u_S.dtype).tiny),
            max_iters=self.max_iters,
            tol=self.tol,
        )
        self.iterations += its
        self.v_M[: m + 1] = v_S
        self.grad_N = torch.addmv(self.mu_N, self.rows_MN[: m + 1].T, v_S, alpha=-1.0)

    def weights_on(self, idx_S: torch.Tensor) -> torch.Tensor:
        """The current ``v`` at pool positions ``idx_S`` (all must be selected)."""
        v_N = self.mu_N.new_zeros(self.mu_N.shape[0])
        v_N[self.sel_M[: self.m]] = self.v_M[: self.m]
        return v_N[idx_S]

    def scaled_objective(self) -> torch.Tensor:
        """``Phi(v)`` with the true ``K`` (no ridge) at the current APGA weights."""
        v_S = self.v_M[: self.m]
        sel_S = self.sel_M[: self.m]
        gram_SS = self.rows_MN[: self.m].index_select(1, sel_S)
        return torch.dot(v_S, self.mu_M[: self.m]) - 0.5 * torch.dot(v_S, gram_SS @ v_S)


class APGAPoolState:
    """The paper's Alg. 3 verbatim: APGA on the full pool vector, as the authors' code runs it.

    The iterate lives in ``R^N`` (zeros off the support); every iteration takes the gradient
    ``mu - (K + ridge I) y`` with the full ``(N, N)`` Gram and projects onto
    ``{v >= 0, supp(v) in S}``: ``O(N^2)`` per iteration whatever the support size. The step is
    ``1 / L`` with ``L`` the spectral norm of the full ``K + ridge I``, estimated once per
    selection call (the paper's ``L = eta ||K||_op`` in ``w``; see ``estimate_spectral_norm``).
    Each refit is warm-started from the previous weights, the new coordinate at 0. The same
    iteration as ``APGAState`` up to the step size (``APGAState`` uses ``||K_SS||``, which is
    smaller, so it moves faster): this is the reference the exact refit is benchmarked against.

    Args:
        gram: the Gram rows (made full here).
        mu_N: ``(N,)`` linear term.
        capacity: the most elements that will be selected.
        ridge_abs: absolute ridge added to the diagonal.
        max_iters: APGA iteration cap per refit.
        tol: APGA relative-improvement tolerance (0 runs every iteration).
        lipschitz: optional step-size constant; ``estimate_spectral_norm(K + ridge I)`` when None.
    """

    def __init__(
        self,
        gram: GramRows,
        mu_N: torch.Tensor,
        capacity: int,
        ridge_abs: float,
        max_iters: int,
        tol: float,
        lipschitz: torch.Tensor | float | None = None,
    ) -> None:
        gram_NN = gram.full()
        n = gram_NN.shape[0]
        self.gram_NN = gram_NN
        self.kr_NN = gram_NN + ridge_abs * torch.eye(n, dtype=gram_NN.dtype, device=gram_NN.device)
        self.mu_N = mu_N
        self.max_iters = max_iters
        self.tol = tol
        self.lip = estimate_spectral_norm(self.kr_NN) if lipschitz is None else lipschitz
        self.support_N = torch.zeros(n, dtype=mu_N.dtype, device=mu_N.device)
        self.v_N = torch.zeros(n, dtype=mu_N.dtype, device=mu_N.device)
        self.sel_M = torch.zeros(capacity, dtype=torch.long, device=mu_N.device)
        self.grad_N = mu_N.clone()
        self.m = 0
        self.iterations = 0

    def add(self, j1: torch.Tensor, g_j: torch.Tensor | None = None) -> None:
        """Select pool element ``j1`` (shape ``(1,)`` int64) and run APGA on the full pool vector.

        Args:
            j1: the element to add.
            g_j: unused; accepted for a uniform interface.
        """
        self.sel_M[self.m : self.m + 1] = j1
        self.m += 1
        self.support_N.index_fill_(0, j1, 1.0)
        self.v_N, its = apga_iterate(
            self.kr_NN,
            self.mu_N,
            self.v_N,
            self.lip,
            max_iters=self.max_iters,
            tol=self.tol,
            support_S=self.support_N,
        )
        self.iterations += its
        # The OMP gradient mu - K v (no ridge, as for the other states).
        self.grad_N = torch.addmv(self.mu_N, self.gram_NN, self.v_N, alpha=-1.0)

    def weights_on(self, idx_S: torch.Tensor) -> torch.Tensor:
        """The current ``v`` at pool positions ``idx_S``."""
        return self.v_N[idx_S]

    def scaled_objective(self) -> torch.Tensor:
        """``Phi(v)`` with the true ``K`` (no ridge) at the current weights."""
        return torch.dot(self.v_N, self.mu_N) - 0.5 * torch.dot(self.v_N, self.gram_NN @ self.v_N)
