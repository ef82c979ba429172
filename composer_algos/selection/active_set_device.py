"""Greedy OMP with the exact refit, every decision kept on the device: no host sync in the rounds.

# Shape legend: N pool size, C domains, K rounds (picks), M slots (K + 1).

`ActiveSetState` (active_set.py) decides each round on the host: it reads the pick, the Schur
complement and the smallest new weight back (one sync a pick) and branches. On a GPU that sync,
not the arithmetic, is the cost (issue 31: 116 ms for n = 2048, kappa = 512 on an H200, well under a
millisecond of kernels). The common round needs none of those branches: the pick has a positive
gradient, its Schur complement is well above the pivot and float32 promotion tolerances, no active
weight turns negative and no element left at weight zero wants back in. `omp_exact_on_device` runs
every round as that common round, written with masks (a pick whose gradient is not positive
selects at weight zero, as the host loop does) and raises a device flag when any other branch
would have been taken (a singular or ill-conditioned pivot, a Lawson-Hanson drop, a KKT re-entry,
or a final refactorisation that disagrees). The caller reads that flag once, with the result, and
re-runs the host loop from the start when it is set: the selection is then the host loop's.

The arithmetic of a round is the host loop's (the same products, in the same order, over every
slot: the host's `full_width` form), so on the common path the picks are the host loop's up to
the rounding of the final refactorisation (tests/selection/test_active_set_device.py compares
them). Every round has the same shapes and no host read, and updates its state in place: on CUDA
(from `GRAPH_MIN_ROUNDS` picks) the first round runs eagerly, the second is recorded as a CUDA graph
and the rest replay it, one launch a round instead of about 50 (issue 31.3's 10 ms at n = 2048,
kappa = 512 needs that, and more: on an H200 the graphed rounds equal the eager ones bit for bit, but
that instance's solve met a drop and went to the host loop, 168 ms against its 122; the rounds are
still about 50 small kernels each; docs/results/bench_gpu.md).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["GRAPH_MIN_ROUNDS", "DeviceOMPResult", "omp_exact_on_device"]

# From this many rounds the CUDA rounds are recorded once as a CUDA graph and replayed: recording costs
# about what a few eager rounds launch, and every replayed round saves about 50 launches.
GRAPH_MIN_ROUNDS = 16


@dataclass(frozen=True)
class DeviceOMPResult:
    """What `omp_exact_on_device` returns, all on the device.

    Attributes:
        sel_K: the picks in order.
        v_K: their weights ``v`` (0 for the picks left at weight zero).
        phi: the scale-free objective (0-dim).
        clean: 0-dim bool, True when every round took the common path and the final refactorisation
            agreed: the result is the exact OMP's. False: discard it and run the host loop.
    """

    sel_K: torch.Tensor
    v_K: torch.Tensor
    phi: torch.Tensor
    clean: torch.Tensor


def omp_exact_on_device(
    gram_NN: torch.Tensor,
    mu_N: torch.Tensor,
    dom_N: torch.Tensor,
    capacities_C: torch.Tensor,
    k: int,
    ridge_abs: torch.Tensor | float,
    grad_tol: torch.Tensor,
    *,
    graph: bool | None = None,
    compile: bool = False,
) -> DeviceOMPResult:
    """Greedy OMP over the partition matroid with the exact NNLS refit, no host read (module docstring).

    Args:
        gram_NN: ``K`` (no ridge), ``(N, N)``.
        mu_N: the linear term.
        dom_N: int64 domain ids.
        capacities_C: int64 capacities (on any device).
        k: rounds, ``1 <= k <= N``.
        ridge_abs: the absolute ridge (a float, or a device scalar to avoid reading it).
        grad_tol: 0-dim tensor; gradients at or below it count as zero.
        graph: run the rounds as one CUDA graph replayed k - 1 times after an eager first round
            (`_rounds_as_cuda_graph`: one launch a round instead of about 50); None: on CUDA from
            `GRAPH_MIN_ROUNDS` rounds. The same kernels as the eager rounds, so the same result.
        compile: run each round as `_round` compiled (`torch.compile`, one graph, static shapes): the
            same arithmetic in a few fused kernels instead of about 45 ops (the picks are the eager
            rounds' but among near-ties, and the weights may differ in the last bits: fused
            reductions round in their own order). Dynamo compiles at most 8 shapes of the round
            per process (its recompile limit); past that the rounds run eagerly. With `graph`, the
            compiled round is what the CUDA graph records.

    Raises:
        ValueError: `graph=True` off CUDA.
    """
    n, dev, dt = mu_N.shape[0], mu_N.device, mu_N.dtype
    if graph and dev.type != "cuda":
        raise ValueError(f"omp_exact_on_device: graph=True needs CUDA tensors, got {dev.type}")
    m = k + 1
    if isinstance(ridge_abs, torch.Tensor):
        ridge_1 = ridge_abs.to(dt).reshape(1)
    else:
        ridge_1 = torch.full((1,), float(ridge_abs), dtype=dt, device=dev)  # a fill, not a copy from the host
    tol_1 = grad_tol.to(dt).reshape(1)
    diag_N = torch.diagonal(gram_NN)
    # The host loop's tolerances: a Schur complement at or below pivot_tol K_jj is a dependent column
    # (a slow refit there); below promote_tol K_jj a float32 state moves to float64 (a refit too).
    pivot_tol = 64.0 * torch.finfo(dt).eps
    promote_tol = 1e4 * torch.finfo(dt).eps if dt == torch.float32 else 0.0
    rows_MN = torch.zeros(m, n, dtype=dt, device=dev)
    p_MM = torch.zeros(m, m, dtype=dt, device=dev)
    v_M = torch.zeros(m, dtype=dt, device=dev)
    elem_M = torch.zeros(m, dtype=torch.long, device=dev)
    used_M = torch.zeros(m, dtype=torch.bool, device=dev)
    grad_N = mu_N.clone()
    inactive_N = torch.zeros(n, dtype=torch.bool, device=dev)
    sel_K = torch.zeros(k, dtype=torch.long, device=dev)
    bad_1 = torch.zeros(1, dtype=torch.bool, device=dev)
    h_1 = torch.zeros(1, dtype=torch.long, device=dev)  # the next slot: no drops here, so slots fill in order
    rem_C = capacities_C.to(dev, non_blocking=True).clone()  # capacities are often resolved on the host
    domains_C = torch.arange(rem_C.shape[0], dtype=dom_N.dtype, device=dev)
    penalty_N = torch.zeros(n, dtype=dt, device=dev)
    penalty_N.masked_fill_(rem_C.index_select(0, dom_N) <= 0, float("-inf"))
    r_1 = torch.zeros(1, dtype=torch.long, device=dev)  # the round, on the device: every round is the same kernels
    state = (gram_NN, diag_N, dom_N, ridge_1, tol_1, rows_MN, p_MM, v_M, elem_M, used_M, grad_N, inactive_N, sel_K,
             bad_1, h_1, rem_C, penalty_N, r_1, domains_C)
    round_fn = _compiled_round() if compile else _round

    def one_round() -> None:
        round_fn(*state, pivot_tol, promote_tol)

    if graph is None:
        graph = dev.type == "cuda" and k >= GRAPH_MIN_ROUNDS
    if graph:
        _rounds_as_cuda_graph(one_round, k)
    else:
        for _ in range(k):
            one_round()
    return _finalized(mu_N, rows_MN, elem_M, used_M, inactive_N, sel_K, bad_1, ridge_1, tol_1)


def _finalized(
    mu_N: torch.Tensor,
    rows_MN: torch.Tensor,
    elem_M: torch.Tensor,
    used_M: torch.Tensor,
    inactive_N: torch.Tensor,
    sel_K: torch.Tensor,
    bad_1: torch.Tensor,
    ridge_1: torch.Tensor,
    tol_1: torch.Tensor,
) -> DeviceOMPResult:
    """The host loop's finalize(): the active system solved afresh (unused slots as identity rows).

    `clean` is False when a round flagged another branch or the fresh weights disagree with the rounds'.
    """
    n, m, dt, dev = mu_N.shape[0], elem_M.shape[0], mu_N.dtype, mu_N.device
    kr_MM = rows_MN.index_select(1, elem_M)
    pair_MM = used_M.unsqueeze(1) & used_M.unsqueeze(0)
    eye_MM = torch.eye(m, dtype=dt, device=dev)
    kr_MM = torch.where(pair_MM, kr_MM + ridge_1 * eye_MM, eye_MM)
    chol_MM, info = torch.linalg.cholesky_ex(kr_MM)
    mu_M = torch.where(used_M, mu_N.index_select(0, elem_M), 0.0)
    v_fresh_M = torch.where(used_M, torch.cholesky_solve(mu_M.unsqueeze(1), chol_MM).squeeze(1), 0.0)
    grad_N = torch.addmv(mu_N, rows_MN.T, v_fresh_M, alpha=-1.0)
    agrees = (info == 0) & ~(used_M & ~(v_fresh_M > 0)).any() & ~((grad_N > tol_1) & inactive_N).any()
    clean = ~bad_1.squeeze(0) & agrees
    v_N = torch.zeros(n, dtype=dt, device=dev).index_add_(0, elem_M, v_fresh_M)
    v_K = v_N.index_select(0, sel_K)
    phi = 0.5 * (torch.dot(v_fresh_M, mu_N.index_select(0, elem_M)) + torch.dot(v_fresh_M, grad_N.index_select(0, elem_M)))
    return DeviceOMPResult(sel_K=sel_K, v_K=v_K, phi=phi, clean=clean)


def _round(
    gram_NN: torch.Tensor,
    diag_N: torch.Tensor,
    dom_N: torch.Tensor,
    ridge_1: torch.Tensor,
    tol_1: torch.Tensor,
    rows_MN: torch.Tensor,
    p_MM: torch.Tensor,
    v_M: torch.Tensor,
    elem_M: torch.Tensor,
    used_M: torch.Tensor,
    grad_N: torch.Tensor,
    inactive_N: torch.Tensor,
    sel_K: torch.Tensor,
    bad_1: torch.Tensor,
    h_1: torch.Tensor,
    rem_C: torch.Tensor,
    penalty_N: torch.Tensor,
    r_1: torch.Tensor,
    domains_C: torch.Tensor,
    pivot_tol: float,
    promote_tol: float,
) -> None:
    """One common round of `omp_exact_on_device`, every state tensor (from `rows_MN` on) updated in place,
    so the round can be recorded once and replayed, and compiled as one graph (`_compiled_round`)."""
    m = p_MM.shape[0]
    rows_NM = rows_MN.T
    scores_N = grad_N + penalty_N
    g_1, j_1 = torch.max(scores_N, 0, keepdim=True)
    penalty_N.index_fill_(0, j_1, float("-inf"))
    sel_K.index_copy_(0, r_1, j_1)
    r_1.add_(1)
    # Slot h takes j's K row; q^T = k_Aj^T P over every slot (unused ones have zero P rows).
    rows_MN.index_copy_(0, h_1, gram_NN.index_select(0, j_1))
    qext_M = torch.mm(rows_MN.index_select(1, j_1).view(1, m), p_MM).view(m)
    qext_M.index_fill_(0, h_1, -1.0)
    t_N = torch.mv(rows_NM, qext_M)
    schur_1 = ridge_1 - t_N.index_select(0, j_1)
    z_j = g_1 / schur_1
    z_M = torch.addcmul(v_M, qext_M, z_j, value=-1.0)
    grad_new_N = torch.addcmul(grad_N, t_N, z_j)
    diag_j = diag_N.index_select(0, j_1)
    positive = g_1 > tol_1
    # The host loop's other branches, each a hand-over: a dependent column (a slow refit there), an
    # ill-conditioned float32 one (promotion to float64) and a Lawson-Hanson drop. Its KKT re-entry
    # needs an element at weight zero, which only a drop or a pick without a positive gradient
    # leaves; after such a pick no later pick has one either (grad does not move and the feasible
    # set only shrinks), so an entering round never meets one.
    other_branch = ~(schur_1 > pivot_tol * diag_j) | (torch.amin(z_M, 0, keepdim=True) < 0)
    if promote_tol > 0:
        other_branch |= schur_1 < promote_tol * diag_j
    other_branch &= positive
    bad_1.logical_or_(other_branch)
    enter = positive & ~other_branch
    # Enter j at slot h (P <- P + qext qext^T / s), or leave everything as it was. Slot h is free
    # either way (slots fill in order: no drops here), so its element may be written regardless.
    p_MM.addr_(torch.where(enter, qext_M / schur_1, 0.0), qext_M)
    elem_M.index_copy_(0, h_1, j_1)
    used_M.index_copy_(0, h_1, enter)
    torch.where(enter, z_M, v_M, out=v_M)
    torch.where(enter, grad_new_N, grad_N, out=grad_N)
    h_1.add_(enter.long())
    inactive_N.index_copy_(0, j_1, ~positive)  # a pick with a gradient at or below zero stays at weight 0
    # j's domain loses one unit of capacity: a comparison with the domain ids, not a scatter (an int64
    # scatter-add is not fused by inductor: on CUDA it falls back to a sorting index_put_ of ~10 kernels).
    rem_C.sub_((domains_C == dom_N.index_select(0, j_1)).to(rem_C.dtype))
    penalty_N.masked_fill_(rem_C.index_select(0, dom_N) <= 0, float("-inf"))


@functools.cache
def _compiled_round():
    """`_round` compiled as one graph (`solver_loop: device_compiled`): its ~45 ops become a few fused
    kernels around the two products (on a CPU, 2 fused loops and the GEMM; the CUDA count is gpu_bench's).
    Static shapes: one compilation per pool size, kappa and dtype, which a run keeps fixed."""
    # On a CPU, one thread: a round's loops are a few thousand elements, and OpenMP's barriers between them
    # cost milliseconds a round when the cores are shared (measured: 31 ms a round with 2 threads beside a
    # training run, on the 2-core VM). The CUDA code is not affected.
    return torch.compile(_round, fullgraph=True, dynamic=False, options={"cpp.threads": 1})


def _rounds_as_cuda_graph(one_round, k: int) -> None:
    """Run `one_round` k times: once eagerly on a side stream (the warm-up capture needs, which also
    initialises the libraries' handles), then recorded as a CUDA graph (recording runs nothing) and
    replayed k - 1 times. Every tensor the round writes is allocated before it, so replays update them."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        one_round()
    torch.cuda.current_stream().wait_stream(side)
    if k == 1:
        return
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        one_round()
    for _ in range(k - 1):
        g.replay()

