"""The exact refit of greedy OMP: an incremental active-set NNLS state grown one element per round."""

# Shape legend: N pool size, S selected count, A active-set size, M slot capacity, W slots in use.
#
# Maximises the scale-free Phi(v) = <v, mu> - (1/2) v^T (K + ridge I) v over v >= 0 with supp(v)
# in S (v = eta * w, see objective.py). The active set A (positive weights) lives in SLOTS: slot h
# holds one active element, its K row, its weight and row/column h of P = (K_AA + ridge I)^{-1}.
# Free slots (never used, or freed when a weight dropped to zero) have zero P row/column and zero
# weight, so every kernel runs over the first W slots without gathering the active ones, and the
# next element to enter reuses a free slot. Entering and leaving are rank-one updates of P.

from __future__ import annotations

import functools
import logging
import struct
from typing import NamedTuple

import torch

from composer_algos.selection.gram_rows import GramRows
from composer_algos.selection.refit import refit_exact
from composer_algos.selection.types import SelectionNumericsError

log = logging.getLogger(__name__)

__all__ = ["ActiveSetState", "LawsonHansonDrop", "first_to_zero", "drop_slot", "lawson_hanson_buffers"]



class LawsonHansonDrop(NamedTuple):
    """A Lawson–Hanson step to the first weight that reaches zero (`first_to_zero`)."""

    alpha_1: torch.Tensor  # the step from x towards z, (1,)
    p_1: torch.Tensor  # the slot whose weight reaches zero first, (1,)
    p_col_W: torch.Tensor  # P's column p (a copy: P changes in `drop_slot`)
    p_pp_1: torch.Tensor  # P_pp, (1,)
    flags_3: torch.Tensor  # [any z < 0, p, P_pp] in x's dtype: what the host reads to decide


def lawson_hanson_buffers(x_W: torch.Tensor) -> LawsonHansonDrop:
    """Tensors for `first_to_zero` to write a drop into: ``x_W``'s dtype and device, its number of slots."""
    empty = functools.partial(torch.empty, dtype=x_W.dtype, device=x_W.device)
    return LawsonHansonDrop(empty(1), torch.empty(1, dtype=torch.long, device=x_W.device), empty(x_W.shape[0]), empty(1), empty(3))


def first_to_zero(
    p_WW: torch.Tensor, x_W: torch.Tensor, z_W: torch.Tensor, out: LawsonHansonDrop | None = None
) -> LawsonHansonDrop:
    """From the feasible ``x`` towards the unconstrained optimum ``z``: the first slot whose weight reaches zero.

    Free slots hold ``x = z = 0`` exactly, so only active slots can have ``z < 0``; without one the
    step is not taken (``flags_3[0]`` is 0). ``out``: the buffers to write the drop into (the device loop's, kept
    across CUDA-graph replays); None: new ones.
    """
    neg_W = z_W < 0
    ratio_W = torch.where(neg_W, x_W / (x_W - z_W).clamp_min(torch.finfo(x_W.dtype).tiny), float("inf"))
    if out is None:
        out = lawson_hanson_buffers(x_W)
    torch.min(ratio_W, 0, keepdim=True, out=(out.alpha_1, out.p_1))
    torch.index_select(p_WW, 1, out.p_1, out=out.p_col_W.view(-1, 1))
    torch.index_select(out.p_col_W, 0, out.p_1, out=out.p_pp_1)
    torch.cat([neg_W.any().view(1).to(x_W.dtype), out.p_1.to(x_W.dtype), out.p_pp_1], out=out.flags_3)
    return out


def drop_slot(p_WW: torch.Tensor, x_W: torch.Tensor, z_W: torch.Tensor, drop: LawsonHansonDrop) -> None:
    """Step ``x`` to the first zero, then drop slot ``drop.p_1``: ``z`` and ``P = (K_AA + ridge I)^{-1}`` become the
    optimum and the inverse on ``A - p``, with slot ``p``'s row, column and weights zero. The slot and ``P_pp``
    stay on the device (no host value: the device loop's repairs record this as a CUDA graph)."""
    p_1, col_W = drop.p_1, drop.p_col_W
    x_W.lerp_(z_W, drop.alpha_1.clamp(0.0, 1.0))
    z_W.addcmul_(col_W, z_W.index_select(0, p_1) / drop.p_pp_1, value=-1.0)
    p_WW.addr_(col_W * (-1.0 / drop.p_pp_1), col_W)  # P - col col^T / P_pp
    p_WW.index_fill_(0, p_1, 0.0)
    p_WW.index_fill_(1, p_1, 0.0)
    x_W.index_fill_(0, p_1, 0.0)
    z_W.index_fill_(0, p_1, 0.0)


class ActiveSetState:
    """Exact NNLS refit state that OMP grows one element at a time (Lawson–Hanson on a rank-one inverse).

    Keeps the active set ``A`` (positive weights) of the selected set ``S``, the inverse
    ``P = (K_AA + ridge I)^{-1}``, the K rows of the active elements, the optimal ``v_A`` and the
    gradient ``grad = mu - K_{:,A} v_A`` over the pool.

    ``add(j)`` selects ``j``. With ``q = P k_Aj``, the Schur complement ``s = K_jj + ridge - k_Aj.q``
    gives in closed form the unconstrained optimum on ``A + j``: ``z_j = grad_j / s``,
    ``z_A = v_A - z_j q``, the new gradient ``grad - z_j (K_{:,j} - K_{:,A} q)`` and the new inverse
    ``P + [q; -1][q; -1]^T / s``: two matrix-vector products, one rank-one update, one update of
    weights, gradient and the caller's scores together (``_alloc_slots``) and six small kernels
    (three gathers, ``s``, ``z_j``, ``min z``), ONE host sync per round (which also returns ``j``,
    so the selection and the slots are tracked on the host). A pick whose gradient is not
    positive changes nothing but the selection (``settled``: the caller's later picks need no
    refit, ``add_settled``). When some ``z_A`` is negative, Lawson–Hanson steps from
    the current ``v`` towards ``z`` until the first weight reaches zero, removes that element
    (``P - P_{:,p} P_{p,:} / P_pp``, ``z - z_p P_{:,p} / P_pp``) and repeats, one sync per removal;
    selected elements at weight zero whose gradient turns positive re-enter the same way. Every
    step is ``O(N A)`` or ``O(A^2)``. ``refit_exact`` (a warm-started Lawson–Hanson with fresh
    Cholesky factors, ``O(A^3)``) is the fallback for a numerically dependent column (Schur
    complement below ``64 eps K_jj``, only possible with a tiny ridge) and for iteration caps.
    ``finalize()`` re-solves the final active system with a fresh Cholesky factor, removing the
    rounding the rank-one updates accumulate. In float32 the updates lose about
    ``eps * cond(K_AA)`` of accuracy, so a Schur complement below ``1e4 eps K_jj`` moves the state to
    float64 for the rest of the call (``_promote``; results are returned in the input dtype).

    Args:
        gram: the Gram rows (no ridge); the row of each added element must be available.
        mu_N: ``(N,)`` linear term.
        capacity: the most elements that will be selected (``M - 1`` slots).
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
        *,
        host_values: tuple[float, list[float]] | None = None,
    ) -> None:
        n = gram.n
        dev, dt = mu_N.device, mu_N.dtype
        # Rows of K (row i valid once ensured; every selected element's row is) and diag(K).
        self.gram_NN = gram.gram_NN
        self.mu_N = mu_N
        self.ridge_abs = float(ridge_abs)
        # The ridge as the state's dtype rounds it (kept through a promotion to float64).
        self.ridge_dt = _rounded(self.ridge_abs, dt)
        self.out_dtype = dt
        # float32 inverse updates lose about eps * cond(K_AA) digits. A Schur complement below
        # 1e4 eps K_jj (cond above ~1e3, as with more picks than feature dimensions, or near
        # duplicates) moves the state to float64 for the rest of the call (see _promote).
        self.promote_tol = 1e4 * torch.finfo(dt).eps if dt == torch.float32 else 0.0
        self.promoted = False
        self.grad_tol = grad_tol
        if host_values is None:  # one transfer of the tolerance and diag(K) for the host-side tests
            values = torch.cat([grad_tol.view(1).to(gram.diag_N.dtype), gram.diag_N]).tolist()
            host_values = (values[0], values[1:])
        self.grad_tol_f = host_values[0]
        # Schur complements at or below this (relative to K_jj) mean j depends on the active set.
        self.pivot_tol = 64.0 * torch.finfo(dt).eps
        self.diag_host = host_values[1]  # for the pivot test after the round's sync
        cap1 = capacity + 1
        self.cap1 = cap1
        self._alloc_slots(n, dt, dev)
        self._pair(0).copy_(mu_N)  # grad = mu at v = 0, and the scores (no element unavailable yet)
        # Small problems run every kernel over all slots: at M N <= 2^16 the extra multiply-adds
        # cost less than slicing the buffers anew each round (a few microseconds per view).
        self.full_width = cap1 * n <= 1 << 16
        self._slot_views: dict[tuple[int, int], torch.Tensor] = {}
        self._flag_views(dt)
        # Selected at weight 0, as an additive mask: 0 there, -inf elsewhere (grad + mask: their gradients).
        self.inactive_N = torch.full((n,), float("-inf"), dtype=dt, device=dev)
        self._elem_cache: torch.Tensor | None = None  # _elem_tensor's copy of elem[:hi]
        self._final: tuple[torch.Tensor, ...] | None = None  # see finalize
        # Set by a pick whose gradient is not positive: the state then no longer changes, and every
        # later pick (a max over fewer elements of the same gradient) is one too (see `add`).
        self.settled = False
        self.sel: list[int] = []  # selection order (host)
        self.slot_of: dict[int, int] = {}  # active element -> slot (host)
        self.elem: list[int] = [0] * cap1  # element of each slot (stale on free slots; host)
        self.free: list[int] = []  # free slots below `hi`
        self.hi = 0  # slots in use: [0, hi)
        self.m = 0  # selected count
        self.num_inactive = 0
        self.slow_refits = 0
        self.drops = 0
        self.reentries = 0
        # Elements left at weight 0 because their pivot was numerically singular (pool positions).
        self.singular: set[int] = set()
        self._kkt_cap = 3 * cap1 + 10

    def _alloc_slots(self, n: int, dt: torch.dtype, dev: torch.device) -> None:
        """The slot buffers, zero, carved from one allocation.

        ``rows_MN`` (K rows by slot), ``p_MM`` ((K_AA + ridge I)^{-1} by slot), ``-I`` (its row
        ``h`` adds the ``-1`` of ``qext`` at slot ``h``), ``y_L = [qext_M | u_N]`` with
        ``u = -K_{:,W} qext``, and two ``(2, L)`` sets ``[[v_M | grad_N], [- | scores_N]]`` (the
        state's) and ``[[z_M | grad_scratch_N], [- | scores_scratch_N]]`` (the round's scratch,
        swapped in when the round's refit is kept): one ``addcmul`` of ``y_L`` updates the weights,
        the gradient and the caller's scores ``grad + penalty`` (-inf where unavailable) at once.
        Invariant: ``v_M`` and ``z_M`` are exactly 0 on free and unused slots, and so is ``q = P k``
        there (zero P rows), so ``z = v - z_j qext`` is too.
        """
        cap1 = self.cap1
        # Each buffer starts 64-byte aligned, as its own allocation would: BLAS kernels may take
        # another (differently rounded) path for a misaligned operand.
        pad = 64 // dt.itemsize
        c, m = -(-cap1 // pad) * pad, -(-n // pad) * pad
        sizes = [cap1 * n, cap1 * cap1, cap1 * cap1] + [cap1, n] * 5
        split = [x for size in sizes for x in (size, -(-size // pad) * pad - size)]  # each, and its gap
        flat = torch.zeros(sum(split), dtype=dt, device=dev)
        rows, _, p, _, neg_eye, _, self.qext_M, _, self.u_N, _, *sets = flat.split_with_sizes(split)
        start = sum(split[:6])
        self.y_L = flat[start : start + c + m]
        self._sets = []
        sets_22L = flat[start + c + m : start + 5 * (c + m)].view(2, 2, c + m).unbind(0)
        for i, set_2L in enumerate(sets_22L):  # set i: [v, gap, grad, gap] then [-, gap, scores, gap]
            v, _, grad, _, _, _, scores, _ = sets[8 * i : 8 * i + 8]
            self._sets.append((set_2L, v, grad, scores))
        self._pair_views: list[torch.Tensor | None] = [None, None]
        self._pool_cols = (c, n)
        self._swap_sets(0)
        self.rows_MN = rows.view(cap1, n)
        self.rows_NM = self.rows_MN.T
        self.p_MM = p.view(cap1, cap1)
        neg_eye[:: cap1 + 1].fill_(-1.0)  # -I, row-major
        self.qext_1M = self.qext_M.view(1, cap1)
        # One-slot views of every slot, two ops in all: rows_MN[h:h+1] and row h of -I (-e_h, 1-D:
        # addmm broadcasts it).
        self._rows_1N = self.rows_MN.split(1)
        self._neg_e_M = neg_eye.split(cap1)

    def _swap_sets(self, cur: int | None = None) -> None:
        """Make set ``cur`` the state's (default: the other one: keep the round's refit, whose weights,
        gradient and scores become the state's)."""
        self._cur = 1 - self._cur if cur is None else cur
        self.set_2L, self.v_M, self.grad_N, self.scores_N = self._sets[self._cur]
        self.scratch_2L, self.z_M, self.grad_scratch_N, self.scores_scratch_N = self._sets[1 - self._cur]

    def _pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(2, N)`` views ``[grad_N; scores_N]`` of the state's set and of the scratch (made when first used)."""
        return self._pair(self._cur), self._pair(1 - self._cur)

    def _pair(self, i: int) -> torch.Tensor:
        """``[grad; scores]`` of set ``i``, a ``(2, N)`` view (made once)."""
        if self._pair_views[i] is None:
            c, n = self._pool_cols
            self._pair_views[i] = self._sets[i][0].narrow(1, c, n)
        return self._pair_views[i]

    def _refresh_scores(self, old_scores_N: torch.Tensor) -> None:
        """``scores_N = grad_N`` (a new gradient) with ``-inf`` kept where ``old_scores_N`` has it."""
        torch.where(torch.isneginf(old_scores_N), old_scores_N, self.grad_N, out=self.scores_N)

    def _flag_views(self, dtype: torch.dtype) -> None:
        """The round's host-read buffer ``[j, g_j, schur, min z, KKT violation]``, written in place.

        One int64 buffer read by one ``tolist`` (``_read_flags``): ``j_1`` is its first element
        (``torch.max(..., out=(g_1, j_1))`` writes the pick there, no copy), the four values of
        ``dtype`` fill the rest (viewed as ``dtype``).
        """
        width = 8 // dtype.itemsize  # elements of `dtype` that j's int64 takes
        self._flag_fmt = {torch.float32: "=4f", torch.float64: "=4d"}.get(dtype)
        self.flags_I = torch.zeros(1 + (4 * dtype.itemsize + 7) // 8, dtype=torch.long, device=self.mu_N.device)
        rest = self.flags_I.numel() * width - width - 4
        _, self.g_1, self.schur_1, self.zmin_1, self.viol_1, _ = self.flags_I.view(dtype).split_with_sizes(
            [width, 1, 1, 1, 1, rest]
        )
        self.j_1 = self.flags_I[:1]

    def _read_flags(self) -> tuple[float, float, float, float, int]:
        """The round's one host sync: ``(g_j, schur, min z, KKT violation, j)``."""
        ints = self.flags_I.tolist()
        raw = struct.pack(f"={len(ints)}q", *ints)
        if self._flag_fmt is not None:
            g, schur, zmin, viol = struct.unpack_from(self._flag_fmt, raw, 8)
        else:  # another float dtype: decoded by torch on the host
            g, schur, zmin, viol = torch.frombuffer(bytearray(raw[8:]), dtype=self.g_1.dtype)[:4].tolist()
        return g, schur, zmin, viol, ints[0]

    @property
    def act(self) -> list[int]:
        """The active elements (host), in slot order."""
        return [e for e, _ in sorted(self.slot_of.items(), key=lambda item: item[1])]

    @property
    def sel_M(self) -> torch.Tensor:
        """The selection in pick order as a device tensor (copied from the host without blocking)."""
        return _to_device(self.sel, self.mu_N.device)

    def add(self, j1: torch.Tensor, g_j: torch.Tensor | None = None) -> int:
        """Select pool element ``j1`` (shape ``(1,)`` int64) and refit exactly on the new support.

        Args:
            j1: the element to add; pass ``j_1`` (e.g. written by ``torch.max(..., out=(state.g_1,
                state.j_1))``) to save a copy: ``j_1`` holds ``j`` again when ``add`` returns.
            g_j: optional ``(1,)`` ``grad_N[j]`` (saves a gather when the caller has it; written
                straight into ``g_1`` it saves a copy).

        Returns:
            ``j`` as a Python int (it travels with the round's one host sync). When the pick's
            gradient is not positive, ``settled`` becomes True: ``v`` stays optimal with ``w_j = 0``
            and nothing but the selection changes, so every later pick (the largest gradient among
            fewer elements) is such a pick as well and may go to ``add_settled`` instead.
        """
        j, needs_kkt = self._enter(j1, g_j, new=True)
        if needs_kkt:
            self._restore_kkt()
            self.j_1.fill_(j)  # the re-entries (or a promotion) used j_1
        return j

    def add_settled(self, picks: list[int]) -> None:
        """Select ``picks`` (pool positions, host) at weight 0 once ``settled``: no refit can change."""
        assert self.settled
        self.sel.extend(picks)
        self.m += len(picks)
        self.inactive_N.index_fill_(0, _to_device(picks, self.mu_N.device), 0.0)
        self.num_inactive += len(picks)

    def _views(
        self, w: int
    ) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
    ]:
        """``rows_WN``, its transpose, ``P_WW``, ``qext_1W``, ``qext_W``, ``v_W``, ``z_W`` over ``w`` slots."""
        if w == self.cap1:
            return self.rows_MN, self.rows_NM, self.p_MM, self.qext_1M, self.qext_M, self.v_M, self.z_M
        return (
            self.rows_MN[:w],
            self.rows_NM[:, :w],
            self.p_MM[:w, :w],
            self.qext_1M[:, :w],
            self.qext_M[:w],
            self.v_M[:w],
            self.z_M[:w],
        )

    def _slot(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The one-slot views ``rows_MN[h:h+1]`` and ``-e_h`` over ``w`` slots."""
        if w == self.cap1:
            return self._rows_1N[h], self._neg_e_M[h]
        neg_e = self._slot_views.get((h, w))
        if neg_e is None:
            neg_e = self._slot_views[(h, w)] = self._neg_e_M[h].narrow(0, 0, w)
        return self._rows_1N[h], neg_e

    def _enter(self, j1: torch.Tensor, g_j: torch.Tensor | None, *, new: bool) -> tuple[int, bool]:
        """Try to make ``j1`` active; returns ``(j, whether inactive elements must be re-checked)``."""
        h = self.free[-1] if self.free else self.hi
        w = self.cap1 if self.full_width else max(self.hi, h + 1)
        rows_WN, rows_NW, p_WW, qext_1W, qext_W, v_W, z_W = self._views(w)
        rows_h1, neg_e_1W = self._slot(h, w)
        if self.promoted:
            rows_h1.copy_(self.gram_NN.index_select(0, j1))
        else:
            torch.index_select(self.gram_NN, 0, j1, out=rows_h1)
        # K_Aj is column j of the slot rows (K is symmetric); q^T = k^T P (P is symmetric). Free
        # slots (h among them) have zero P rows and columns, so q vanishes there whatever their rows
        # hold, and adding -e_h makes qext = [q; -1] in the same kernel.
        torch.addmm(neg_e_1W, rows_NW.index_select(0, j1), p_WW, out=qext_1W)
        # t = K_{:,W} qext = K_{:,A} q - K_{:,j}: t_j = k.q - K_jj gives the Schur complement, and
        # grad - z_j (K_{:,j} - K_{:,A} q) = grad + z_j t is the gradient at the new optimum. Kept
        # negated, u = -t (exactly), so that z and the gradient take the same update below.
        u_N = torch.addmv(self.u_N, rows_NW, qext_W, beta=0.0, alpha=-1.0, out=self.u_N)
        # The round's host-read values are written into one buffer (flags_I) as they are computed.
        schur = torch.add(u_N.index_select(0, j1), self.ridge_dt, out=self.schur_1)
        if g_j is None:
            g_j = torch.index_select(self.grad_N, 0, j1, out=self.g_1)
        elif g_j is not self.g_1:
            g_j = self.g_1.copy_(g_j)
        z_j = g_j / schur
        # z = v - z_j qext, grad + z_j t and scores + z_j t (the caller's penalties stay -inf).
        if w == self.cap1:
            torch.addcmul(self.set_2L, self.y_L, z_j, value=-1.0, out=self.scratch_2L)
        else:
            torch.addcmul(v_W, qext_W, z_j, value=-1.0, out=z_W)
            pair_GN, pair_scratch_GN = self._pairs()
            torch.addcmul(pair_GN, u_N, z_j, value=-1.0, out=pair_scratch_GN)
        # Free slots hold z = 0 exactly and z_j > 0 whenever j enters, so min z < 0 means an active
        # weight went negative.
        torch.amin(z_W, 0, keepdim=True, out=self.zmin_1)
        if self.num_inactive > 0:
            # Selected elements at weight 0 must keep a non-positive gradient (KKT): their largest.
            inactive_grad_N = self.grad_scratch_N + self.inactive_N
            torch.amax(inactive_grad_N, 0, keepdim=True, out=self.viol_1)
        if j1 is not self.j_1:
            self.j_1.copy_(j1)  # j travels with the round's one sync
        g_f, schur_f, zmin_f, viol_f, j = self._read_flags()
        viol = self.num_inactive > 0 and viol_f > self.grad_tol_f
        if g_f > self.grad_tol_f and schur_f < self.promote_tol * self.diag_host[j] and not self.promoted:
            self._promote()
            if not new:
                # j was already selected (a KKT re-entry): the exact float64 refit over S has just
                # decided its weight, so entering it again would give one element two slots.
                return j, True
            return self._enter(j1, None, new=new)
        if new:
            self.sel.append(j)
            self.m += 1
        if not g_f > self.grad_tol_f:
            # Non-positive gradient: the current v stays optimal on S + j with w_j = 0. Slot h
            # stays free; the scratch weights must read 0 there when a later round swaps z_M in.
            self.z_M.copy_(self.v_M)
            self._mark_inactive(j1)
            self.settled = new
            return j, False
        return self._accept(j, h, w, p_WW, qext_W, (schur_f, zmin_f), viol)

    def _accept(
        self, j: int, h: int, w: int, p_WW: torch.Tensor, qext_W: torch.Tensor, flags: tuple[float, float], viol: bool
    ) -> tuple[int, bool]:
        """Enter ``j`` at slot ``h`` (its gradient is positive), or refit when its pivot is singular.

        ``flags``: the round's Schur complement and smallest unconstrained weight ``min z``.
        """
        schur_f, zmin_f = flags
        if not schur_f > self.pivot_tol * self.diag_host[j]:
            self.singular.add(j)
            self._mark_inactive(self.j_1)
            self._slow_refit()
            return j, False
        # Enter j at slot h: P <- P + qext qext^T / s.
        p_WW.addr_(qext_W, qext_W, alpha=1.0 / schur_f)
        self.elem[h] = j
        self._elem_cache = None
        self.slot_of[j] = h
        if self.free:
            self.free.pop()
        self.hi = max(self.hi, h + 1)
        if not zmin_f < 0:
            self._swap_sets()
            return j, viol
        self._drop_until_positive(w)
        return j, True

    def _drop_until_positive(self, w: int) -> None:
        """Lawson–Hanson inner loop from the feasible ``v_M`` towards the unconstrained ``z_M``."""
        _, rows_NW, p_WW, _, _, x_W, z_W = self._views(w)
        for _ in range(w + 1):
            drop = first_to_zero(p_WW, x_W, z_W)
            any_neg, p, _ = drop.flags_3.tolist()
            if not any_neg:
                break
            drop_slot(p_WW, x_W, z_W, drop)
            self._free_slot(int(p))
        else:
            log.warning("ActiveSetState: Lawson–Hanson inner loop did not settle; refitting from scratch")
            self._slow_refit()
            return
        self._swap_sets()  # the settled z becomes v; the scores before the round are the scratch's
        self.z_M.zero_()
        torch.addmv(self.mu_N, rows_NW, self.v_M[:w], alpha=-1.0, out=self.grad_N)
        self._refresh_scores(self.scores_scratch_N)

    def _restore_kkt(self) -> None:
        """Re-enter selected zero-weight elements whose gradient is positive (Lawson–Hanson outer loop)."""
        for _ in range(self._kkt_cap):
            if self.num_inactive == 0:
                return
            # The largest inactive gradient and its element, into the round buffer (g_1, j_1).
            inactive_grad_N = self.grad_N + self.inactive_N
            torch.max(inactive_grad_N, 0, keepdim=True, out=(self.g_1, self.j_1))
            g_f, _, _, _, _ = self._read_flags()
            if not g_f > self.grad_tol_f:
                return
            self.inactive_N.index_fill_(0, self.j_1, float("-inf"))
            self.num_inactive -= 1
            self.reentries += 1
            self._enter(self.j_1, self.g_1, new=False)
        log.warning("ActiveSetState: KKT restoration hit its cap; refitting from scratch")
        self._slow_refit()

    def _free_slot(self, p: int) -> None:
        """Mark slot ``p`` free and its element selected-at-zero."""
        e = self.elem[p]
        del self.slot_of[e]
        self.free.append(p)
        self.inactive_N[e] = 0.0
        self.num_inactive += 1
        self.drops += 1

    def _mark_inactive(self, j1: torch.Tensor) -> None:
        """Record a selected element that stays at weight 0."""
        self.inactive_N.index_fill_(0, j1, 0.0)
        self.num_inactive += 1

    def finalize(self) -> None:
        """Re-solve the active system with a fresh Cholesky factor; full refit if a weight flips."""
        if not self.slot_of:
            return
        act = self.act
        a = len(act)
        slots = [self.slot_of[e] for e in act]
        in_order = slots == list(range(a))  # no slot was freed: rows_MN[:a] are the active rows
        if in_order:
            act_A = _to_device(act, self.mu_N.device)
            rows_AN = self.rows_MN[:a]
        else:  # both index lists in one copy
            slots_A, act_A = _to_device([slots, act], self.mu_N.device).unbind(0)
            rows_AN = self.rows_MN.index_select(0, slots_A)
        kr_AA = rows_AN.index_select(1, act_A)
        kr_AA.diagonal().add_(self.ridge_abs)
        chol_AA, info = torch.linalg.cholesky_ex(kr_AA)
        mu_A = self.mu_N.index_select(0, act_A)
        v_A = torch.cholesky_solve(mu_A.unsqueeze(1), chol_AA).squeeze(1)
        grad_N = torch.addmv(self.mu_N, rows_AN.T, v_A, alpha=-1.0)
        # The checks read back in the round buffer's one transfer: the factor's info, the smallest
        # weight and the largest gradient of an inactive element.
        self.g_1.copy_(info)
        torch.amin(v_A, 0, keepdim=True, out=self.zmin_1)
        if self.num_inactive > 0:
            torch.amax(grad_N + self.inactive_N, 0, keepdim=True, out=self.viol_1)
        info_f, _, vmin_f, viol_f, _ = self._read_flags()
        viol = self.num_inactive > 0 and viol_f > self.grad_tol_f
        if info_f == 0 and vmin_f > 0 and not viol:
            if in_order:
                self.v_M[:a].copy_(v_A)
                if a == self.hi:  # the used slots are the active ones in order: scaled_objective's gathers
                    self._final = (act_A, v_A, mu_A)
            else:
                self.v_M.index_copy_(0, slots_A, v_A)
            self.grad_N = grad_N
        else:
            self._slow_refit()

    def _slow_refit(self) -> None:
        """Full Lawson–Hanson on ``S`` from the current ``v``, then rebuild the slots."""
        self.slow_refits += 1
        sel_S = self.sel_M
        v_S = self.selection_weights()
        gram_SS = self.gram_NN[sel_S.unsqueeze(1), sel_S.unsqueeze(0)].to(self.mu_N.dtype)
        stats: dict = {}
        v_S = refit_exact(
            gram_SS, self.mu_N[sel_S], ridge_abs=self.ridge_abs, v0_S=v_S, grad_tol=self.grad_tol, stats=stats
        )
        self.singular.update(self.sel[p] for p in stats.get("blocked", ()))
        self._rebuild(sel_S[v_S > 0])

    def _rebuild(self, act_A: torch.Tensor) -> None:
        """Refactor ``K_AA + ridge I`` for a new active set in slots ``0..A-1`` and re-solve on it."""
        a = act_A.shape[0]
        act = act_A.tolist()
        self.slot_of = {e: s for s, e in enumerate(act)}
        self.free = []
        self.hi = a
        self.elem = act + [0] * (self.cap1 - a)
        self._elem_cache = None
        self.p_MM.zero_()
        self.v_M.zero_()
        self.z_M.zero_()
        self.inactive_N.fill_(float("-inf"))
        self.inactive_N.index_fill_(0, self.sel_M, 0.0)  # index_fill_: a number assigned through a
        self.inactive_N.index_fill_(0, act_A, float("-inf"))  # device index would be copied to it (a sync)
        self.num_inactive = self.m - a
        self.rows_MN[:a] = self.gram_NN.index_select(0, act_A)
        if a == 0:
            self.grad_N.copy_(self.mu_N)
            self._refresh_scores(self.scores_N)
            return
        kr_AA = self.rows_MN[:a].index_select(1, act_A)
        kr_AA = kr_AA + self.ridge_abs * torch.eye(a, dtype=kr_AA.dtype, device=kr_AA.device)
        chol_AA, info = torch.linalg.cholesky_ex(kr_AA)
        if int(info) != 0:
            raise SelectionNumericsError(
                f"ActiveSetState: the active Gram block lost definiteness (Cholesky info={int(info)}, "
                f"{a} active elements, ridge {self.ridge_abs:g}); raise `ridge` above 0"
            )
        self.p_MM[:a, :a] = torch.cholesky_inverse(chol_AA)
        self.v_M[:a] = torch.cholesky_solve(self.mu_N[act_A].unsqueeze(1), chol_AA).squeeze(1)
        torch.addmv(self.mu_N, self.rows_MN[:a].T, self.v_M[:a], alpha=-1.0, out=self.grad_N)
        self._refresh_scores(self.scores_N)

    def selection_weights(self) -> torch.Tensor:
        """The current ``v`` of the selection in pick order (zero for inactive elements)."""
        # Slot M-1 is never used (at most M-1 elements are selected, and an entering element finds
        # a free slot below hi or hi itself, at most M-2), so its weight is exactly 0.
        spare = self.cap1 - 1
        slots_S = _to_device([self.slot_of.get(e, spare) for e in self.sel], self.mu_N.device)
        return self.v_M.index_select(0, slots_S).to(self.out_dtype)

    def _elem_tensor(self) -> torch.Tensor:
        """The element of each used slot as a device tensor (one copy while the slots do not change)."""
        if self._elem_cache is None:
            self._elem_cache = _to_device(self.elem[: self.hi], self.mu_N.device)
        return self._elem_cache

    def scaled_objective(self) -> torch.Tensor:
        """``Phi(v)`` with the true ``K`` (no ridge), from ``K_AA v_A = mu_A - grad_A`` (ridge aside)."""
        if self._final is not None:  # finalize's elem[:hi], v_M[:hi] and their mu
            elem_W, v_W, mu_W = self._final
        else:
            elem_W = self._elem_tensor()
            v_W, mu_W = self.v_M[: self.hi], self.mu_N[elem_W]
        phi = 0.5 * (torch.dot(v_W, mu_W) + torch.dot(v_W, self.grad_N[elem_W]))
        return phi.to(self.out_dtype)

    def _promote(self) -> None:
        """Move the state to float64 and refit exactly on the current selection (once per call).

        The K rows keep their float32 values (the problem is what it is); the inverse, weights and
        gradient are recomputed in float64 from a fresh Cholesky factor, so the float32 rounding
        accumulated so far is dropped as well.
        """
        dt = torch.float64
        self.promoted = True
        self.pivot_tol = 64.0 * torch.finfo(dt).eps
        old = (self.rows_MN, self.p_MM, self.qext_M, *self._pairs(), self.v_M, self.z_M)
        self.mu_N = self.mu_N.to(dt)
        self._alloc_slots(self.mu_N.shape[0], dt, self.mu_N.device)
        new = (self.rows_MN, self.p_MM, self.qext_M, *self._pairs(), self.v_M, self.z_M)
        for dst, src in zip(new, old):
            dst.copy_(src)
        self._flag_views(dt)
        self._slot_views = {}
        log.debug("ActiveSetState: ill-conditioned active set; continuing in float64")
        self._slow_refit()


def _rounded(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (as a host float, computed on the host)."""
    if dtype == torch.float64:
        return float(value)
    if dtype == torch.float32:
        return struct.unpack("=f", struct.pack("=f", value))[0]
    return torch.tensor(value, dtype=dtype).item()  # a host tensor: no device sync


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of host values on ``device``, copied without making the host wait."""
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
