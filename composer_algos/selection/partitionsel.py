"""PartitionSel: OMP for the weighted gradient-matching objective over a partition matroid (paper Alg. 2)."""

# Shape legend: N pool size, D feature dim, C domains, S selected count, K rounds (= S).

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from composer_algos.selection.active_set import ActiveSetState
from composer_algos.selection.active_set_device import omp_exact_on_device
from composer_algos.selection.apga import APGAPoolState, APGAState
from composer_algos.selection.gram_rows import GramRows, as_gram_rows
from composer_algos.selection.objective import build_objective
from composer_algos.selection.refit import default_grad_tol, refit_exact
from composer_algos.selection.swap import refine_swap
from composer_algos.selection.threads import single_thread_on_cpu
from composer_algos.selection.types import (
    SelectionInputs,
    SelectionResult,
    check_finite,
    check_or_defer,
    finish_result,
    strategy,
)

log = logging.getLogger(__name__)

__all__ = ["PartitionSelOptions", "select_partitionsel", "omp_select", "run_weighted_selection"]

_PICKS = ("greedy", "randomized")
_REFITS = ("exact", "apga", "apga_pool")
_REFINES = (None, "swap")
_GRAM_ROWS = ("auto", "full", "lazy")
_SOLVER_LOOPS = ("host", "cpu", "device", "device_compiled", "device_triton")


@dataclass(frozen=True, kw_only=True)
class PartitionSelOptions:
    """Options of ``partitionsel`` (and ``iwd``).

    Args:
        pick: ``"greedy"`` (default: the argmax of the gradient over the feasible elements; the
            deterministic variant with the stronger guarantee) or ``"randomized"`` (the paper's
            Alg. 2: uniform over the maximum-weight base of the contracted matroid).
        refit: ``"exact"`` (default: active-set NNLS with incremental Cholesky), ``"apga"``
            (the paper's Alg. 3 run on the ``|S| x |S|`` support system, step from ``||K_SS||``)
            or ``"apga_pool"`` (the paper's Alg. 3 verbatim: the full pool vector, the full
            ``N x N`` Gram in every iteration, step from ``||K||`` computed once per call).
        refine: None (default) or ``"swap"``: after OMP, exchange a selected example for an
            unselected one of the same domain while that raises ``f(S)`` (exact refits; after an
            APGA refit the OMP support is first re-solved exactly).
        swap_max_rounds: the most swaps made (default 32).
        swap_max_checks: candidate swaps verified by an exact refit per round (default 16).
        swap_time_budget_s: optional wall-clock budget of the swap pass in seconds. A time budget
            makes the result depend on the machine's speed (ranks may disagree); default None.
        apga_max_iters: APGA iterations per refit (default 128).
        apga_tol: APGA relative-improvement tolerance; 0 (default) runs every iteration.
        ridge: ridge added to the diagonal of the refit systems, relative to the mean of
            ``diag(K)`` (default 1e-6). K is PSD, not always PD; set 0 only when it is PD.
        gram_rows: how ``K = G G^T`` is formed when no ``gram`` is given. ``"full"``: the whole
            Gram up front. ``"lazy"``: only the rows the solver reads (the selected elements and
            the swap candidates), in speculative batches of ``gram_batch_rows`` (one extra host
            sync per pick). ``"auto"`` (default): lazy on CPU when ``refit`` is ``"exact"`` or
            ``"apga"``, ``n >= 128`` and ``kappa <= n / 8``, full otherwise. Measured on one CPU
            thread (D = 4096, random features): lazy takes 0.59x the time at n = 4096,
            kappa = 256, 0.93x at n = 2048, kappa = 256 and 1.2x at kappa = 512 (its speculative
            batches then compute 45% of the rows, in small GEMMs that each stream G); on GPUs the
            Gram GEMM is cheap and syncs are not. The result is the same either way up to
            floating-point rounding.
        gram_batch_rows: rows per speculative batch of the lazy Gram (default 32).
        solver_loop: where the rounds run when the features are on an accelerator (on a CPU they are
            the same computation, in three forms: the host loop, the device loop's rounds, the CPU solve). ``"host"`` (default): beside the features, each exact round
            deciding on the host (``ActiveSetState``: one host sync a pick, and about 13 launches, all
            of its aten ops, for a pick that enters the active set, 2 for a pick after the gradient
            stopped being positive; counted on the CPU at n = 16, kappa = 8. Before issue 31 it was
            17.6 launches and 29.0 ops a pick on an H200 at n = 2048, kappa = 512).
            ``"cpu"``: ``K`` and ``mu`` copied to the CPU in one transfer and the whole solve (OMP,
            refit, swap) run there, the selection copied back without blocking: one sync and no
            launch whatever ``kappa``, but the same ops at the CPU's per-op cost (0.4-1.0 ms a pick
            on one thread of the 2-core VM, n = 16 to 512, against 0.23 ms on an H200's host loop
            at n = 2048). ``"device"`` (``active_set_device.omp_exact_on_device``; greedy exact OMP
            on a full Gram, no ``refine``): no sync in the rounds, one read every 64 rounds and at the
            end; a round that needs a Lawson-Hanson drop or a KKT re-entry is repaired with reads
            of its own, one that needs a slow refit or a float64 promotion sets a flag and the host
            loop then runs from the start; about 60 launches a pick. On an H200 at n = 2048,
            kappa = 512, seed 0 (2 drops, repaired on the device): host 96.6 ms, device 68.5 ms,
            cpu 71.0 ms, the same picks (docs/results/bench_gpu.md, 2026-11-27); the default stays the
            host loop until the recipes' shape tells them apart (at 8 rows a rank a solve is a few
            picks). ``"device_compiled"``: the device loop with each round compiled
            (``torch.compile``, static shapes, one compilation per pool size and kappa): the same
            picks but among near-ties, 12 fused kernels a round on CUDA (3 on a CPU) instead of
            about 60, then one CUDA graph a round: 28.6 ms on the same H200 instance
            (``tools/bench/bench_selection.py --compiled``: "exact, compiled rounds"; 53.6 ms on an H100
            with graphs of 16 rounds, against its host loop's 180 ms in the same run).
            ``"device_triton"``: the device loop with each round as two hand-written Triton kernels (three
            after the first drop; ``omp_triton``: the same picks but among near-ties; no torch.compile, Triton
            compiles its kernels once per dtype and size bucket, cached on disk), recorded 16 rounds to a CUDA
            graph, replayed by the next solve of the same shapes: on an H200 at n = 2048, kappa = 512 the whole
            selection 6.0-7.5 ms on an instance without drops (the solve alone 4.6-5.1 ms) and 7.8 ms on seed 0
            with its repairs (the solve alone 6.4-7.2 ms; 9.1-10.1 ms in three slow processes),
            against the host loop's 100-107 ms, the same picks (docs/results/bench_gpu.md, 2026-11-28, the
            seventh run). On a CPU it runs the device loop's eager rounds (Triton
            runs there only in its interpreter, ``TRITON_INTERPRET=1``, as the tests run it). Other settings
            than those named always use the host loop.
        cpu_single_thread: run the OMP rounds and swap verifications with one intra-op thread
            on CPU (default True; no effect on CUDA). Chosen from measurements (issue 15,
            `tools/bench/bench_step.py --solver-threads`, exact refit, kappa = n / 2, 2 intra-op
            threads, interleaved medians, on the 2-core VM shared with a study run, load average
            3.2-5.8): on/off time 0.66 at n = 32 (19 vs 29 ms), 0.82 at n = 64 (25 vs 31 ms) and
            0.26 at n = 2048, D = 2048 (4.8 vs 18.5 s); on an idle VM the two are within noise
            without swap (n = 2048: 293 vs 288 ms) and one thread costs up to 17% with
            `refine: swap` (docs/selection.md, Threads). A run rarely knows whether its cores
            are shared, and the loss when they are is 1.2-4x, so one thread is the default. It
            changes PyTorch's process-wide thread count for the duration of the call (restored
            afterwards; not thread-safe): set False when other Python threads of the process run
            torch work meanwhile, or on an idle many-core CPU with `refine: swap`.
    """

    pick: str = "greedy"
    refit: str = "exact"
    refine: str | None = None
    swap_max_rounds: int = 32
    swap_max_checks: int = 16
    swap_time_budget_s: float | None = None
    apga_max_iters: int = 128
    apga_tol: float = 0.0
    ridge: float = 1e-6
    gram_rows: str = "auto"
    gram_batch_rows: int = 32
    cpu_single_thread: bool = True
    solver_loop: str = "host"

    def __post_init__(self) -> None:
        problems = []
        if self.pick not in _PICKS:
            problems.append(f"`pick` must be one of {list(_PICKS)}, got {self.pick!r}")
        if self.refit not in _REFITS:
            problems.append(f"`refit` must be one of {list(_REFITS)}, got {self.refit!r}")
        if self.refine not in _REFINES:
            problems.append(f"`refine` must be one of {list(_REFINES)}, got {self.refine!r}")
        if self.gram_rows not in _GRAM_ROWS:
            problems.append(f"`gram_rows` must be one of {list(_GRAM_ROWS)}, got {self.gram_rows!r}")
        if self.solver_loop not in _SOLVER_LOOPS:
            problems.append(f"`solver_loop` must be one of {list(_SOLVER_LOOPS)}, got {self.solver_loop!r}")
        if not isinstance(self.cpu_single_thread, bool):
            problems.append(f"`cpu_single_thread` must be a bool, got {self.cpu_single_thread!r}")
        for name in ("swap_max_rounds", "swap_max_checks", "apga_max_iters", "gram_batch_rows"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "swap_max_rounds" else 1):
                low = 0 if name == "swap_max_rounds" else 1
                problems.append(f"`{name}` must be an int >= {low}, got {value!r}")
        if self.swap_time_budget_s is not None and not (
            isinstance(self.swap_time_budget_s, (int, float)) and self.swap_time_budget_s > 0
        ):
            problems.append(f"`swap_time_budget_s` must be None or a number > 0, got {self.swap_time_budget_s!r}")
        if not isinstance(self.apga_tol, (int, float)) or isinstance(self.apga_tol, bool) or not self.apga_tol >= 0:
            problems.append(f"`apga_tol` must be a float >= 0, got {self.apga_tol!r}")
        if not isinstance(self.ridge, (int, float)) or isinstance(self.ridge, bool) or not 0 <= self.ridge < 1:
            problems.append(f"`ridge` must be a float in [0, 1) (relative to mean diag K), got {self.ridge!r}")
        if problems:
            raise ValueError("invalid selection options: " + "; ".join(problems))


@strategy("partitionsel", options=PartitionSelOptions, needs_features=True, needs_validation=True, weighted=True)
def select_partitionsel(
    inputs: SelectionInputs, opts: PartitionSelOptions, *, num_domains: int, generator: torch.Generator | None
) -> SelectionResult:
    """PartitionSel: maximise ``f(S)`` under per-domain capacities by OMP (paper Alg. 2).

    ``f(S) = max { U(w) : w >= 0, supp(w) in S }`` with ``U(w) = <w, mu> - (eta/2) w^T K w``,
    ``K = G G^T``, ``mu = G gbar + (eta/2) diag(K)``. Each of the ``k = min(kappa, n)`` rounds
    takes the gradient ``mu - eta K w`` of the current refit, picks an element of the
    maximum-weight base of the contracted matroid (argmax, or uniformly at random for
    ``pick="randomized"``; the largest gradient when none is positive, so the budget is always
    filled) and refits the weights on the new support. Solved in ``v = eta * w`` (see
    ``objective.py``). Only ``pick="randomized"`` draws from ``generator`` (``k`` uniforms).

    Returns:
        The selection with refit ``weights`` (in ``w``; ``v`` at ``eta == 0``) and ``objective``
        ``f(S) = U(w*)`` (``eta f(S)`` at ``eta == 0``); ``info`` holds ``objective_scaled``
        (``eta f(S)``, the scale-free value to log), ``ridge_share`` (the ridge's share of
        ``v^T (K + ridge I) v``; above 1/2 the objective is ridge-dominated and a warning is logged
        once per process), ``slow_refits`` and ``singular_pivots`` (selected elements left at weight
        0 because their pivot was numerically singular) or ``apga_iterations``, and for
        ``refine="swap"`` the ``swaps`` made, ``swap_rounds`` and ``objective_before_refine``.
        With an APGA refit, ``refine="swap"`` first re-solves the OMP support exactly (its closed
        forms need the exact optimum).

    Raises:
        ValueError: on bad inputs or options.
    """
    return run_weighted_selection("partitionsel", inputs, num_domains, opts, generator, block_diagonal=False)


def run_weighted_selection(
    strategy: str,
    inputs: SelectionInputs,
    num_domains: int,
    opts: PartitionSelOptions,
    generator: torch.Generator | None,
    *,
    block_diagonal: bool,
) -> SelectionResult:
    """Shared body of ``partitionsel`` and ``iwd`` (``block_diagonal`` drops cross-domain K); ``inputs.k >= 1``."""
    assert inputs.features is not None and inputs.val_feature is not None
    dom_N = inputs.domain_ids
    if _use_lazy_gram(opts, inputs, block_diagonal):
        gram = GramRows(features_ND=inputs.features, batch_rows=opts.gram_batch_rows)
        mu_N = inputs.features @ inputs.val_feature + (0.5 * inputs.eta) * gram.diag_N
    else:
        gram_NN, mu_N, _ = build_objective(inputs.features, inputs.val_feature, inputs.eta, inputs.gram)
        if block_diagonal:
            gram_NN = gram_NN * (dom_N.unsqueeze(1) == dom_N.unsqueeze(0))
        gram = GramRows(gram_NN=gram_NN)
    # The capacities are host arithmetic when the ids came from the host (the training loop's, the benchmarks'): before
    # the finiteness check's read (outside a step), they run while the device computes the Gram, not after it.
    caps_C = inputs.resolve_capacities()
    check_finite(strategy, diag_K=gram.diag_N, mu=mu_N)  # on the features' device (deferred to the step's one read)
    device = mu_N.device
    on_cpu = _cpu_solve(opts, inputs)
    if on_cpu:
        gram, mu_N, dom_N, caps_C = _to_cpu(gram, mu_N, inputs, caps_C)
    grad_tol = default_grad_tol(mu_N)
    device_loop = _device_loop(opts, inputs, gram)
    solved = _solve_on_device(opts, inputs, gram, mu_N, caps_C, grad_tol) if device_loop else None
    if solved is not None:
        sel_S, v_S, phi, info, ridge_abs = solved
    else:
        sel_S, v_S, phi, info, ridge_abs = _solve_from_host(opts, inputs, gram, mu_N, dom_N, caps_C, grad_tol, generator)
        if device_loop:
            info["device_loop_fallback"] = 1
    if opts.refine == "swap":
        sel_S, v_S, phi = _refine(strategy, opts, inputs, gram, mu_N, dom_N, sel_S, v_S, phi, info, ridge_abs, grad_tol)
    if gram.lazy:
        info["gram_rows_computed"] = gram.rows_computed
    info["objective_scaled"] = phi
    info["ridge_share"] = _ridge_share(strategy, v_S, mu_N[sel_S], ridge_abs, inputs, opts.ridge, device=device if on_cpu else None)
    if inputs.eta == 0:
        info["scale_free"] = True
    weights_S = v_S / inputs.eta if inputs.eta > 0 else v_S
    result = finish_result(sel_S, dom_N, num_domains, weights_S=weights_S, objective=_unscale(phi, inputs.eta), info=info)
    return _result_to(result, device) if on_cpu else result


def _solve_from_host(
    opts: PartitionSelOptions,
    inputs: SelectionInputs,
    gram: GramRows,
    mu_N: torch.Tensor,
    dom_N: torch.Tensor,
    caps_C: torch.Tensor,
    grad_tol: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, float]:
    """The greedy rounds driven from the host (`omp_select`); returns its selection, weights, objective, info and ridge."""
    # The setup's host reads in one transfer: the ridge's scale (mean diag K), and for the exact
    # refit's host-side tests the gradient tolerance and diag(K).
    exact = opts.refit == "exact"
    parts = [gram.diag_N.mean(0, keepdim=True)] + ([grad_tol.view(1), gram.diag_N] if exact else [])
    setup = torch.cat(parts).tolist() if opts.ridge > 0 or exact else [0.0]
    ridge_abs = opts.ridge * setup[0] if opts.ridge > 0 else 0.0
    host_values = (setup[1], setup[2:]) if exact else None
    # kappa >= n runs the same rounds: OMP then adds every element in gradient order, which is
    # the incremental form of an exact refit on the whole pool.
    sel_S, v_S, phi, info = omp_select(
        gram,
        mu_N,
        dom_N,
        caps_C,
        inputs.k,
        pick=opts.pick,
        refit=opts.refit,
        ridge_abs=ridge_abs,
        apga_max_iters=opts.apga_max_iters,
        apga_tol=opts.apga_tol,
        generator=generator,
        cpu_single_thread=opts.cpu_single_thread,
        domain_ids_host=inputs.domain_ids_host,
        host_values=host_values,
        grad_tol=grad_tol,
    )
    return sel_S, v_S, phi, info, ridge_abs


def _refine(
    strategy: str,
    opts: PartitionSelOptions,
    inputs: SelectionInputs,
    gram: GramRows,
    mu_N: torch.Tensor,
    dom_N: torch.Tensor,
    sel_S: torch.Tensor,
    v_S: torch.Tensor,
    phi: torch.Tensor,
    info: dict,
    ridge_abs: float,
    grad_tol: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`refine: swap` after the greedy rounds (an exact refit first after APGA); its counters go into `info`."""
    start = time.perf_counter()
    info["objective_before_refine"] = _unscale(phi, inputs.eta)
    if opts.refit != "exact":
        # The swap estimates and their verification are closed forms around the exact optimum
        # on the current support (Phi = <v, mu> / 2 there); APGA's weights are only close to it.
        sel_S, v_S, phi, blocked = _resolve_exact(gram, mu_N, sel_S, v_S, ridge_abs, grad_tol)
        info["singular_pivots"] = blocked
    sel_S, v_S, phi, swap_info = refine_swap(
        gram,
        mu_N,
        dom_N,
        sel_S,
        v_S,
        ridge_abs=ridge_abs,
        max_rounds=opts.swap_max_rounds,
        max_checks=opts.swap_max_checks,
        time_budget_s=opts.swap_time_budget_s,
        grad_tol=grad_tol,
        cpu_single_thread=opts.cpu_single_thread,
    )
    info.update(swap_info)
    log.debug("%s: swap refinement took %.4fs", strategy, time.perf_counter() - start)
    return sel_S, v_S, phi


def omp_select(
    gram: torch.Tensor | GramRows,
    mu_N: torch.Tensor,
    domain_ids_N: torch.Tensor,
    capacities_C: torch.Tensor,
    k: int,
    *,
    pick: str = "greedy",
    refit: str = "exact",
    ridge_abs: float = 0.0,
    apga_max_iters: int = 128,
    apga_tol: float = 0.0,
    generator: torch.Generator | None = None,
    cpu_single_thread: bool = False,
    domain_ids_host: torch.Tensor | None = None,
    host_values: tuple[float, list[float]] | None = None,
    grad_tol: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """OMP over the partition matroid in the scale-free variable ``v`` (paper Alg. 2).

    Each round costs a handful of ``O(N)`` kernels plus the refit; nothing loops over the
    candidates in Python. The exact refit syncs once per round (twice with a lazy Gram, whose
    rows are computed when a pick needs them); APGA with ``apga_tol = 0`` never (once per round
    with a lazy Gram).

    Args:
        gram: ``(N, N)`` Gram matrix ``K``, or its ``GramRows``.
        mu_N: ``(N,)`` linear term ``mu``.
        domain_ids_N: ``(N,)`` int64 domain ids.
        capacities_C: ``(C,)`` int64 capacities (each at most the domain's pool count, summing
            to at least ``k``; above ``k`` they are upper bounds of a partition matroid truncated
            at ``k``: the rounds stop after ``k`` picks).
        k: rounds, ``0 <= k <= N``.
        pick: ``"greedy"`` or ``"randomized"``.
        refit: ``"exact"``, ``"apga"`` (support system) or ``"apga_pool"`` (full pool vector).
        ridge_abs: absolute ridge on the refit systems.
        apga_max_iters: APGA iterations per refit.
        apga_tol: APGA tolerance.
        generator: randomness for the randomized pick.
        cpu_single_thread: run the rounds with one intra-op thread on CPU (process-wide, restored
            afterwards; see ``single_thread_on_cpu``).
        domain_ids_host: the same ids on the host when the caller has them (the exact refit tracks
            domains there, and reading device ids would cost a sync); capacities given on the host
            are read there too.
        host_values: the exact refit's ``(float(grad_tol), diag(K).tolist())`` when the caller has
            read them already (with other values, in one transfer).
        grad_tol: the KKT tolerance when the caller has it (default ``default_grad_tol(mu_N)``).

    Returns:
        ``(indices_S, v_S, phi, info)``: the selection in pick order, its weights ``v``, the
        scale-free objective ``Phi(v)`` (0-dim) and solver counters.
    """
    with single_thread_on_cpu(mu_N.device, cpu_single_thread):
        return _omp_rounds(
            as_gram_rows(gram),
            mu_N,
            domain_ids_N,
            capacities_C,
            k,
            pick,
            refit,
            ridge_abs,
            apga_max_iters,
            apga_tol,
            generator,
            domain_ids_host,
            host_values,
            grad_tol,
        )


def _omp_rounds(
    gram: GramRows,
    mu_N: torch.Tensor,
    domain_ids_N: torch.Tensor,
    capacities_C: torch.Tensor,
    k: int,
    pick: str,
    refit: str,
    ridge_abs: float,
    apga_max_iters: int,
    apga_tol: float,
    generator: torch.Generator | None,
    domain_ids_host: torch.Tensor | None = None,
    host_values: tuple[float, list[float]] | None = None,
    grad_tol: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The body of ``omp_select``."""
    device = mu_N.device
    n = gram.n
    if grad_tol is None:
        grad_tol = default_grad_tol(mu_N)
    caps_host = capacities_C if capacities_C.device.type == "cpu" else None
    capacities_C = capacities_C.to(device, non_blocking=True)
    state = _refit_state(refit, gram, mu_N, k, ridge_abs, grad_tol, apga_max_iters, apga_tol, host_values)
    lazy = gram.lazy
    dom_N = domain_ids_N
    exact = isinstance(state, ActiveSetState)
    randomized = pick == "randomized"
    if exact:
        # The exact state syncs once per round anyway and hands back j: track domains on the host.
        rem_host = (caps_host if caps_host is not None else capacities_C).tolist()
        dom_host = (domain_ids_host if domain_ids_host is not None else dom_N).tolist()
        dom_masks = _DomainMasks(dom_N, len(rem_host))
    # Unavailable elements (selected, or in a full domain) carry -inf in the additive penalty. The
    # exact greedy rounds keep grad + penalty in the state (its `scores_N`, updated with the gradient).
    own_scores = exact and not (randomized or lazy)
    penalty_N = state.scores_N if own_scores else torch.zeros(n, dtype=mu_N.dtype, device=device)
    if not exact or min(rem_host, default=1) <= 0:
        penalty_N.masked_fill_(capacities_C.index_select(0, dom_N) <= 0, float("-inf"))
    if randomized or not exact:
        rem_C = capacities_C.clone()
        minus_one = torch.full((1,), -1, dtype=rem_C.dtype, device=device)
    if randomized or lazy:
        starts_C, positions_N = _domain_starts(dom_N, capacities_C.shape[0])
    if randomized:
        uniforms_K, truncated = _randomized_draws(generator, k, device, caps_host if caps_host is not None else capacities_C)
    for r in range(k):
        scores_N = state.scores_N if own_scores else state.grad_N + penalty_N
        if randomized:
            avail_N = penalty_N == 0
            j_greedy = scores_N.argmax()
            j1 = _randomized_pick(
                state.grad_N, avail_N, dom_N, rem_C, starts_C, positions_N, uniforms_K[r], j_greedy,
                remaining=k - r if truncated else None,
            ).view(1)
            g_j = None
        elif exact:
            # Straight into the state's round buffer (the values it reads back on the host).
            g_j, j1 = torch.max(scores_N, 0, keepdim=True, out=(state.g_1, state.j_1))
        else:
            g_j, j1 = torch.max(scores_N, 0, keepdim=True)
        if lazy:
            _ensure_row(gram, j1, scores_N, dom_N, rem_host if exact else rem_C, starts_C, positions_N)
        if not exact:
            _apga_round(state, j1, g_j, penalty_N, rem_C, dom_N, minus_one)
            continue
        if randomized:
            rem_C.index_add_(0, dom_N.index_select(0, j1), minus_one)
        j_int = state.add(j1, g_j)
        if r == k - 1:
            break  # no later pick reads the penalty
        # j_1 holds j again after `add` (re-entries and a promotion may have used the old one).
        j_now = j1 if randomized else state.j_1
        _mark_taken(state.scores_N if own_scores else penalty_N, j_int, j_now, dom_masks, dom_host, rem_host)
        if state.settled and own_scores:
            # The gradient no longer changes: the rest are the largest scores in turn (see ActiveSetState.add).
            state.add_settled(_settled_picks(state.scores_N, dom_N, rem_host, k - r - 1))
            break
    return _state_result(state, k)


def _apga_round(
    state: APGAState | APGAPoolState,
    j1: torch.Tensor,
    g_j: torch.Tensor,
    penalty_N: torch.Tensor,
    rem_C: torch.Tensor,
    dom_N: torch.Tensor,
    minus_one: torch.Tensor,
) -> None:
    """An APGA round after its pick ``j1``: the domains tracked on the device (no host read)."""
    penalty_N.index_fill_(0, j1, float("-inf"))
    rem_C.index_add_(0, dom_N.index_select(0, j1), minus_one)
    state.add(j1, g_j)
    penalty_N.masked_fill_(rem_C.index_select(0, dom_N) <= 0, float("-inf"))


def _state_result(
    state: ActiveSetState | APGAState | APGAPoolState, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """After the rounds: the selection in pick order, its weights ``v``, ``Phi(v)`` and the counters."""
    if isinstance(state, ActiveSetState):
        state.finalize()
        sel_S, v_S = state.sel_M, state.selection_weights()
    else:
        sel_S = state.sel_M[:k].clone()
        v_S = state.weights_on(sel_S)
    return sel_S, v_S, state.scaled_objective(), _state_info(state)


def _domain_starts(dom_N: torch.Tensor, num_domains: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each domain starts when the pool is grouped by domain, and the positions ``0..N-1``."""
    counts_C = torch.bincount(dom_N, minlength=num_domains)
    return torch.cumsum(counts_C, 0) - counts_C, torch.arange(dom_N.shape[0], device=dom_N.device)


def _ensure_row(
    gram: GramRows,
    j1: torch.Tensor,
    scores_N: torch.Tensor,
    dom_N: torch.Tensor,
    rem: torch.Tensor | list[int],
    starts_C: torch.Tensor,
    positions_N: torch.Tensor,
) -> None:
    """A lazy Gram's row of pick ``j1``, with the likeliest next picks in the same GEMM (see _prefetch_priority).

    ``rem``: the domains' remaining capacities, on the device or (the exact refit's) on the host.
    """
    j_host = int(j1)
    if not gram.has(j_host):
        rem_C = torch.tensor(rem, device=scores_N.device) if isinstance(rem, list) else rem
        gram.ensure([j_host], _prefetch_priority(scores_N, dom_N, rem_C, starts_C, positions_N))


class _DomainMasks:
    """``dom_N == d`` for the domains that fill up: all ``C`` rows in one comparison at the first
    request when ``C N`` is at most 2^22 (one kernel instead of one a full domain), else one each."""

    def __init__(self, dom_N: torch.Tensor, num_domains: int) -> None:
        self.dom_N = dom_N
        self.num_domains = num_domains
        self.rows: tuple[torch.Tensor, ...] | None = None

    def mask(self, d: int) -> torch.Tensor:
        """``(N,)`` bool mask of domain ``d``."""
        if self.num_domains * self.dom_N.shape[0] > 1 << 22:
            return self.dom_N == d
        if self.rows is None:
            domains_C1 = torch.arange(self.num_domains, device=self.dom_N.device).view(-1, 1)
            self.rows = (self.dom_N == domains_C1).unbind(0)
        return self.rows[d]


def _mark_taken(
    penalty_N: torch.Tensor, j: int, j1: torch.Tensor, domains: _DomainMasks, dom_host: list[int], rem_host: list[int]
) -> None:
    """Make pick ``j`` (host; ``j1`` on the device) unavailable, with its domain when that is now full."""
    d = dom_host[j]
    rem_host[d] -= 1
    if rem_host[d] == 0:
        penalty_N.masked_fill_(domains.mask(d), float("-inf"))  # j among them
    else:
        penalty_N.index_fill_(0, j1, float("-inf"))


def _settled_picks(scores_N: torch.Tensor, dom_N: torch.Tensor, rem_host: list[int], picks: int) -> list[int]:
    """The remaining greedy picks of a settled exact state, all at once: one host read for all of them.

    With the scores fixed (``scores_N``: the gradient plus the penalty, -inf where taken or in a full
    domain), greedy picks in turn the largest score whose domain has room: the scores in descending
    order (ties: the lower position first, as ``torch.max`` picks), each kept while its domain's
    rank in that order is within the domain's remaining capacity, and the first ``picks`` kept.
    The same picks, in the same order, as ``picks`` rounds of ``max`` and marking, without their
    syncs. ``rem_host`` and ``scores_N`` are left as they are (no later pick reads them).
    """
    device = scores_N.device
    order_N = torch.sort(scores_N, descending=True, stable=True).indices
    dom_sorted_N = dom_N.index_select(0, order_N)
    # Rank of each sorted element within its domain: group by domain (stable, so score order is
    # kept inside a group) and subtract the group's start (a search, not a bincount: CUDA's syncs).
    by_domain_N = torch.argsort(dom_sorted_N, stable=True)
    grouped_N = dom_sorted_N.index_select(0, by_domain_N)
    positions = torch.arange(max(dom_N.shape[0], len(rem_host)), device=device)
    starts_C = torch.searchsorted(grouped_N, positions[: len(rem_host)])
    grouped_ranks_N = positions[: dom_N.shape[0]] - starts_C.index_select(0, grouped_N)
    ranks_N = torch.empty_like(by_domain_N).index_copy_(0, by_domain_N, grouped_ranks_N)
    rem_C = torch.tensor(rem_host, dtype=torch.long).to(device, non_blocking=True)
    keep_N = (ranks_N < rem_C.index_select(0, dom_sorted_N)) & (scores_N.index_select(0, order_N) > float("-inf"))
    kept_first_N = torch.argsort((~keep_N).to(torch.uint8), stable=True)
    chosen = torch.cat([order_N.index_select(0, kept_first_N[:picks]), keep_N.sum().view(1)]).tolist()
    if chosen[-1] < picks:
        raise RuntimeError(
            f"partitionsel: {picks} greedy picks remain but only {chosen[-1]} elements have room in their domain"
        )
    return chosen[:picks]


def _randomized_draws(
    generator: torch.Generator | None, k: int, device: torch.device, capacities_C: torch.Tensor
) -> tuple[torch.Tensor, bool]:
    """`pick: randomized`: one uniform a round, and whether the capacities sum above k (then the base of the
    matroid truncated at k keeps only the k - r heaviest of the per-domain bases: capacities slack)."""
    gen = generator if generator is not None else torch.Generator(device=device)
    uniforms_K = torch.rand(k, generator=gen, device=gen.device, dtype=torch.float64).to(device)
    return uniforms_K, int(capacities_C.sum()) > k


def _refit_state(
    refit: str,
    gram: GramRows,
    mu_N: torch.Tensor,
    k: int,
    ridge_abs: float,
    grad_tol: torch.Tensor,
    apga_max_iters: int,
    apga_tol: float,
    host_values: tuple[float, list[float]] | None,
) -> ActiveSetState | APGAState | APGAPoolState:
    """The refit the rounds grow: the exact active set, or APGA on the selection or on the pool."""
    if refit == "exact":
        return ActiveSetState(gram, mu_N, k, ridge_abs, grad_tol, host_values=host_values)
    if refit == "apga":
        return APGAState(gram, mu_N, k, ridge_abs, apga_max_iters, apga_tol)
    return APGAPoolState(gram, mu_N, k, ridge_abs, apga_max_iters, apga_tol)


def _state_info(state: ActiveSetState | APGAState | APGAPoolState) -> dict[str, torch.Tensor | int]:
    """Counters of the host-side bookkeeping, as Python numbers (nothing to copy to or from a device)."""
    info: dict[str, torch.Tensor | int] = {}
    if isinstance(state, ActiveSetState):
        info["slow_refits"] = state.slow_refits
        info["weight_drops"] = state.drops
        info["weight_reentries"] = state.reentries
        # Left at weight 0 because their pivot was numerically singular (still selected: they fill
        # the budget, but the refit cannot use them).
        info["singular_pivots"] = sum(1 for e in state.singular if e not in state.slot_of)
    else:
        info["apga_iterations"] = state.iterations
    return info


def _prefetch_priority(
    scores_N: torch.Tensor,
    dom_N: torch.Tensor,
    rem_C: torch.Tensor,
    starts_C: torch.Tensor,
    positions_N: torch.Tensor,
) -> torch.Tensor:
    """Which rows a lazy Gram computes ahead: the max-weight base of the contracted matroid first.

    The remaining picks fill every domain's remaining capacity, and while the gradients move
    little they are the ``rem_c`` best-scoring available elements of each domain (the base), so
    the base ranks first (by score), then everything else by score; ``-inf`` (unavailable) stays.
    """
    finite_N = torch.isfinite(scores_N)
    in_base_N = _max_weight_base(scores_N, dom_N, rem_C, starts_C, positions_N) & finite_N
    offset = 2.0 * torch.where(finite_N, scores_N, 0.0).abs().max() + 1.0
    return torch.where(in_base_N, scores_N + offset, scores_N)


def _max_weight_base(
    weight_N: torch.Tensor,
    dom_N: torch.Tensor,
    rem_C: torch.Tensor,
    starts_C: torch.Tensor,
    positions_N: torch.Tensor,
) -> torch.Tensor:
    """``(N,)`` mask of the ``rem_c`` largest weights of each domain (ties by pool position)."""
    by_weight_N = torch.sort(weight_N, descending=True, stable=True).indices
    by_domain_N = torch.sort(dom_N.index_select(0, by_weight_N), stable=True).indices
    perm_N = by_weight_N.index_select(0, by_domain_N)
    dom_sorted_N = dom_N.index_select(0, perm_N)
    rank_N = positions_N - starts_C.index_select(0, dom_sorted_N)
    base_sorted_N = rank_N < rem_C.index_select(0, dom_sorted_N)
    return torch.zeros_like(base_sorted_N).index_copy_(0, perm_N, base_sorted_N)


def _randomized_pick(
    grad_N: torch.Tensor,
    avail_N: torch.Tensor,
    dom_N: torch.Tensor,
    rem_C: torch.Tensor,
    starts_C: torch.Tensor,
    positions_N: torch.Tensor,
    uniform: torch.Tensor,
    j_greedy: torch.Tensor,
    remaining: int | None = None,
) -> torch.Tensor:
    """Uniform pick from the maximum-weight base of the contracted matroid (weights ``max(0, grad)``).

    The base takes, in each domain with remaining capacity ``rem_c``, its ``rem_c`` available
    elements of largest weight: two stable sorts group the pool by domain with weights descending
    (ties by pool position), and an element is in the base when its rank in its domain is below
    ``rem_c``. With ``remaining`` (capacities that are upper bounds summing above ``k``: the
    partition matroid truncated at ``k``), only the ``remaining`` heaviest of those are the base
    (ties by that order). Falls back to ``j_greedy`` (the largest gradient) when no available
    gradient is positive.
    """
    weight_N = torch.where(avail_N, grad_N.clamp_min(0.0), torch.full_like(grad_N, -1.0))
    by_weight_N = torch.sort(weight_N, descending=True, stable=True).indices
    by_domain_N = torch.sort(dom_N.index_select(0, by_weight_N), stable=True).indices
    perm_N = by_weight_N.index_select(0, by_domain_N)
    dom_sorted_N = dom_N.index_select(0, perm_N)
    rank_N = positions_N - starts_C.index_select(0, dom_sorted_N)
    base_N = rank_N < rem_C.index_select(0, dom_sorted_N)
    if remaining is not None:
        key_N = torch.where(base_N, weight_N.index_select(0, perm_N), torch.full_like(weight_N, float("-inf")))
        top_N = torch.sort(key_N, descending=True, stable=True).indices[:remaining]
        base_N = base_N & torch.zeros_like(base_N).index_fill_(0, top_N, True)
    size = base_N.sum()
    target = torch.minimum((uniform * size).floor().long(), size - 1)
    pos = torch.argmax((torch.cumsum(base_N.long(), 0) > target).long())
    j_random = perm_N.index_select(0, pos.view(1)).squeeze(0)
    any_positive = ((grad_N > 0) & avail_N).any()
    return torch.where(any_positive, j_random, j_greedy)


def _resolve_exact(
    gram: GramRows,
    mu_N: torch.Tensor,
    sel_S: torch.Tensor,
    v_S: torch.Tensor,
    ridge_abs: float,
    grad_tol: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The exact NNLS optimum on ``sel_S`` warm-started from ``v_S``: ``(sel_S, v_S, Phi, blocked)``."""
    gram_SS = gram.block(sel_S)
    mu_S = mu_N[sel_S]
    stats: dict = {}
    v_S = refit_exact(gram_SS, mu_S, ridge_abs=ridge_abs, v0_S=v_S, grad_tol=grad_tol, stats=stats)
    phi = torch.dot(v_S, mu_S) - 0.5 * torch.dot(v_S, gram_SS @ v_S)
    return sel_S, v_S, phi, len(stats.get("blocked", ()))


_RIDGE_WARNED = False


def _ridge_share(
    strategy: str,
    v_S: torch.Tensor,
    mu_S: torch.Tensor,
    ridge_abs: float | torch.Tensor,
    inputs: SelectionInputs,
    ridge_rel: float,
    *,
    device: torch.device | None = None,
) -> torch.Tensor:
    """Share of ``v^T (K + ridge I) v`` that is the ridge, ``ridge |v|^2 / <v, mu>`` (0-dim); warns once above 1/2.

    At the ridge optimum ``<v, mu> = v^T (K + ridge I) v``. With ``eta > 0`` the diagonal bonus
    ``(eta/2) diag(K)`` in ``mu`` rewards weight along directions that ``K_SS`` does not penalise
    (more picks than the features' rank): only the ridge bounds them, and the objective and the
    weights then grow as ``1 / ridge`` (the demo's logged f(S) near 7e6). ``device``: where the share
    is returned and judged, the features' (a CPU solve's share moves there, as the step reads it).
    """
    align = torch.dot(v_S, mu_S)
    share = ridge_abs * torch.dot(v_S, v_S) / align.clamp_min(torch.finfo(v_S.dtype).tiny)
    share = share.masked_fill_(align <= 0, 0.0)
    if device is not None:
        share = share.to(device, non_blocking=True)  # a CPU solve's value joins the features' device, as the step reads them
    if not _RIDGE_WARNED and ridge_rel > 0 and inputs.eta > 0:
        # Judged on the host with the step's other checks (now, outside a selection step).
        check_or_defer(share, lambda values: _warn_ridge(strategy, values[0], v_S.shape[0], inputs, ridge_rel))
    return share


def _warn_ridge(strategy: str, value: float, k: int, inputs: SelectionInputs, ridge_rel: float) -> None:
    """The once-per-process warning of ``_ridge_share`` (the share is read on the host here)."""
    global _RIDGE_WARNED
    if not _RIDGE_WARNED:
        if value > 0.5:
            _RIDGE_WARNED = True
            dim = inputs.features.shape[1] if inputs.features is not None else None
            cause = (
                f"{k} picks exceed the {dim} feature dimensions"
                if dim is not None and k > dim
                else f"the {k} picks' features are nearly linearly dependent"
            )
            log.warning(
                "%s: the objective is ridge-dominated (%.0f%% of v^T (K + ridge I) v is the ridge): %s, and "
                "with eta=%g > 0 the diagonal bonus (eta/2) diag(K) rewards weight along directions of K_SS "
                "that only the ridge (%g x mean diag K) bounds, so f(S) and the weights scale as 1/ridge. "
                "Use more feature dimensions (features.proj_dim), a smaller kappa, or a larger ridge. "
                "(Logged once per process; selection/ridge_share tracks it every step.)",
                strategy,
                100 * value,
                cause,
                inputs.eta,
                ridge_rel,
            )


def _device_loop(opts: PartitionSelOptions, inputs: SelectionInputs, gram: GramRows) -> bool:
    """Whether the OMP rounds run on the device (``PartitionSelOptions.solver_loop``)."""
    if opts.refit != "exact" or opts.pick != "greedy" or opts.refine is not None or gram.lazy:
        return False
    return opts.solver_loop in ("device", "device_compiled", "device_triton")


def _cpu_solve(opts: PartitionSelOptions, inputs: SelectionInputs) -> bool:
    """Whether the solve moves to the CPU (``PartitionSelOptions.solver_loop``)."""
    return opts.solver_loop == "cpu"


def _to_cpu(
    gram: GramRows, mu_N: torch.Tensor, inputs: SelectionInputs, caps_C: torch.Tensor
) -> tuple[GramRows, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``K`` (a full Gram, formed on the device), ``mu``, the domain ids and the capacities on the CPU, in one transfer.

    The ids and capacities travel with ``K`` as floats (exact below 2^24) unless the caller gave them
    on the host already, as the training loop does.
    """
    n = mu_N.shape[0]
    gram_NN = gram.gram_NN if not gram.lazy else gram.full()
    parts = [gram_NN.reshape(-1), mu_N]
    dom_host = inputs.domain_ids_host
    if dom_host is None:
        parts.append(inputs.domain_ids.to(mu_N.dtype))
    caps_on_host = caps_C.device.type == "cpu"
    if not caps_on_host:
        parts.append(caps_C.to(mu_N.dtype))
    host = torch.cat(parts).cpu()  # the solver's one read
    out_gram = GramRows(gram_NN=host[: n * n].view(n, n))
    mu_host = host[n * n : n * n + n]
    rest = host[n * n + n :]
    if dom_host is None:
        dom_host, rest = rest[:n].long(), rest[n:]
    if not caps_on_host:
        caps_C = rest.long()
    return out_gram, mu_host, dom_host, caps_C


def _result_to(result: SelectionResult, device: torch.device) -> SelectionResult:
    """The CPU solve's result back on the features' device, copied without making the host wait."""
    move = lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return SelectionResult(
        indices=move(result.indices),
        domain_counts=move(result.domain_counts),
        weights=move(result.weights),
        objective=move(result.objective),
        info={k: move(v) for k, v in result.info.items()},
    )


def _solve_on_device(
    opts: PartitionSelOptions,
    inputs: SelectionInputs,
    gram: GramRows,
    mu_N: torch.Tensor,
    caps_C: torch.Tensor,
    grad_tol: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, torch.Tensor | float] | None:
    """``omp_exact_on_device`` (one host read when ``k <= ROUNDS_PER_READ`` and no round is repaired):
    ``(sel_S, v_S, phi, info, ridge_abs)``, or None when a round needed a branch only the host loop takes
    (a slow refit, a float64 promotion) and the host loop must run.

    The ridge stays on the device (``ridge x mean diag K``).
    """
    ridge_abs: torch.Tensor | float = opts.ridge * gram.diag_N.mean() if opts.ridge > 0 else 0.0
    with single_thread_on_cpu(mu_N.device, opts.cpu_single_thread):
        res = omp_exact_on_device(
            gram.gram_NN, mu_N, inputs.domain_ids, caps_C, inputs.k, ridge_abs, grad_tol,
            compile=opts.solver_loop == "device_compiled", triton=opts.solver_loop == "device_triton",
        )
    if not res.clean:  # read with the last batch of rounds
        return None
    info = {"slow_refits": 0, "weight_drops": res.drops, "weight_reentries": res.reentries, "singular_pivots": 0,
            "device_loop_fallback": 0, "device_loop_reads": res.reads, "device_loop_rounds": res.rounds}
    return res.sel_K, res.v_K, res.phi, info, ridge_abs


def _use_lazy_gram(opts: PartitionSelOptions, inputs: SelectionInputs, block_diagonal: bool) -> bool:
    """Whether to compute only the Gram rows the solver reads (see ``PartitionSelOptions.gram_rows``)."""
    if inputs.gram is not None or block_diagonal or opts.refit == "apga_pool" or opts.gram_rows == "full":
        return False
    if opts.gram_rows == "lazy":
        return True
    return inputs.device.type == "cpu" and inputs.n >= 128 and 8 * inputs.k <= inputs.n


def _unscale(phi: torch.Tensor, eta: float) -> torch.Tensor:
    """``f(S) = Phi / eta`` for ``eta > 0``; the scale-free ``Phi`` at ``eta == 0``."""
    return phi / eta if eta > 0 else phi
