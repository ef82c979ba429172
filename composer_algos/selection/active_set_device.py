"""Greedy OMP with the exact refit, its rounds on the device: a host read every `ROUNDS_PER_READ` rounds.

# Shape legend: N pool size, C domains, K rounds (picks), M slots (K + 1).

`ActiveSetState` (active_set.py) decides each round on the host: it reads the pick, the Schur
complement and the smallest new weight back (one sync a pick) and branches. On a GPU that sync,
not the arithmetic, is the cost (issue 31: 116 ms for n = 2048, kappa = 512 on an H200, well under a
millisecond of kernels). The common round needs none of those branches: the pick has a positive
gradient, its Schur complement is well above the pivot and float32 promotion tolerances, no active
weight turns negative and no element left at weight zero wants back in. `omp_exact_on_device` runs
every round as that common round, written with masks (a pick whose gradient is not positive
selects at weight zero, as the host loop does), and reads the device once every `ROUNDS_PER_READ`
rounds, and once more for the final refactorisation's check (a solve within one batch reads it with the batch):

- A round that would need a Lawson-Hanson drop, or (once a weight has dropped) a KKT re-entry, applies
  nothing and freezes the state, so the rest of its batch of rounds changes nothing. The read finds
  it; `_repair` then runs that round on the device state with its drops and re-entries decided on the
  host (a read each: drops are rare, 2 drops and 2 re-entries in 512 picks on bench_selection's seed
  0 on an H100, none on seed 1), packs the active slots first again, and the rounds go on, in short
  batches at first (`ROUNDS_AFTER_REPAIR`: repairs come in clusters). Its device work between two reads
  is a segment that takes no host value (`_RepairSteps`), so on CUDA each segment is a CUDA graph from
  its second use, replayed from the workspace; eager, a repair was about 115 ops.
- A round that would need the host loop's other branches (a singular or ill-conditioned pivot: a slow
  refit there, or float32 promoted to float64), or a final refactorisation that disagrees, makes the
  result not `clean`: the caller runs the host loop from the start, and the selection is its.

The arithmetic of a round is the host loop's (the same products over every slot: the host's
`full_width` form), so the picks are the host loop's up to the rounding of the final refactorisation,
which may decide among near-ties (tests/selection/test_active_set_device.py compares them). Every
round has the same shapes and no host read, and updates its state in place: on CUDA (from
`GRAPH_MIN_ROUNDS` picks) the first round runs eagerly, then `ROUNDS_PER_GRAPH` rounds are recorded as
one CUDA graph and replayed (a one-round graph takes a batch's remainder): one launch for 16 rounds of
about 60 kernels each (the graphed rounds equal the eager ones bit for bit on an H100 and an H200,
docs/results/bench_gpu.md). Issue 31.3's 10 ms at n = 2048, kappa = 512 also needs fewer kernels a round:
`compile` fuses them into 12 on CUDA, `triton` runs two or three hand-written ones (`omp_triton`). After a
repair the rounds also check the elements at weight zero (one reduction more), recorded as other graphs.
Graphs replay on the memory they were recorded on, so with graphs a solve runs in its thread's workspace for
its shapes (`_Workspace`: K copied in), and the next solve of those shapes, a training run's next step,
replays the graphs the first recorded instead of recording its own. A workspace also replays its state's
restart (`_Rounds.restart`: 18 kernels) and the final refactorisation (`_Final`: about 45, the Cholesky
factorisation and solve among them) as graphs: launched one by one, the host kept the GPU waiting on them
(0.92x the whole selection's time at n = 2048, kappa = 512 on an H200, docs/results/bench_gpu.md).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from dataclasses import dataclass

import torch

from composer_algos.selection.active_set import drop_slot, first_to_zero, lawson_hanson_buffers
from composer_algos.selection.omp_triton import TritonRound, kernels_available

__all__ = ["GRAPH_MIN_ROUNDS", "REPAIR_GRAPHS", "ROUNDS_AFTER_REPAIR", "ROUNDS_PER_GRAPH", "ROUNDS_PER_READ", "DeviceOMPResult", "omp_exact_on_device"]

# From this many rounds the CUDA rounds are recorded as CUDA graphs and replayed: recording costs about what
# a few eager rounds launch, and every replayed round saves about 60 launches.
GRAPH_MIN_ROUNDS = 16
# Rounds between two host reads: a round frozen for a repair wastes at most this many rounds of device
# work, and a solve without one reads ceil(k / ROUNDS_PER_READ) times and once for its final check (once in all
# within one batch, as the recipes' 8 picks a rank).
ROUNDS_PER_READ = 64
# Rounds in the first batch after a repair; the batches then double back to ROUNDS_PER_READ. Repairs come in
# clusters (a drop, then a round or a few later the dropped element wants back in): bench_selection's seed 0
# (n = 2048, kappa = 512) repairs rounds 486, 487, 492 and 497, and with a whole batch after each it launched 594
# rounds for 512 picks, 554 with this. A frozen round costs a GPU a few microseconds (its kernels return at
# once), a read some tens: so 4, then 8, 16, ...
ROUNDS_AFTER_REPAIR = 4
# With graphs, a repair's segments replay as CUDA graphs from their second use (`_RepairSteps`); False runs them
# eagerly, as before 2026-11-27 (`tools/bench/bench_selection.py --triton` times both side by side).
REPAIR_GRAPHS = True
# Rounds one CUDA graph holds: a replay costs the host some microseconds whatever it holds (not measured here),
# comparable to a fused round's GPU time, so a graph holds this many rounds (a batch's remainder replays a
# one-round graph: the first batch of a solve, 63 rounds after the warm-up, replays 3 of 16 and 15 of one).
ROUNDS_PER_GRAPH = 16


@dataclass(frozen=True)
class DeviceOMPResult:
    """What `omp_exact_on_device` returns: the selection on the device, the counts on the host.

    Attributes:
        sel_K: the picks in order.
        v_K: their weights ``v`` (0 for the picks left at weight zero).
        phi: the scale-free objective (0-dim).
        clean: True when every round took the common path or was repaired, and the final refactorisation
            agreed: the result is the exact OMP's. False: discard it and run the host loop.
        drops: Lawson-Hanson drops the repairs made.
        reentries: KKT re-entries the repairs made.
        reads: host reads of the device (the batches' reads and the repairs').
        rounds: rounds launched, the frozen ones included (each frozen round is device time wasted: a batch's
            rounds after a freeze run, changing nothing, until the batch's read).
    """

    sel_K: torch.Tensor
    v_K: torch.Tensor
    phi: torch.Tensor
    clean: bool
    drops: int = 0
    reentries: int = 0
    reads: int = 0
    rounds: int = 0


@dataclass
class _State:
    """The rounds' tensors, every one updated in place (CUDA graphs replay on their memory)."""

    gram_NN: torch.Tensor
    diag_N: torch.Tensor
    dom_N: torch.Tensor
    mu_N: torch.Tensor  # the linear term (the repairs' gradient afresh)
    ridge_1: torch.Tensor
    tol_1: torch.Tensor
    rows_MN: torch.Tensor  # K row of each slot's element (stale on free slots)
    p_MM: torch.Tensor  # (K_AA + ridge I)^{-1} by slot; zero rows and columns on free slots
    v_M: torch.Tensor  # the weights by slot; zero on free slots
    elem_M: torch.Tensor  # each slot's element (stale on free slots)
    used_M: torch.Tensor  # the active slots: [0, h) after every repair, filled in order by the rounds
    grad_N: torch.Tensor  # mu - K_{:,A} v_A
    inactive_N: torch.Tensor  # selected at weight zero
    sel_K: torch.Tensor
    bad_1: torch.Tensor  # a round needed a branch only the host loop takes
    h_1: torch.Tensor  # the next slot
    rem_C: torch.Tensor  # capacity left per domain
    penalty_N: torch.Tensor  # -inf where unavailable (selected, or its domain full)
    r_1: torch.Tensor  # rounds done
    domains_C: torch.Tensor
    live_1: torch.Tensor  # False from a round that needs a repair until the repair is made
    # The fused Triton rounds' new weights, copied into v_M by the next round's first kernel while pending_1 is set.
    vnext_M: torch.Tensor
    pending_1: torch.Tensor

    def round_args(self) -> tuple[torch.Tensor, ...]:
        return (self.gram_NN, self.diag_N, self.dom_N, self.ridge_1, self.tol_1, self.rows_MN, self.p_MM, self.v_M,
                self.elem_M, self.used_M, self.grad_N, self.inactive_N, self.sel_K, self.bad_1, self.h_1, self.rem_C,
                self.penalty_N, self.r_1, self.domains_C, self.live_1)


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
    triton: bool = False,
    rounds_per_read: int = ROUNDS_PER_READ,
    reuse: bool | None = None,
) -> DeviceOMPResult:
    """Greedy OMP over the partition matroid with the exact NNLS refit, rounds without a host read (module docstring).

    Args:
        gram_NN: ``K`` (no ridge), ``(N, N)``.
        mu_N: the linear term.
        dom_N: int64 domain ids.
        capacities_C: int64 capacities (on any device).
        k: rounds, ``1 <= k <= N``.
        ridge_abs: the absolute ridge (a float, or a device scalar to avoid reading it).
        grad_tol: 0-dim tensor; gradients at or below it count as zero.
        graph: run the rounds as CUDA graphs of `ROUNDS_PER_GRAPH` rounds replayed after an eager first
            round (`_Rounds`: one launch for 16 rounds instead of about 60 a round); None: on CUDA from
            `GRAPH_MIN_ROUNDS` rounds. The same kernels as the eager rounds, so the same result.
        compile: run each round as `_round` compiled (`torch.compile`, one graph, static shapes): the
            same arithmetic in a few fused kernels instead of about 60 ops (the picks are the eager
            rounds' but among near-ties, and the weights may differ in the last bits: fused
            reductions round in their own order). Dynamo compiles at most 8 shapes of the round
            per process (its recompile limit); past that the rounds run eagerly. With `graph`, the
            compiled round is what the CUDA graphs record. Repairs run as the eager rounds' (`_RepairSteps`).
        triton: run each round as two or three Triton kernels (`omp_triton`: the same arithmetic, the picks the
            eager rounds' but among near-ties, like `compile`, without torch.compile: Triton compiles its
            three kernels once per dtype, variant and size bucket, cached on disk). Where
            Triton cannot run the rounds (a CPU outside Triton's interpreter) the eager rounds run.
        rounds_per_read: rounds between two host reads (`ROUNDS_PER_READ`).
        reuse: solve in the thread's workspace for these shapes (`_Workspace`: K and the domain ids copied into
            tensors kept from the last such solve, whose CUDA graphs replay without being recorded again);
            None: with `graph`. The result does not alias the workspace.

    Raises:
        ValueError: `graph=True` off CUDA, `rounds_per_read` below 1, or both `compile` and `triton`.
    """
    dev, dt = mu_N.device, mu_N.dtype
    if graph and dev.type != "cuda":
        raise ValueError(f"omp_exact_on_device: graph=True needs CUDA tensors, got {dev.type}")
    if rounds_per_read < 1:
        raise ValueError(f"omp_exact_on_device: rounds_per_read must be at least 1, got {rounds_per_read}")
    if compile and triton:
        raise ValueError("omp_exact_on_device: compile and triton are two ways to run a round; choose one")
    # The host loop's tolerances: a Schur complement at or below pivot_tol K_jj is a dependent column
    # (a slow refit there); below promote_tol K_jj a float32 state moves to float64 (a refit too).
    tols = (64.0 * torch.finfo(dt).eps, 1e4 * torch.finfo(dt).eps if dt == torch.float32 else 0.0)
    if graph is None:
        graph = dev.type == "cuda" and k >= GRAPH_MIN_ROUNDS
    use_triton = triton and kernels_available(dev)
    if triton and not use_triton and dev.type == "cuda":
        warnings.warn("omp_exact_on_device: triton=True but Triton is not installed; the rounds run eagerly", stacklevel=2)
    kind = "compiled" if compile else "triton" if use_triton else "eager"
    if graph if reuse is None else reuse:
        ws = _workspace(gram_NN, mu_N, dom_N, capacities_C, k, ridge_abs, grad_tol, tols, kind, graph)
        st, rounds = ws.st, ws.rounds
    else:
        ws = None
        st = _initial_state(gram_NN, mu_N, dom_N, capacities_C, k, ridge_abs, grad_tol)
        rounds = _Rounds(st, tols, kind=kind, graph=graph)
    try:
        return _solve(st, rounds, k, tols, rounds_per_read)
    finally:
        if ws is not None:
            ws.release()


def _solve(st: _State, rounds: _Rounds, k: int, tols: tuple[float, float], rounds_per_read: int):
    """The batches of rounds from the state before the first round, their reads and repairs, and the final check.

    After a repair the batches start at `ROUNDS_AFTER_REPAIR` rounds and double back to ``rounds_per_read``.
    """
    done = drops = reentries = reads = repairs = launched = 0
    per_read = rounds_per_read
    while True:
        batch = min(per_read, k - done)  # 0 after a repair of the last round: only the final check
        rounds.run(batch, kkt=drops > 0)
        launched += batch
        # The final refactorisation rides on the read of a solve's only batch (a small solve, as the recipes' 8
        # picks a rank: one read in all). A longer solve reads its last batch first: rounds freeze late, as the
        # support grows (bench_selection's seed 0 froze at round 486 of 512 picks), and a frozen last batch wastes
        # the factorisation (0.27 ms of an H200's kernels at kappa = 512), where the extra read costs some microseconds.
        final = rounds.finalize() if done == 0 and batch == k else None
        r, live, bad, agrees = _read_status(st, final)
        reads += 1
        if bad:
            return _result(final if final is not None else rounds.finalize(), False, drops, reentries, reads, launched)
        done = r
        if live:
            per_read = min(2 * per_read, rounds_per_read)
            if done < k:
                continue
            if final is None:
                final = rounds.finalize()
                agrees = bool(final[-1])
                reads += 1
            return _result(final, agrees, drops, reentries, reads, launched)
        fixed = _repair(st, rounds.repair_steps(), tols)  # round `r` froze
        repairs += 1
        drops, reentries, reads = drops + fixed.drops, reentries + fixed.reentries, reads + fixed.reads
        if not fixed.ok:
            return _result(rounds.finalize(), False, drops, reentries, reads, launched)
        done += 1
        per_read = min(ROUNDS_AFTER_REPAIR, rounds_per_read)


class _Workspace:
    """A solve's state and rounds kept for the next solve of the same shapes (`omp_exact_on_device`'s ``reuse``).

    CUDA graphs replay on the memory they were recorded on, so a solve on fresh tensors records its graphs
    afresh: a capture and an instantiation per graph, the host's time while the GPU waits (a solve at
    kappa = 512 records up to four of rounds and five of a repair's segments). A training run solves the same
    shapes every step, so its workspace, K copied
    in, replays the graphs the first solve recorded. Kept per thread, the last `_WORKSPACES_PER_THREAD`
    shapes; on CUDA a solve waits (on the device, not the host) for the previous solve's work on its
    workspace, which may have run on another stream, and a workspace dropped from the cache is first waited
    for on the host (rare: a fifth shape), since its memory returns to the stream that allocated it.
    """

    def __init__(self, st: _State, rounds: _Rounds) -> None:
        self.st, self.rounds = st, rounds
        # Recorded at the end of each solve; before the first, waiting on it or synchronizing it does nothing.
        self.done = torch.cuda.Event() if st.grad_N.device.type == "cuda" else None

    def acquire(self) -> None:
        if self.done is not None:
            torch.cuda.current_stream(self.st.grad_N.device).wait_event(self.done)

    def release(self) -> None:
        if self.done is not None:
            self.done.record(torch.cuda.current_stream(self.st.grad_N.device))


_WORKSPACES_PER_THREAD = 4
_workspaces = threading.local()


def _workspace(gram_NN, mu_N, dom_N, capacities_C, k, ridge_abs, grad_tol, tols, kind, graph) -> _Workspace:
    """The thread's workspace for this solve's shapes, set to the state before its first round (K copied in)."""
    from composer_algos.selection import omp_triton

    n, dev, dt = mu_N.shape[0], mu_N.device, mu_N.dtype
    # Everything the recorded kernels depend on: the shapes, the dtypes, the variant, the Triton block sizes and
    # whether Triton's interpreter runs them.
    triton_key = (tuple(sorted(omp_triton.BLOCKS.items())), omp_triton._interpreting()) if kind == "triton" else ()
    key = (dev, dt, gram_NN.dtype, n, k, capacities_C.shape[0], dom_N.dtype, kind, graph, tols, triton_key)
    cache: dict = getattr(_workspaces, "by_key", None)
    if cache is None:
        cache = _workspaces.by_key = {}
    ws = cache.pop(key, None)
    if ws is not None:
        ws.acquire()
        _reset(ws.st, gram_NN, mu_N, dom_N, capacities_C, ridge_abs, grad_tol, restart=ws.rounds.restart)
    else:
        own_dom = torch.empty(n, dtype=dom_N.dtype, device=dev).copy_(dom_N)
        st = _initial_state(gram_NN.clone(memory_format=torch.contiguous_format), mu_N.clone(), own_dom, capacities_C,
                            k, ridge_abs, grad_tol)
        ws = _Workspace(st, _Rounds(st, tols, kind=kind, graph=graph))
        ws.rounds.keep()  # its graphs recorded in this first solve, so the workspace's next solves record nothing
    cache[key] = ws  # the newest last
    while len(cache) > _WORKSPACES_PER_THREAD:
        old = cache.pop(next(iter(cache)))
        if old.done is not None:
            old.done.synchronize()  # its last solve's work may still be queued on a stream that did not allocate it
    return ws


def _initial_state(
    gram_NN: torch.Tensor,
    mu_N: torch.Tensor,
    dom_N: torch.Tensor,
    capacities_C: torch.Tensor,
    k: int,
    ridge_abs: torch.Tensor | float,
    grad_tol: torch.Tensor,
) -> _State:
    """The state before the first round, on the caller's K and domain ids: no slot used, every element
    available whose domain has room."""
    n, dev, dt = mu_N.shape[0], mu_N.device, mu_N.dtype
    m = k + 1
    st = _State(
        gram_NN=gram_NN, diag_N=torch.diagonal(gram_NN), dom_N=dom_N, mu_N=mu_N, ridge_1=torch.empty(1, dtype=dt, device=dev),
        tol_1=torch.empty(1, dtype=dt, device=dev), rows_MN=torch.empty(m, n, dtype=dt, device=dev),
        p_MM=torch.empty(m, m, dtype=dt, device=dev), v_M=torch.empty(m, dtype=dt, device=dev),
        elem_M=torch.empty(m, dtype=torch.long, device=dev), used_M=torch.empty(m, dtype=torch.bool, device=dev),
        grad_N=torch.empty(n, dtype=dt, device=dev), inactive_N=torch.empty(n, dtype=torch.bool, device=dev),
        sel_K=torch.empty(k, dtype=torch.long, device=dev), bad_1=torch.empty(1, dtype=torch.bool, device=dev),
        h_1=torch.empty(1, dtype=torch.long, device=dev), rem_C=torch.empty(capacities_C.shape[0], dtype=torch.long, device=dev),
        penalty_N=torch.empty(n, dtype=dt, device=dev), r_1=torch.empty(1, dtype=torch.long, device=dev),
        domains_C=torch.arange(capacities_C.shape[0], dtype=dom_N.dtype, device=dev),
        live_1=torch.empty(1, dtype=torch.bool, device=dev), vnext_M=torch.empty(m, dtype=dt, device=dev),
        pending_1=torch.empty(1, dtype=torch.bool, device=dev),
    )
    _reset(st, gram_NN, mu_N, dom_N, capacities_C, ridge_abs, grad_tol)
    return st


def _reset(
    st: _State,
    gram_NN: torch.Tensor,
    mu_N: torch.Tensor,
    dom_N: torch.Tensor,
    capacities_C: torch.Tensor,
    ridge_abs: torch.Tensor | float,
    grad_tol: torch.Tensor,
    *,
    restart=None,
) -> None:
    """``st`` set in place to the state before the first round of a solve: ``gram_NN``, ``mu_N`` and ``dom_N``
    copied into its own (a workspace's) unless they are its own (a fresh state holds the caller's), the ridge, the
    tolerance and the capacities copied in, then the rest from those (``restart``: a workspace's `_Rounds.restart`,
    one CUDA graph for `_restart`'s 18 kernels; None: `_restart` itself)."""
    for own, given in ((st.gram_NN, gram_NN), (st.mu_N, mu_N), (st.dom_N, dom_N)):
        if own is not given:
            own.copy_(given)
    if isinstance(ridge_abs, torch.Tensor):
        st.ridge_1.copy_(ridge_abs.reshape(1))
    else:
        st.ridge_1.fill_(float(ridge_abs))  # a fill, not a copy from the host
    st.tol_1.copy_(grad_tol.reshape(1))
    st.rem_C.copy_(capacities_C, non_blocking=True)  # capacities are often resolved on the host
    if restart is None:
        _restart(st)
    else:
        restart()


def _restart(st: _State) -> None:
    """The part of `_reset` that reads only the state: the gradient from ``mu``, every other buffer zeroed, the
    rounds live, the full domains closed."""
    st.grad_N.copy_(st.mu_N)
    for buf in (st.rows_MN, st.p_MM, st.v_M, st.elem_M, st.used_M, st.inactive_N, st.sel_K, st.bad_1, st.h_1,
                st.penalty_N, st.r_1, st.vnext_M, st.pending_1):
        buf.zero_()
    st.live_1.fill_(True)
    _close_full_domains(st.penalty_N, st.rem_C, st.dom_N)


def _read_status(st: _State, final: tuple | None) -> tuple[int, bool, bool, bool]:
    """The batch's one host read: ``(rounds done, live, bad, final refactorisation agrees)``."""
    parts = [st.r_1, st.live_1.long(), st.bad_1.long()]
    if final is not None:
        parts.append(final[-1].long().view(1))
    r, live, bad, *rest = torch.cat(parts).tolist()
    return r, bool(live), bool(bad), bool(rest and rest[0])


def _result(final: tuple, clean: bool, drops: int, reentries: int, reads: int, rounds: int) -> DeviceOMPResult:
    sel_K, v_K, phi, _ = final
    return DeviceOMPResult(sel_K=sel_K, v_K=v_K, phi=phi, clean=clean, drops=drops, reentries=reentries, reads=reads,
                           rounds=rounds)


def _finalized(st: _State) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The host loop's finalize(): the active system solved afresh (unused slots as identity rows), in new tensors.

    Returns ``(sel_K, v_K, phi, agrees)``; ``agrees`` (one bool) is False when the fresh weights
    disagree with the rounds' (a weight not positive, an element at zero that wants in, a failed factor).
    """
    sel_K, vals_K1, agrees_1 = _final_buffers(st)
    _finalize_into(st, sel_K, vals_K1, agrees_1)
    k = sel_K.shape[0]
    return sel_K, vals_K1[:k], vals_K1[k], agrees_1


def _final_buffers(st: _State) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `_finalize_into` writes: the picks, the weights then ``phi``, and the agreement."""
    k, dev = st.sel_K.shape[0], st.mu_N.device
    return (torch.empty_like(st.sel_K), torch.empty(k + 1, dtype=st.mu_N.dtype, device=dev),
            torch.empty(1, dtype=torch.bool, device=dev))


def _finalize_into(st: _State, sel_K: torch.Tensor, vals_K1: torch.Tensor, agrees_1: torch.Tensor) -> None:
    """`_finalized` into given buffers: the picks, the weights then ``phi``, and the agreement (`_Final`'s graph)."""
    mu_N = st.mu_N
    n, m, dt, dev = mu_N.shape[0], st.elem_M.shape[0], mu_N.dtype, mu_N.device
    used_M, elem_M, rows_MN = st.used_M, st.elem_M, st.rows_MN
    kr_MM = rows_MN.index_select(1, elem_M)
    pair_MM = used_M.unsqueeze(1) & used_M.unsqueeze(0)
    eye_MM = torch.eye(m, dtype=dt, device=dev)
    kr_MM = torch.where(pair_MM, kr_MM + st.ridge_1 * eye_MM, eye_MM)
    chol_MM, info = torch.linalg.cholesky_ex(kr_MM)
    mu_M = torch.where(used_M, mu_N.index_select(0, elem_M), 0.0)
    v_fresh_M = torch.where(used_M, torch.cholesky_solve(mu_M.unsqueeze(1), chol_MM).squeeze(1), 0.0)
    grad_N = torch.addmv(mu_N, rows_MN.T, v_fresh_M, alpha=-1.0)
    agrees = (info == 0) & ~(used_M & ~(v_fresh_M > 0)).any() & ~((grad_N > st.tol_1) & st.inactive_N).any()
    v_N = torch.zeros(n, dtype=dt, device=dev).index_add_(0, elem_M, v_fresh_M)
    k = st.sel_K.shape[0]
    torch.index_select(v_N, 0, st.sel_K, out=vals_K1[:k])
    phi = 0.5 * (torch.dot(v_fresh_M, mu_N.index_select(0, elem_M)) + torch.dot(v_fresh_M, grad_N.index_select(0, elem_M)))
    vals_K1[k:].copy_(phi.view(1))
    sel_K.copy_(st.sel_K)  # a copy: a workspace's next solve rewrites sel_K
    agrees_1.copy_(agrees.view(1))


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
    live_1: torch.Tensor,
    pivot_tol: float,
    promote_tol: float,
    kkt: bool,
) -> None:
    """One common round of `omp_exact_on_device`, every state tensor (from `rows_MN` on) updated in place,
    so the round can be recorded once and replayed, and compiled as one graph (`_compiled_round`).

    `kkt`: also check the elements at weight zero (needed once a weight has dropped; before that, only a
    pick without a positive gradient leaves one, and after such a pick no later pick has one either:
    the gradient does not move and the feasible set only shrinks).
    """
    m = p_MM.shape[0]
    scores_N = grad_N + penalty_N
    g_1, j_1 = torch.max(scores_N, 0, keepdim=True)
    sel_K.index_copy_(0, r_1, j_1)  # overwritten by the repair when the round freezes
    # Slot h takes j's K row; q^T = k_Aj^T P over every slot (free ones have zero P rows).
    rows_MN.index_copy_(0, h_1, gram_NN.index_select(0, j_1))
    qext_M = torch.mm(rows_MN.index_select(1, j_1).view(1, m), p_MM).view(m)
    qext_M.index_fill_(0, h_1, -1.0)
    t_N = torch.mv(rows_MN.T, qext_M)
    schur_1 = ridge_1 - t_N.index_select(0, j_1)
    z_j = g_1 / schur_1
    z_M = torch.addcmul(v_M, qext_M, z_j, value=-1.0)
    grad_new_N = torch.addcmul(grad_N, t_N, z_j)
    diag_j = diag_N.index_select(0, j_1)
    positive = g_1 > tol_1
    # The host loop's branches that end the device solve: a dependent column (a slow refit there) and an
    # ill-conditioned float32 one (promotion to float64).
    host_only = ~(schur_1 > pivot_tol * diag_j)
    if promote_tol > 0:
        host_only |= schur_1 < promote_tol * diag_j
    # And those `_repair` makes: a Lawson-Hanson drop, a KKT re-entry.
    repair = torch.amin(z_M, 0, keepdim=True) < 0
    if kkt:
        repair |= torch.amax(torch.where(inactive_N, grad_new_N, float("-inf")), 0, keepdim=True) > tol_1
    stop = positive & (host_only | repair)
    # Not gated by live_1: a frozen round recomputes the round that froze (the state has not moved).
    bad_1.logical_or_(stop & host_only)
    live_1.logical_and_(~stop)  # from here, whether the round applies: a frozen state stays until the repair
    enter = live_1 & positive
    # Enter j at slot h (P <- P + qext qext^T / s), or leave everything as it was. Slot h is free either
    # way, so its element may be written regardless.
    p_MM.addr_(torch.where(enter, qext_M / schur_1, 0.0), qext_M)
    elem_M.index_copy_(0, h_1, j_1)
    used_M.index_copy_(0, h_1, enter)
    torch.where(enter, z_M, v_M, out=v_M)
    torch.where(enter, grad_new_N, grad_N, out=grad_N)
    h_1.add_(enter)
    r_1.add_(live_1)
    # A pick with a gradient at or below zero stays at weight 0 (for bools, a > b is a and not b).
    inactive_N.index_copy_(0, j_1, live_1 > positive)
    penalty_N.index_copy_(0, j_1, torch.where(live_1, float("-inf"), penalty_N.index_select(0, j_1)))
    _spend_capacity(rem_C, domains_C, dom_N.index_select(0, j_1) == domains_C, live_1)
    _close_full_domains(penalty_N, rem_C, dom_N)


def _spend_capacity(rem_C: torch.Tensor, domains_C: torch.Tensor, of_pick_C: torch.Tensor, apply_1: torch.Tensor | None) -> None:
    """The pick's domain (``of_pick_C``: True there) loses one unit of capacity, when ``apply_1`` (None: always).

    A comparison with the domain ids, not a scatter: an int64 scatter-add is not fused by inductor (on CUDA it
    falls back to a sorting index_put_ of ~10 kernels).
    """
    rem_C.sub_((of_pick_C if apply_1 is None else of_pick_C & apply_1).to(rem_C.dtype))


def _close_full_domains(penalty_N: torch.Tensor, rem_C: torch.Tensor, dom_N: torch.Tensor) -> None:
    """-inf in the penalty of every element whose domain has no capacity left."""
    penalty_N.masked_fill_(rem_C.index_select(0, dom_N) <= 0, float("-inf"))


@functools.cache
def _compiled_round():
    """`_round` compiled as one graph (`solver_loop: device_compiled`): its ~60 ops become a few fused
    kernels around the two products (on a CPU, 2 fused loops and the GEMM; the CUDA count is gpu_bench's).
    Static shapes: one compilation per pool size, kappa, dtype and `kkt`, which a run keeps fixed."""
    # On a CPU, one thread: a round's loops are a few thousand elements, and OpenMP's barriers between them
    # cost milliseconds a round when the cores are shared (measured: 31 ms a round with 2 threads beside a
    # training run, on the 2-core VM). The CUDA code is not affected.
    return torch.compile(_round, fullgraph=True, dynamic=False, options={"cpp.threads": 1})


class _Rounds:
    """Runs batches of rounds of one variant (`kkt` or not), eagerly or as CUDA graphs per variant.

    ``kind``: ``"eager"`` (`_round`), ``"compiled"`` (`_compiled_round`) or ``"triton"`` (`omp_triton`).
    As graphs: the variant's first round runs eagerly on a side stream (the warm-up capture needs, which
    also initialises the libraries' handles and compiles), then graphs of `ROUNDS_PER_GRAPH` rounds, and of
    one round for a batch's remainder, are recorded when first needed (recording runs nothing) and
    replayed. Every tensor the round writes is allocated before, so replays update them, and `_repair`
    writes the same tensors in place.
    """

    def __init__(self, st: _State, tols: tuple[float, float], *, kind: str, graph: bool) -> None:
        if kind == "triton":
            self._round = TritonRound(st, tols)
        else:
            fn = _compiled_round() if kind == "compiled" else _round
            args = st.round_args()
            self._round = lambda kkt: fn(*args, *tols, kkt)
        self._graph = graph
        self._device = st.grad_N.device
        self._warm: set[bool] = set()
        self._graphs: dict[tuple[bool, int], torch.cuda.CUDAGraph] = {}
        self._st = st
        self._repair_steps: _RepairSteps | None = None
        self._final: _Final | None = None
        # Recorded by `keep` in a workspace with graphs, whose solves then restart and finalise from graphs.
        self._restart_graph: torch.cuda.CUDAGraph | None = None

    def repair_steps(self) -> _RepairSteps:
        """The repairs' segments on this state (made at the first repair, kept with the rounds' graphs)."""
        if self._repair_steps is None:
            self._repair_steps = _RepairSteps(self._st, graph=self._graph)
        return self._repair_steps

    def finalize(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_finalized` on this state: in a workspace with graphs, `_Final`'s graph replayed and its outputs copied;
        else eagerly (a solve that keeps no workspace finalises once, and would replay no graph)."""
        if self._restart_graph is None:  # not a workspace's graphed rounds (`keep`)
            return _finalized(self._st)
        if self._final is None:
            self._final = _Final(self._st)
        with _on(self._device):
            return self._final.run()

    def keep(self) -> None:
        """These rounds are a workspace's: with graphs, `_restart`'s kernels recorded as a CUDA graph now (nothing
        runs), and the final refactorisation graphed from its first use (`finalize`)."""
        if self._graph and self._restart_graph is None:
            with _on(self._device):
                self._restart_graph = _recorded(functools.partial(_restart, self._st))

    def restart(self) -> None:
        """`_restart` on this state: its graph replayed where `keep` recorded one."""
        if self._restart_graph is None:
            _restart(self._st)
            return
        with _on(self._device):
            self._restart_graph.replay()

    def _rounds(self, kkt: bool, count: int) -> None:
        for _ in range(count):
            self._round(kkt)

    def run(self, count: int, *, kkt: bool) -> None:
        # Side streams, captures and Triton's launches use the current device, not the tensors': the state's.
        with _on(self._device):
            if self._graph:
                self._graphed(count, kkt)
            else:
                self._rounds(kkt, count)

    def _graphed(self, count: int, kkt: bool) -> None:
        if count > 0 and kkt not in self._warm:
            _on_side_stream(lambda: self._round(kkt))
            self._warm.add(kkt)
            count -= 1
        # A remainder replays a one-round graph rather than graphs of 8, 4, 2 and 1: remainders are rare once a
        # workspace is warm (a solve's batches are whole graphs but after a repair and at the end), and a one-round
        # replay costs the host less time than the GPU takes for the round, so the GPU does not wait for it.
        while count > 0:
            per = ROUNDS_PER_GRAPH if count >= ROUNDS_PER_GRAPH else 1
            g = self._graphs.get((kkt, per))
            if g is None:
                g = self._graphs[(kkt, per)] = _recorded(functools.partial(self._rounds, kkt, per))
            for _ in range(count // per):
                g.replay()
            count %= per


def _on(device: torch.device):
    """The context that makes ``device`` current where that matters (CUDA: side streams, captures and Triton's
    launches use the current device, not the tensors'); none elsewhere."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _on_side_stream(fn) -> None:
    """``fn()`` on a side stream ordered after the current stream's work, and the current stream after it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)


def _recorded(fn) -> torch.cuda.CUDAGraph:
    """``fn``'s kernels recorded as a CUDA graph (nothing runs), on a side stream as capture requires.

    `CUDAGraph.capture_begin`/`capture_end` rather than the `torch.cuda.graph` context: its entry
    synchronizes, runs `gc.collect()` and empties the caching allocator, and a solve records a graph at
    every selection step, so a training run would hand its cached blocks back to CUDA each step.
    """
    g = torch.cuda.CUDAGraph()

    def capture() -> None:
        # Thread-local: a possibly unsafe CUDA call that another thread makes meanwhile (an allocation by a
        # loader's pinned-memory thread, say) must not invalidate the capture, as the default global mode lets it.
        g.capture_begin(capture_error_mode="thread_local")
        try:
            fn()
        finally:
            g.capture_end()

    _on_side_stream(capture)
    return g


class _Final:
    """The final refactorisation (`_finalize_into`) into buffers of its own, for graphs: about 45 kernels (the
    Cholesky factorisation and solve among them) that the host launched one by one while the GPU waited on the small
    ones. Its first use runs eagerly on a side stream (the warm-up: cuSOLVER's handle and workspace), then records
    the graph, which every later use replays; the outputs are copied out (a workspace's next solve rewrites them).
    """

    def __init__(self, st: _State) -> None:
        self.st = st
        self.sel_K, self.vals_K1, self.agrees_1 = _final_buffers(st)
        self._graph: torch.cuda.CUDAGraph | bool | None = None  # False: recording failed

    def _compute(self) -> None:
        _finalize_into(self.st, self.sel_K, self.vals_K1, self.agrees_1)

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._graph is None:
            _on_side_stream(self._compute)
            try:
                self._graph = _recorded(self._compute)  # now, so the workspace's next solves record nothing
            except RuntimeError as err:  # a linear-algebra library that cannot be captured: eager from now on
                warnings.warn(f"the final refactorisation runs eagerly: its CUDA graph failed to record ({err})", stacklevel=2)
                self._graph = False
        elif self._graph is False:
            self._compute()
        else:
            self._graph.replay()
        k = self.sel_K.shape[0]
        vals = self.vals_K1.clone()
        # The agreement is read within this solve (`_read_status`), before the next replay rewrites it.
        return self.sel_K.clone(), vals[:k], vals[k], self.agrees_1


@dataclass
class _Repair:
    """What `_repair` did: whether the device solve can go on, and its counts."""

    ok: bool = True
    drops: int = 0
    reentries: int = 0
    reads: int = 0


def _repair(st: _State, steps: _RepairSteps, tols: tuple[float, float]) -> _Repair:
    """The frozen round once more, its Lawson-Hanson steps decided on the host (the host loop's `_enter`,
    `_drop_until_positive` and `_restore_kkt`), then the active slots packed first so the rounds fill in order.

    Its pick has a positive gradient (only such a round freezes). The device work between two reads is one
    segment of ``steps`` (a CUDA graph from its second use on CUDA); the host reads what decides the next:
    a repair with one drop reads twice, one with a re-entry alone twice, one with a drop and a re-entry 3 times.
    Not ``ok``: a pivot the host loop would refit or promote (``bad_1`` set), or a loop past the host loop's caps.
    """
    out = _Repair()
    steps.run("pick_and_enter")
    wants_in = _settle(st, steps, tols, out)
    for _ in range(3 * st.used_M.shape[0] + 10):  # the host loop's cap
        if wants_in is None:
            return out
        if not wants_in:  # no element at weight zero whose gradient is above the tolerance
            break
        steps.run("reenter")
        out.reentries += 1
        wants_in = _settle(st, steps, tols, out)
    else:
        out.ok = False
        return out
    # Without a drop no slot was freed: the slots in use are still [0, h), so the packing would move nothing.
    steps.run("pack" if out.drops else "resume")
    return out


def _settle(st: _State, steps: _RepairSteps, tols: tuple[float, float], out: _Repair) -> bool | None:
    """After an element entered: the pivot's tests, the drops until every weight is positive, then the
    weights, the gradient and the KKT check (`ActiveSetState._drop_until_positive`, `_restore_kkt`), the last
    three in the segment that leaves every weight positive (the entry's or the last drop's).

    Returns whether an element at weight zero wants back in, or None (``out.ok`` False too) where the host
    loop would refit or promote, or past its inner loop's cap.
    """
    # One read: the pivot's tests, the first drop's flag, and (without a drop) the KKT check's.
    schur, diag_j, any_neg, _, _, wants_in = steps.read_6.tolist()
    out.reads += 1
    pivot_tol, promote_tol = tols
    if not schur > pivot_tol * diag_j or schur < promote_tol * diag_j:
        st.bad_1.fill_(True)
        out.ok = False
        return None
    for _ in range(st.used_M.shape[0] + 1):
        if not any_neg:
            return bool(wants_in)
        steps.run("drop")
        out.drops += 1
        _, _, any_neg, _, _, wants_in = steps.read_6.tolist()
        out.reads += 1
    out.ok = False
    return None


class _RepairSteps:
    """A repair's device work, cut at its host reads into segments that read and write only the state and
    the buffers here: no host value enters them (the entering slot, the dropped slot and its ``P_pp`` stay on
    the device), so each segment is the same kernels every time and, on CUDA, runs as a CUDA graph from its
    second use (the first runs eagerly on a side stream, as a warm-up), replayed from the solve's workspace.

    Eager, a repair was about 115 ops with 3-4 reads: on an H100 the host's ~1.5 ms while the GPU waits, four
    times on bench_selection's seed 0 (docs/results/bench_gpu.md, 2026-11-27). The segments: an entry (the
    frozen round's pick, or a re-entry) or a drop, each ending with `_finish` where the weights came out
    positive, so a repair reads once an entry or drop; and the packing after a drop (``resume`` without one). ``read_6``: what the host reads,
    ``[Schur complement, K_jj, a weight would turn negative, its slot, P_pp, an element at weight zero wants
    in]`` (the first two from the last entry).
    """

    def __init__(self, st: _State, *, graph: bool) -> None:
        m, n, dt, dev = st.used_M.shape[0], st.grad_N.shape[0], st.grad_N.dtype, st.grad_N.device
        self.st, self.graph = st, graph
        self.slots_M = torch.arange(m, device=dev)
        self.j_1 = torch.zeros(1, dtype=torch.long, device=dev)  # the entering element
        self.g_1 = torch.zeros(1, dtype=dt, device=dev)  # its gradient
        self.x_M = torch.zeros(m, dtype=dt, device=dev)  # the feasible point Lawson-Hanson steps from, towards z
        self.z_M = torch.zeros(m, dtype=dt, device=dev)
        self.grad_z_N = torch.zeros(n, dtype=dt, device=dev)  # the gradient at z (kept when nothing drops)
        self.read_6 = torch.zeros(6, dtype=dt, device=dev)
        # The next drop (the step, the slot, P's column, P_pp), its flags part of what the host reads.
        self._drop_bufs = lawson_hanson_buffers(self.x_M)._replace(flags_3=self.read_6[2:5])
        self._segments = {"pick_and_enter": self._pick_and_enter, "reenter": self._reenter, "drop": self._drop,
                          "pack": self._pack, "resume": self._resume}
        self._warm: set[str] = set()
        self._graphs: dict[str, torch.cuda.CUDAGraph] = {}

    def run(self, name: str) -> None:
        fn = self._segments[name]
        if not (self.graph and REPAIR_GRAPHS):
            fn()
            return
        dev = self.st.grad_N.device
        with _on(dev):
            if name not in self._warm:
                _on_side_stream(fn)
                self._warm.add(name)
                return
            g = self._graphs.get(name)
            if g is None:
                g = self._graphs[name] = _recorded(fn)
            g.replay()

    def _pick_and_enter(self) -> None:
        """The frozen round's pick (the round's bookkeeping: the selection, the penalty, the capacities), entered."""
        st = self.st
        # A fused Triton round's weights not yet copied (a frozen round leaves none; this keeps v_M whole regardless).
        torch.where(st.pending_1, st.vnext_M, st.v_M, out=st.v_M)
        st.pending_1.zero_()
        j_1 = self.j_1
        torch.max(st.grad_N + st.penalty_N, 0, keepdim=True, out=(self.g_1, j_1))
        st.sel_K.index_copy_(0, st.r_1, j_1)
        st.r_1.add_(1)
        st.penalty_N.index_fill_(0, j_1, float("-inf"))
        _spend_capacity(st.rem_C, st.domains_C, st.dom_N.index_select(0, j_1) == st.domains_C, None)
        _close_full_domains(st.penalty_N, st.rem_C, st.dom_N)
        self._enter()
        self._finish(after_drops=False)

    def _reenter(self) -> None:
        """The element at weight zero with the largest gradient (`_finish` found it) back in."""
        self.st.inactive_N.index_fill_(0, self.j_1, False)
        self._enter()
        self._finish(after_drops=False)

    def _enter(self) -> None:
        """``j_1`` (gradient ``g_1 > 0``) entered at the first free slot, weights ``z`` unconstrained."""
        st, j_1 = self.st, self.j_1
        m = st.used_M.shape[0]
        torch.amin(torch.where(st.used_M, m, self.slots_M), 0, keepdim=True, out=st.h_1)  # the first free slot
        st.rows_MN.index_copy_(0, st.h_1, st.gram_NN.index_select(0, j_1))
        qext_M = torch.mm(st.rows_MN.index_select(1, j_1).view(1, m), st.p_MM).view(m)
        qext_M.index_fill_(0, st.h_1, -1.0)
        t_N = torch.mv(st.rows_MN.T, qext_M)
        schur_1 = torch.sub(st.ridge_1, t_N.index_select(0, j_1), out=self.read_6[0:1])  # read by the host
        z_j = self.g_1 / schur_1
        torch.addcmul(st.v_M, qext_M, z_j, value=-1.0, out=self.z_M)
        torch.addcmul(st.grad_N, t_N, z_j, out=self.grad_z_N)
        # Entered before the read: a pivot the host loop would refit ends the device solve, whose state is dropped.
        st.p_MM.addr_(qext_M / schur_1, qext_M)
        st.elem_M.index_copy_(0, st.h_1, j_1)
        st.used_M.index_fill_(0, st.h_1, True)
        self.x_M.copy_(st.v_M)
        torch.index_select(st.diag_N, 0, j_1, out=self.read_6[1:2])
        self._first_to_zero()

    def _first_to_zero(self) -> None:
        first_to_zero(self.st.p_MM, self.x_M, self.z_M, out=self._drop_bufs)

    def _drop(self) -> None:
        """The host loop's Lawson-Hanson step (`active_set.drop_slot`) on the drop kept in the buffers: slot ``p``
        leaves (its element stays selected at weight zero)."""
        st = self.st
        drop_slot(st.p_MM, self.x_M, self.z_M, self._drop_bufs)
        p_1 = self._drop_bufs.p_1
        st.used_M.index_fill_(0, p_1, False)
        st.inactive_N.index_fill_(0, st.elem_M.index_select(0, p_1), True)
        self._first_to_zero()
        self._finish(after_drops=True)

    def _finish(self, after_drops: bool) -> None:
        """Where no weight of ``z`` is negative (the flag `_first_to_zero` just wrote; else nothing changes): the
        weights ``z``, the gradient (afresh after a drop, as the host loop computes it), and the KKT check, whether
        the element at weight zero with the largest gradient (``j_1``, which `_reenter` enters) is above the
        tolerance. Part of the segment before the read, so a repair reads once an entry or drop, not twice."""
        st = self.st
        settled_1 = self.read_6[2:3] == 0
        torch.where(settled_1, self.z_M, st.v_M, out=st.v_M)
        grad_z_N = torch.addmv(st.mu_N, st.rows_MN.T, self.z_M, alpha=-1.0) if after_drops else self.grad_z_N
        torch.where(settled_1, grad_z_N, st.grad_N, out=st.grad_N)
        torch.max(torch.where(st.inactive_N, st.grad_N, float("-inf")), 0, keepdim=True, out=(self.g_1, self.j_1))
        self.read_6[5:6].copy_((self.g_1 > st.tol_1) & settled_1)

    def _pack(self) -> None:
        """The active slots first, in slot order, then the free ones in slot order (what a stable sort of the
        free flags gives, from two cumulative sums: a scan is plainly capturable, a sort's CUDA path was never
        checked under capture);
        free slots keep zero ``P`` rows, columns and weights. The rounds go on from the first free slot."""
        st = self.st
        used_M = st.used_M.long()
        self._resume(used_M)  # h: the slots in use
        to_M = torch.where(st.used_M, used_M.cumsum(0) - 1, st.h_1 + (1 - used_M).cumsum(0) - 1)  # each slot's place
        perm_M = torch.empty_like(self.slots_M).scatter_(0, to_M, self.slots_M)
        for buf in (st.rows_MN, st.v_M, st.elem_M, st.used_M):
            buf.copy_(buf.index_select(0, perm_M))
        st.p_MM.copy_(st.p_MM.index_select(0, perm_M).index_select(1, perm_M))

    def _resume(self, used_M: torch.Tensor | None = None) -> None:
        """After a repair without a drop (its slots in use still the first ones): the rounds go on from the next slot.
        ``used_M``: the slots in use as integers, where the caller has them."""
        st = self.st
        torch.sum(st.used_M.long() if used_M is None else used_M, 0, keepdim=True, out=st.h_1)
        st.live_1.fill_(True)
