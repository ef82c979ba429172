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

A kernel this small takes the time of its chain of dependent loads, each a trip to L2, not of its arithmetic: a
warp stalls at the first use of a value still in flight. So the pick and apply kernels issue every load as soon as
its address is known: the state's scalars first (live, h, the pick, its score, the counters), then at once
everything that needs only those (the first block of slots of ``P``, of the K rows and of ``qext``, the scores,
the pending weights, the program's pool block and P rows, the pick's K row), then the capacities of the block's
domains; the loops over the slots run only past that first block, and a frozen state stores nothing rather than
loading nothing. Before (2026-11-28), each step of a loop over the slots, the argmax, and the loads behind each
branch waited in turn: an H200 took 0.86-0.87x (seed 0) and 0.82-0.85x (seed 1) the whole selection's time with the
loads issued early, interleaved in one process (docs/results/bench_gpu.md, the seventh run).

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
# reduced per step of their loops (the first step's loads are issued with the state's other loads, before the pick:
# see `_pick_kernel`), P rows per program of the apply kernel, pool elements per step of the argmax. At n = 2048,
# kappa = 512 the grids are 33, 128 and 128 + 129 programs, and the slots in use fit the first block of 256 in the
# first half of a solve, two blocks after; "warps" is the launches' num_warps; "fused" 1 runs the rounds before the
# first drop as two kernels (the apply kernel's FUSED variant). Measured on an H200 (docs/results/bench_gpu.md,
# 2026-11-28, the seventh run; whole selections interleaved in one process against the kernels before, whose loads
# each waited for the previous step): these sizes took 0.86-0.87x their time on seed 0 and 0.82-0.85x on seed 1;
# 512 slots a step and 8 P rows a program 0.89-0.90x and 0.84-0.88x; the sizes before (32 slots and pool elements,
# 16 P rows, 128 slots a step) with the loads issued early 0.91-0.94x; 1024 slots a step 0.93-1.29x (below 1 only
# with 16 pool elements, 8 slots, 4 P rows and 8 warps).
# "fused" 1 took 0.90x and 0.89x the three kernels' time (the sixth run): its default since.
BLOCKS = {"slots": 16, "pool": 16, "reduce": 256, "p_rows": 4, "argmax": 2048, "warps": 4, "fused": 1}
# What the sweep tries beside `BLOCKS` (each entry overrides some of them): the sizes before the seventh run, its
# first choice, and the default's neighbours.
SWEEP = (
    {"slots": 32, "pool": 32, "reduce": 128, "p_rows": 16},
    {"reduce": 512, "p_rows": 8},
    {"reduce": 128},
    {"reduce": 512},
    {"p_rows": 2},
    {"p_rows": 8},
    {"pool": 8, "slots": 8},
    {"slots": 8},
    {"warps": 8},
    {"fused": 0},
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
    # Every load that does not wait for the pick is issued before it, in as few dependent steps as the data allow
    # (the state's scalars; then P's first slot block, the scores and the pending weights; then the pick's column of
    # the K rows): a round is a chain of such steps, each a trip to L2, and the launch's time is mostly their wait.
    pid = tl.program_id(0)
    live = tl.load(live_1) != 0
    h = tl.load(h_1)
    pending = tl.load(pending_1) != 0
    r = tl.load(r_1)
    if pid == 0:  # snapshots for the apply kernel, whose program 0 writes live, h and the capacities
        tl.store(flags + 1, live.to(tl.int32))
        tl.store(flags + 2, h.to(tl.int32))
        for c0 in range(0, C, BLOCK_C):
            cs = c0 + tl.arange(0, BLOCK_C)
            tl.store(rem_snap + cs, tl.load(rem_C + cs, mask=cs < C, other=0), mask=cs < C)
    cols = pid * BLOCK_S + tl.arange(0, BLOCK_S)
    cmask = cols < M
    # The first block of slots of P's columns: P's rows from slot h on are zero (free slots, packed last), so only the
    # first h are read, and the loop below runs only past BLOCK_K slots in use.
    ms0 = tl.arange(0, BLOCK_K).to(tl.int64)
    use0 = (ms0 < h) & (ms0 < M)  # h < M in every launched round; the bound keeps the loads in P without relying on it
    tile0 = tl.load(p + ms0[:, None] * M + cols[None, :], mask=use0[:, None] & cmask[None, :], other=0.0)
    vnext_s = tl.load(vnext + cols, mask=cmask & pending, other=0.0)
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
    # A frozen state (a round waiting for its repair) runs no round: the batch's remaining launches return at once.
    if live:
        # The last fused round's new weights, which it could not write (all its programs read v): a block each.
        tl.store(v + cols, vnext_s, mask=cmask & pending)
        j = bidx.to(tl.int64)
        # The products accumulate in a tile, reduced over the slots once after the loop (a reduction across warps
        # at every step would wait for a barrier each time).
        acc = tl.load(rows + ms0 * stride_r + j, mask=use0, other=0.0)[:, None] * tile0
        for m0 in range(BLOCK_K, h, BLOCK_K):
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
    # As in `_pick_kernel`, every load is issued as soon as what it needs is: the state's scalars, then everything
    # else (the pick's K row, the first block of slots, this program's pool block or P rows), then the capacities
    # of its block's domains; the arithmetic and the stores follow.
    pid = tl.program_id(0)
    started = tl.load(flags + 1) != 0  # live when the round began (a frozen state runs no round)
    h = tl.load(flags + 2).to(tl.int64)
    g = tl.load(gbuf)
    j = tl.load(jbuf)
    tol = tl.load(tol_1)
    bad = tl.load(bad_1) != 0
    r = tl.load(r_1)
    pool_prog = pid < pool_programs
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = (cols < N) & pool_prog  # the P-row programs load no pool block
    zs = pid * BLOCK_Z + tl.arange(0, BLOCK_Z)
    zmask = (zs < M) & pool_prog
    # The first block of slots, 0..h (qext, v and P's columns are zero past h): with BLOCK_K above h, all of them.
    ms0 = tl.arange(0, BLOCK_K).to(tl.int64)
    in0 = (ms0 <= h) & (ms0 < M)  # h < M in every launched round; the bound keeps the loads in range without relying on it
    q0 = tl.load(qext + ms0, mask=in0, other=0.0)
    if FUSED:  # `_direction_kernel`'s part here: every program computes the round's scalars itself
        kjj = tl.load(gram + j * stride_g0 + j * stride_g1)
        krow = tl.load(gram + j * stride_g0 + cols.to(tl.int64) * stride_g1, mask=cmask, other=0.0)
        # Row h is K[j] this round, substituted rather than loaded (the pool programs write it below).
        row0 = in0 & (ms0 != h)
        tile0 = tl.load(rows + ms0[:, None] * stride_r + cols[None, :], mask=row0[:, None] & cmask[None, :], other=0.0)
        rj0 = tl.load(rows + ms0 * stride_r + j, mask=row0, other=0.0)
        v0 = tl.load(v + ms0, mask=in0, other=0.0)
        ridge = tl.load(ridge_1)
        v_z = tl.load(v + zs, mask=zmask, other=0.0)
    else:
        schur = tl.load(scal)
        kjj = tl.load(scal + 1)
        repair = tl.load(flags) != 0
        gnew_b = tl.load(gnew + cols, mask=cmask, other=0.0)
        z_z = tl.load(zbuf + zs, mask=zmask, other=0.0)
    q_z = tl.load(qext + zs, mask=zmask, other=0.0)
    grad_b = tl.load(grad + cols, mask=cmask, other=0.0)
    pen = tl.load(penalty + cols, mask=cmask, other=0.0)
    dm = tl.load(dom + cols, mask=cmask, other=0)
    dom_j = tl.load(dom + j)
    # P's rows of this program (the P-row programs), their first block of columns.
    rs = ((pid - pool_programs) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    rmask = (rs <= h) & (pool_prog == 0)
    qa = tl.load(qext + rs, mask=rmask, other=0.0)
    ptile0 = tl.load(p + rs[:, None] * M + ms0[None, :], mask=rmask[:, None] & in0[None, :], other=0.0)
    rem_b = tl.load(rem_snap + dm, mask=cmask, other=1)
    rem_j = tl.load(rem_snap + dom_j)
    if started:
        if FUSED:
            acc = tl.where(ms0[:, None] == h, krow[None, :], tile0) * q0[:, None]
            tj = tl.where(ms0 == h, kjj, rj0) * q0
            for m0 in range(BLOCK_K, h + 1, BLOCK_K):  # as `_direction_kernel`
                ms = (m0 + tl.arange(0, BLOCK_K)).to(tl.int64)
                mmask = ms < M
                q = tl.load(qext + ms, mask=mmask, other=0.0)
                live_row = mmask & (ms != h)
                tile = tl.load(rows + ms[:, None] * stride_r + cols[None, :], mask=live_row[:, None] & cmask[None, :], other=0.0)
                acc += tl.where(ms[:, None] == h, krow[None, :], tile) * q[:, None]
                tj += tl.where(ms == h, kjj, tl.load(rows + ms * stride_r + j, mask=live_row, other=0.0)) * q
            schur = ridge - tl.sum(tj, 0)
            zj = g / schur
            neg = ((v0 - q0 * zj < 0) & in0).to(tl.int32)
            for m0 in range(BLOCK_K, h + 1, BLOCK_K):  # z is zero past h (v and qext are)
                ms = m0 + tl.arange(0, BLOCK_K)
                mmask = ms < M
                z = tl.load(v + ms, mask=mmask, other=0.0) - tl.load(qext + ms, mask=mmask, other=0.0) * zj
                neg = tl.maximum(neg, ((z < 0) & mmask).to(tl.int32))
            repair = tl.max(neg, 0) != 0
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
        if pool_prog:
            if FUSED:
                tl.store(grad + cols, grad_b + tl.sum(acc, 0) * zj, mask=cmask & enter)
                tl.store(rows + h * stride_r + cols, krow, mask=cmask)
                # Every program reads v: the new weights wait in zbuf for the next round's pick kernel (pending).
                tl.store(zbuf + zs, v_z - q_z * zj, mask=zmask)
            else:
                tl.store(grad + cols, gnew_b, mask=cmask & enter)
                tl.store(v + zs, z_z, mask=zmask & enter)
            rem = rem_b - ((dm == dom_j) & live).to(tl.int64)
            pen = tl.where(((cols == j) & live) | (rem <= 0), float("-inf"), pen)
            tl.store(penalty + cols, pen, mask=cmask)
            if pid == 0:
                if FUSED:
                    tl.store(pending_1, enter)
                else:
                    tl.store(pending_1, 0)  # this kernel wrote v itself
                tl.store(bad_1, bad | (stop & host_only))
                tl.store(live_1, live)
                tl.store(elem + h, j)
                tl.store(used + h, enter)
                tl.store(h_1, h + enter.to(tl.int64))
                tl.store(r_1, r + live.to(tl.int64))
                tl.store(inactive + j, live & (positive == 0))  # a pick at a gradient not above zero stays at weight 0
                tl.store(rem_C + dom_j, rem_j - live.to(tl.int64))
        else:
            # P += qext qext^T / s over slots 0..h (qext is zero past h): row blocks past h have nothing to do.
            pmask = (rmask & enter)[:, None] & in0[None, :]
            qs = qa / schur
            tl.store(p + rs[:, None] * M + ms0[None, :], ptile0 + qs[:, None] * q0[None, :], mask=pmask)
            for c0 in range(BLOCK_K, h + 1, BLOCK_K):
                cs = c0 + tl.arange(0, BLOCK_K)
                mask = (rmask & enter)[:, None] & (cs < M)[None, :]
                ptr = p + rs[:, None] * M + cs[None, :]
                qb = tl.load(qext + cs, mask=cs < M, other=0.0)
                tl.store(ptr, tl.load(ptr, mask=mask, other=0.0) + qs[:, None] * qb[None, :], mask=mask)


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
        block_k = min(b["reduce"], _next_pow2(m))  # no wider than the slots: one block holds them all at most
        self.constexprs = (
            dict(BLOCK_ARGMAX=min(b["argmax"], _next_pow2(n)), BLOCK_S=b["slots"], BLOCK_K=block_k, BLOCK_C=block_c),
            dict(BLOCK_N=b["pool"], BLOCK_K=block_k, BLOCK_Z=block_z),
            dict(BLOCK_N=b["pool"], BLOCK_R=b["p_rows"], BLOCK_K=block_k, BLOCK_T=_next_pow2(pool),
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
