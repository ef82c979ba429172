"""The device loop's round as three Triton kernels (`solver_loop: device_triton`, issue 31.3).

# Shape legend: N pool size, M slots (kappa + 1), C domains.

`active_set_device._round` is one common round of the exact greedy OMP: about 60 eager ops, and 12
kernels once inductor has fused them on CUDA, each 1-3 us, so 16.4 ms of kernel time for 512 rounds on
an H200 before any launch gap (docs/results/bench_gpu.md, 2026-11-27): over the 10 ms the issue asks
for the whole solve. The round's data dependencies need only three passes, one kernel each, because a
program may recompute a small value (a reduction over N or M elements) that another program also
computes, instead of waiting for it:

1. `_pick_kernel`, programs over blocks of slots. Every program finds the pick
   ``j = argmax(grad + penalty)`` itself (N loads, first index on ties, as ``torch.max`` on a CPU), then
   its block of ``qext = P k_Aj`` (``P`` symmetric, zero on free slots), ``-1`` at the free slot ``h``.
   Program 0 records ``j``, its score ``g`` and ``sel[r] = j``, clears the negative-weight flag, and copies
   ``live``, ``h`` and the capacities, which the third kernel writes.
2. `_direction_kernel`, programs over blocks of the pool. Its block of ``t = K_A'^T qext``, where A' is
   the active slots with ``K[j]`` at slot ``h`` (a substitution in the load, so the write of
   ``rows[h] = K[j]`` at the end races with nothing), the Schur complement ``ridge - t_j`` (every program
   computes ``t_j`` itself), the new gradient ``grad + t z_j`` into a scratch row, and, after a weight
   has dropped (``kkt``), the block's largest new gradient at weight zero; and a block of slots of
   ``z = v - qext z_j``, raising the flag (an atomic max) where an entry is negative.
3. `_apply_kernel`, programs over blocks of the pool, then over row blocks of ``P``. Every program
   decides the round from those scalars, as `_round` does (a positive pick enters unless it needs the
   host loop or a repair; a round that needs either freezes the state) and applies its own part: the
   gradient and the penalty (the pick, and every element of a domain now full) of its block, or
   ``P += qext qext^T / s`` on its rows; a pool program also copies its block of slots of ``z`` into
   ``v``. Program 0 updates the slots and the counters.

No program reads what another program of the same kernel writes, so no kernel needs a grid-wide
barrier. The loops over the slots stop at the slots in use (``h``, or ``h + 1`` with the new one: the free
slots are packed last and their rows of ``P`` are zero), half of M over a solve; and a frozen state (a round
waiting for its repair: the rest of its batch) makes every kernel return at once. On an H100 at
n = 2048, kappa = 512 a round's three kernels take 3.5, 3.8 and 2.6 us (docs/results/bench_gpu.md,
2026-11-27). The arithmetic is `_round`'s; the reductions run in their own order (as inductor's do), so the
picks are the eager rounds' but among near-ties, and the weights may differ in the last bits.

`BLOCKS["fused"]` (on by default since an H200 timed it: 0.90x the three kernels' solve on bench_selection's seed 0,
0.89x on seed 1, docs/results/bench_gpu.md, 2026-11-28) makes a round before the first drop two kernels: the
apply kernel with ``FUSED`` does the second's work itself. The third pass needs only scalars of the second, the Schur
complement and whether a new weight turns negative, which every program can compute itself (513 loads); only
the KKT check, after a drop, needs the whole pool's new gradient, so those rounds stay three kernels. Its
programs all read ``v``, so the new weights wait in ``vnext`` for the next round's pick kernel to copy them
(``pending``). A kernel and its gap fewer a round, for
a longer chain in the programs that update ``P`` (they also compute the Schur complement); the sweep times it.

Triton runs on GPUs. On a CPU the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1``, the
tests); `kernels_available` says whether they run on a device, and `active_set_device` falls back to
the eager rounds where they do not. The kernels are wrapped by ``triton.jit`` on first use, not at
import, so the interpreter setting is read then.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheels of torch come without Triton; the eager rounds run then
    triton = None
    tl = None

__all__ = ["BLOCKS", "SWEEP", "TritonRound", "kernels_available"]

# Block sizes: slots per program of the pick kernel, pool elements per program of the other two, the slots
# reduced per step of their loops, P rows per program of the apply kernel, pool elements per step of the argmax.
# At n = 2048, kappa = 512 the grids are 17, 64 and 64 + 33 programs, and each loop over the slots takes up to
# 5 steps (each waits for its loads: few steps, each loading more, hide more of that latency); "warps" is the
# launches' num_warps; "fused" 1 runs the rounds before the first drop as two kernels (the apply kernel's
# FUSED variant). The sizes were chosen on paper; on an H200 (`tools/bench/bench_selection.py --triton-sweep`,
# docs/results/bench_gpu.md, 2026-11-28, steady solves) no other size beat them by more than 2% on both seeds,
# and "fused" 1 took 0.90x (seed 0) and 0.89x (seed 1) the three kernels' time: its default since.
BLOCKS = {"slots": 32, "pool": 32, "reduce": 128, "p_rows": 16, "argmax": 2048, "warps": 4, "fused": 1}
# What the sweep tries beside `BLOCKS` (each entry overrides some of them).
SWEEP = (
    {"warps": 8},
    {"pool": 16, "slots": 16, "warps": 2},
    {"reduce": 64},
    {"reduce": 256},
    {"pool": 64},
    {"pool": 16, "slots": 16},
    {"p_rows": 32},
    {"reduce": 256, "pool": 16, "slots": 16},
    {"reduce": 256, "warps": 8},
    {"fused": 0},
    {"warps": 8, "fused": 0},
    {"pool": 16, "slots": 16, "fused": 0},
)

def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_available(device: torch.device) -> bool:
    """Whether the Triton round runs on ``device``: CUDA with Triton installed, or any device in its interpreter."""
    return triton is not None and (device.type == "cuda" or _interpreting())


def _pick_kernel(
    grad, penalty, rows, p, qext, jbuf, gbuf, sel, flags, r_1, h_1, live_1, v, vnext, pending_1, rem_C, rem_snap,
    N, M, K, C, stride_r,
    BLOCK_ARGMAX: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    live = tl.load(live_1) != 0
    if pid == 0:  # snapshots for the apply kernel, whose program 0 writes live, h and the capacities
        tl.store(flags + 1, live.to(tl.int32))
        tl.store(flags + 2, tl.load(h_1).to(tl.int32))
        for c0 in range(0, C, BLOCK_C):
            cs = c0 + tl.arange(0, BLOCK_C)
            tl.store(rem_snap + cs, tl.load(rem_C + cs, mask=cs < C, other=0), mask=cs < C)
    # A frozen state (a round waiting for its repair) runs no round: the batch's remaining launches return at once.
    if live:
        # The last fused round's new weights, which it could not write (all its programs read v): a block each.
        if tl.load(pending_1) != 0:
            vs = pid * BLOCK_S + tl.arange(0, BLOCK_S)
            tl.store(v + vs, tl.load(vnext + vs, mask=vs < M, other=0.0), mask=vs < M)
        best = tl.full([], float("-inf"), grad.dtype.element_ty)
        bidx = tl.zeros([], tl.int32)
        for start in range(0, N, BLOCK_ARGMAX):
            offs = start + tl.arange(0, BLOCK_ARGMAX)
            mask = offs < N
            score = tl.load(grad + offs, mask=mask, other=float("-inf")) + tl.load(penalty + offs, mask=mask, other=0.0)
            m, i = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
            take = m > best  # strictly: an equal score later in the pool does not replace the first
            best = tl.where(take, m, best)
            bidx = tl.where(take, start + i, bidx)
        j = bidx.to(tl.int64)
        h = tl.load(h_1)
        cols = pid * BLOCK_S + tl.arange(0, BLOCK_S)
        cmask = cols < M
        # The products accumulate in a tile, reduced over the slots once after the loop (a reduction across warps
        # at every step would wait for a barrier each time). Only the slots in use, the first h: P's rows from slot
        # h on are zero (free slots, packed last), so the loop's length follows the solve (half of M on average).
        acc = tl.zeros([BLOCK_K, BLOCK_S], dtype=qext.dtype.element_ty)
        for m0 in range(0, h, BLOCK_K):
            ms = (m0 + tl.arange(0, BLOCK_K)).to(tl.int64)
            mmask = ms < M
            rj = tl.load(rows + ms * stride_r + j, mask=mmask, other=0.0)
            tile = tl.load(p + ms[:, None] * M + cols[None, :], mask=mmask[:, None] & cmask[None, :], other=0.0)
            acc += rj[:, None] * tile
        acc = tl.where(cols == h, -1.0, tl.sum(acc, 0))
        tl.store(qext + cols, acc, mask=cmask)
        if pid == 0:
            tl.store(jbuf, j)
            tl.store(gbuf, best)
            r = tl.load(r_1)
            tl.store(sel + r, j, mask=r < K)
            tl.store(flags, 0)  # raised (an atomic max) by the direction kernel's programs whose new weights turn negative


def _direction_kernel(
    gram, rows, qext, grad, inactive, v, ridge_1, jbuf, gbuf, h_1, live_1,
    gnew, kkt_part, zbuf, scal, flags,
    N, M, stride_r, stride_g0, stride_g1,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_Z: tl.constexpr, KKT: tl.constexpr,
):
    pid = tl.program_id(0)
    h = tl.load(h_1)
    if tl.load(live_1) != 0:
        j = tl.load(jbuf)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        krow = tl.load(gram + j * stride_g0 + cols.to(tl.int64) * stride_g1, mask=cmask, other=0.0)
        kjj = tl.load(gram + j * stride_g0 + j * stride_g1)
        acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=gnew.dtype.element_ty)
        tj = tl.zeros([BLOCK_K], dtype=gnew.dtype.element_ty)
        # Slots 0..h: qext is zero past h (P's columns of free slots are).
        for m0 in range(0, h + 1, BLOCK_K):
            ms = (m0 + tl.arange(0, BLOCK_K)).to(tl.int64)
            mmask = ms < M
            q = tl.load(qext + ms, mask=mmask, other=0.0)
            # Row h is K[j] this round, substituted rather than loaded: this kernel writes it (below, and the
            # program owning column j writes rows[h, j]), so no load may touch it.
            live_row = mmask & (ms != h)
            tile = tl.load(rows + ms[:, None] * stride_r + cols[None, :], mask=live_row[:, None] & cmask[None, :], other=0.0)
            acc += tl.where(ms[:, None] == h, krow[None, :], tile) * q[:, None]
            tj += tl.where(ms == h, kjj, tl.load(rows + ms * stride_r + j, mask=live_row, other=0.0)) * q
        acc = tl.sum(acc, 0)
        schur = tl.load(ridge_1) - tl.sum(tj, 0)
        zj = tl.load(gbuf) / schur
        gn = tl.load(grad + cols, mask=cmask, other=0.0) + acc * zj
        tl.store(gnew + cols, gn, mask=cmask)
        if KKT:
            at_zero = (tl.load(inactive + cols, mask=cmask, other=0) != 0) & cmask
            tl.store(kkt_part + pid, tl.max(tl.where(at_zero, gn, float("-inf")), 0))
        tl.store(rows + h * stride_r + cols, krow, mask=cmask)
        # The new weights z = v - qext z_j, a block of slots a program (every program has z_j), and whether any is
        # negative (a Lawson-Hanson drop: the round freezes for its repair).
        zs = pid * BLOCK_Z + tl.arange(0, BLOCK_Z)
        zmask = zs < M
        z = tl.load(v + zs, mask=zmask, other=0.0) - tl.load(qext + zs, mask=zmask, other=0.0) * zj
        tl.store(zbuf + zs, z, mask=zmask)
        tl.atomic_max(flags, tl.max(((z < 0) & zmask).to(tl.int32), 0), mask=pid * BLOCK_Z < M)
        if pid == 0:
            tl.store(scal, schur)
            tl.store(scal + 1, kjj)


def _apply_kernel(
    grad, gnew, penalty, inactive, dom, rem_snap, rem_C, p, qext, v, zbuf, elem, used,
    h_1, r_1, live_1, bad_1, jbuf, gbuf, scal, flags, kkt_part, tol_1, pending_1, gram, rows, ridge_1,
    N, M, pool_programs, pivot_tol, promote_tol, stride_r, stride_g0, stride_g1,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_Z: tl.constexpr, KKT: tl.constexpr, PROMOTE: tl.constexpr, FUSED: tl.constexpr,
):
    # Long: one Triton kernel (its body cannot call plain Python helpers), whose two variants share the decision
    # and the updates; the FUSED one also does the direction kernel's work (the module docstring). Its slot loop
    # repeats `_direction_kernel`'s: a shared `triton.jit` helper would have to be wrapped when this module is
    # imported, before `_jitted` reads TRITON_INTERPRET, so the interpreter and compiled kernels could not both run.
    pid = tl.program_id(0)
    if tl.load(flags + 1) != 0:  # live when the round began (a frozen state runs no round)
        h = tl.load(flags + 2).to(tl.int64)
        g = tl.load(gbuf)
        j = tl.load(jbuf)
        tol = tl.load(tol_1)
        if FUSED:  # `_direction_kernel`'s part here: every program computes the round's scalars itself
            kjj = tl.load(gram + j * stride_g0 + j * stride_g1)
            fcols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            fmask = (fcols < N) & (pid < pool_programs)  # the P-row programs load no tile
            krow = tl.load(gram + j * stride_g0 + fcols.to(tl.int64) * stride_g1, mask=fmask, other=0.0)
            acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=grad.dtype.element_ty)
            tj = tl.zeros([BLOCK_K], dtype=grad.dtype.element_ty)
            for m0 in range(0, h + 1, BLOCK_K):  # as `_direction_kernel`
                ms = (m0 + tl.arange(0, BLOCK_K)).to(tl.int64)
                mmask = ms < M
                q = tl.load(qext + ms, mask=mmask, other=0.0)
                live_row = mmask & (ms != h)
                tile = tl.load(rows + ms[:, None] * stride_r + fcols[None, :], mask=live_row[:, None] & fmask[None, :], other=0.0)
                acc += tl.where(ms[:, None] == h, krow[None, :], tile) * q[:, None]
                tj += tl.where(ms == h, kjj, tl.load(rows + ms * stride_r + j, mask=live_row, other=0.0)) * q
            schur = tl.load(ridge_1) - tl.sum(tj, 0)
            zj = g / schur
            neg = tl.zeros([BLOCK_K], dtype=tl.int32)
            for m0 in range(0, h + 1, BLOCK_K):  # z is zero past h (v and qext are)
                ms = m0 + tl.arange(0, BLOCK_K)
                mmask = ms < M
                z = tl.load(v + ms, mask=mmask, other=0.0) - tl.load(qext + ms, mask=mmask, other=0.0) * zj
                neg = tl.maximum(neg, ((z < 0) & mmask).to(tl.int32))
            repair = tl.max(neg, 0) != 0
        else:
            schur = tl.load(scal)
            kjj = tl.load(scal + 1)
            repair = tl.load(flags) != 0
        positive = g > tol
        # The host loop's branches that end the device solve: a dependent column, an ill-conditioned float32 one.
        host_only = (schur > pivot_tol * kjj) == 0
        if PROMOTE:
            host_only = host_only | (schur < promote_tol * kjj)
        # And those a repair makes: a Lawson-Hanson drop, a KKT re-entry.
        if KKT:
            parts = tl.load(kkt_part + tl.arange(0, BLOCK_T), mask=tl.arange(0, BLOCK_T) < pool_programs, other=float("-inf"))
            repair = repair | (tl.max(parts, 0) > tol)
        stop = positive & (host_only | repair)
        live = stop == 0
        enter = live & positive
        if pid < pool_programs:
            cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            cmask = cols < N
            zs = pid * BLOCK_Z + tl.arange(0, BLOCK_Z)
            zmask = zs < M
            if FUSED:
                tl.store(grad + cols, tl.load(grad + cols, mask=cmask, other=0.0) + tl.sum(acc, 0) * zj, mask=cmask & enter)
                tl.store(rows + h * stride_r + cols, krow, mask=cmask)
                # Every program reads v: the new weights wait in zbuf for the next round's pick kernel (pending).
                z = tl.load(v + zs, mask=zmask, other=0.0) - tl.load(qext + zs, mask=zmask, other=0.0) * zj
                tl.store(zbuf + zs, z, mask=zmask)
            else:
                tl.store(grad + cols, tl.load(gnew + cols, mask=cmask, other=0.0), mask=cmask & enter)
                tl.store(v + zs, tl.load(zbuf + zs, mask=zmask, other=0.0), mask=zmask & enter)
            dm = tl.load(dom + cols, mask=cmask, other=0)
            dom_j = tl.load(dom + j)
            rem = tl.load(rem_snap + dm, mask=cmask, other=1) - ((dm == dom_j) & live).to(tl.int64)
            pen = tl.load(penalty + cols, mask=cmask, other=0.0)
            pen = tl.where(((cols == j) & live) | (rem <= 0), float("-inf"), pen)
            tl.store(penalty + cols, pen, mask=cmask)
            if pid == 0:
                if FUSED:
                    tl.store(pending_1, enter)
                else:
                    tl.store(pending_1, 0)  # this kernel wrote v itself
                tl.store(bad_1, (tl.load(bad_1) != 0) | (stop & host_only))
                tl.store(live_1, live)
                tl.store(elem + h, j)
                tl.store(used + h, enter)
                tl.store(h_1, h + enter.to(tl.int64))
                tl.store(r_1, tl.load(r_1) + live.to(tl.int64))
                tl.store(inactive + j, live & (positive == 0))  # a pick at a gradient not above zero stays at weight 0
                tl.store(rem_C + dom_j, tl.load(rem_snap + dom_j) - live.to(tl.int64))
        else:
            # P += qext qext^T / s over slots 0..h (qext is zero past h): row blocks past h have nothing to do.
            rs = ((pid - pool_programs) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
            rmask = (rs <= h) & enter
            qa = tl.load(qext + rs, mask=rmask, other=0.0) / schur
            for c0 in range(0, h + 1, BLOCK_K):
                cs = c0 + tl.arange(0, BLOCK_K)
                mask = rmask[:, None] & (cs < M)[None, :]
                ptr = p + rs[:, None] * M + cs[None, :]
                qb = tl.load(qext + cs, mask=cs < M, other=0.0)
                tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + qa[:, None] * qb[None, :], mask=mask)


KERNELS = (_pick_kernel, _direction_kernel, _apply_kernel)


@functools.cache
def _jitted(interpret: bool) -> tuple:
    """The kernels through ``triton.jit`` (which reads ``TRITON_INTERPRET`` when it wraps them)."""
    del interpret  # the cache key: wrapped apart in and out of the interpreter
    return tuple(triton.jit(fn) for fn in KERNELS)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


class TritonRound:
    """One round of `active_set_device` on the state ``st`` (its `_State`), as three kernel launches.

    Its scratch buffers are allocated here, once a solve, so the launches can be recorded as a CUDA graph.
    """

    def __init__(self, st, tols: tuple[float, float], blocks: dict[str, int] | None = None) -> None:
        if triton is None:
            raise RuntimeError("solver_loop device_triton needs Triton (installed with the CUDA wheels of torch)")
        b = {**BLOCKS, **(blocks or {})}
        n, m, c = st.grad_N.shape[0], st.p_MM.shape[0], st.rem_C.shape[0]
        dev, dt = st.grad_N.device, st.grad_N.dtype
        pool = triton.cdiv(n, b["pool"])
        self.grids = ((triton.cdiv(m, b["slots"]),), (pool,), (pool + triton.cdiv(m, b["p_rows"]),))
        block_z = _next_pow2(triton.cdiv(m, pool))  # slots of z per pool program: the pool's programs cover them
        j_1 = torch.zeros(1, dtype=torch.long, device=dev)
        g_1 = torch.zeros(1, dtype=dt, device=dev)
        qext_M = torch.zeros(m, dtype=dt, device=dev)
        gnew_N = torch.zeros(n, dtype=dt, device=dev)
        kkt_P = torch.full((pool,), float("-inf"), dtype=dt, device=dev)
        z_M = st.vnext_M  # the new weights: copied into v by the apply kernel, or by the next pick kernel (fused)
        scal_2 = torch.zeros(2, dtype=dt, device=dev)  # the Schur complement, K_jj
        flags_3 = torch.zeros(3, dtype=torch.int32, device=dev)  # a weight would turn negative; live and h before
        rem_snap_C = torch.zeros_like(st.rem_C)
        # The kernels index the pool's vectors with unit stride; the state's own are allocated so, the ids are the caller's.
        dom_N = st.dom_N.contiguous()
        # Every launch's arguments, built once a solve (the same tensors every round; only the variant changes): a round
        # launched eagerly, as at a training step's few picks, then pays only the three launches.
        self.args = (
            (st.grad_N, st.penalty_N, st.rows_MN, st.p_MM, qext_M, j_1, g_1, st.sel_K, flags_3, st.r_1, st.h_1,
             st.live_1, st.v_M, z_M, st.pending_1, st.rem_C, rem_snap_C, n, m, st.sel_K.shape[0], c, st.rows_MN.stride(0)),
            (st.gram_NN, st.rows_MN, qext_M, st.grad_N, st.inactive_N, st.v_M, st.ridge_1, j_1, g_1,
             st.h_1, st.live_1, gnew_N, kkt_P, z_M, scal_2, flags_3,
             n, m, st.rows_MN.stride(0), st.gram_NN.stride(0), st.gram_NN.stride(1)),
            (st.grad_N, gnew_N, st.penalty_N, st.inactive_N, dom_N, rem_snap_C, st.rem_C, st.p_MM,
             qext_M, st.v_M, z_M, st.elem_M, st.used_M, st.h_1, st.r_1, st.live_1, st.bad_1, j_1,
             g_1, scal_2, flags_3, kkt_P, st.tol_1, st.pending_1, st.gram_NN, st.rows_MN, st.ridge_1,
             n, m, pool, float(tols[0]), float(tols[1]), st.rows_MN.stride(0), st.gram_NN.stride(0), st.gram_NN.stride(1)),
        )
        block_c = _next_pow2(min(c, 1024))
        self.constexprs = (
            dict(BLOCK_ARGMAX=min(b["argmax"], _next_pow2(n)), BLOCK_S=b["slots"], BLOCK_K=b["reduce"], BLOCK_C=block_c),
            dict(BLOCK_N=b["pool"], BLOCK_K=b["reduce"], BLOCK_Z=block_z),
            dict(BLOCK_N=b["pool"], BLOCK_R=b["p_rows"], BLOCK_K=b["reduce"], BLOCK_T=_next_pow2(pool),
                 BLOCK_Z=block_z, PROMOTE=float(tols[1]) > 0),
        )
        self.fused = bool(b["fused"])
        self.warps = b["warps"]
        self.kernels = _jitted(_interpreting())

    def __call__(self, kkt: bool) -> None:
        fused = self.fused and not kkt  # the KKT check needs the whole pool's new gradient: three kernels then
        for i in (0, 2) if fused else (0, 1, 2):
            extra = {} if i == 0 else {"KKT": kkt} if i == 1 else {"KKT": kkt, "FUSED": fused}
            self.kernels[i][self.grids[i]](*self.args[i], **self.constexprs[i], **extra, num_warps=self.warps)
