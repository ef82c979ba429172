"""Benchmark of PartitionSel refits side by side in one run: exact vs the support APGA vs the paper-faithful APGA.

Times ``select_partitionsel`` end to end given ``G`` and ``gbar`` (Gram computation included), in
float32, after a warm-up, as the median of several runs, for the two cases of project issue 6:
(n=256, kappa=64, C=8, D=1024) and (n=2048, kappa=512, C=8, D=4096). Variants:

- ``exact``: the default refit (incremental active-set NNLS), its rounds decided on the host;
- ``exact, device loop``: the same with ``solver_loop: device`` (no host sync in the rounds, one read
  every 64 rounds, a few more for each round repaired with a Lawson-Hanson drop; about twice the
  ops a pick; on CUDA from 16 picks the rounds are recorded as CUDA graphs of 16 rounds and replayed), with
  ``--compiled`` ``exact, compiled rounds`` with ``solver_loop: device_compiled`` (each round
  compiled into a few fused kernels; the count is printed from inductor's code) and ``exact, on
  the CPU`` with ``solver_loop: cpu`` (K and mu copied to the CPU once, the solve there), and with ``--triton``
  ``exact, Triton rounds`` with ``solver_loop: device_triton`` (each round two or three hand-written Triton kernels,
  16 rounds to a CUDA graph; on a CPU that setting runs the eager rounds, so the arm times nothing new there)
  and ``exact, Triton, eager repairs`` (the same with the repairs' segments run eagerly, not as CUDA graphs:
  their graphs' gain, side by side), ``exact, Triton, in a step`` (the same selection as a training step makes
  it: `solve_problem` with the checks deferred, then `settle_on_host`'s one transfer) and the Triton solve alone
  (`omp_exact_on_device` on K and mu computed once: the selection less the Gram, the checks and the bookkeeping);
  which is fastest on a GPU is what this measures there;
- ``apga``: the paper's Alg. 3 on the ``|S| x |S|`` support system, 128 iterations per refit;
- ``apga_pool``: the paper's Alg. 3 verbatim on the full pool vector (full ``N x N`` Gram in
  every iteration, step from ``||K||`` once per call), 128 iterations per refit: the reference
  the issue's 20x target is judged against;
- ``exact + swap``: the exact refit followed by the swap refinement (its extra time reported).

Reports each variant's objective with its relative difference to ``exact``, and the time ratio
of each APGA variant to ``exact``. The timed runs of all variants are taken round-robin, so a
machine whose speed drifts (shared cores) slows them alike. Every figure is given as wall time
and as process CPU time; on a shared machine the wall time includes waiting for a core, and with
one thread the CPU time is the better estimate of the time on an idle machine. At n=2048 the slow
``apga_pool`` is run once without a warm-up (``--pool-repeats``; 35-90 s on the development VM).

Example:
    .venv/bin/python tools/bench/bench_selection.py
    .venv/bin/python tools/bench/bench_selection.py --threads 1 --cases small --repeats 9
    .venv/bin/python tools/bench/bench_selection.py --cpu-single-thread
    .venv/bin/python tools/bench/bench_selection.py --quick     # smoke run: the small case, one timed run each
    .venv/bin/python tools/bench/bench_selection.py --device cuda --cases large --skip-pool   # on a GPU

Beside the times, one exact solve's aten ops and host syncs, in total and per pick (tools/bench/step_audit.py;
on a CPU the syncs a CUDA run would make are emulated): the exact refit's active set is driven from the
host, one sync a pick.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # tools/, the project

# torch and the selection core load in the functions that use them, so --help is fast.

CASES = {
    "small": dict(n=256, kappa=64, num_domains=8, dim=1024),
    "large": dict(n=2048, kappa=512, num_domains=8, dim=4096),
}
ETA = 0.5
APGA_ITERS = 128


def make_instance(n: int, dim: int, num_domains: int, seed: int = 0):
    """The quality-test family: G ~ N(0, 1/D), gbar = 0.3 mean(G) + N(0, 1/D), uniform domains."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(n, dim, generator=gen) / dim**0.5
    val_feature = 0.3 * features.mean(0) + torch.randn(dim, generator=gen) / dim**0.5
    domain_ids = torch.randint(0, num_domains, (n,), generator=gen)
    return features, val_feature, domain_ids


def time_interleaved(fns: dict, repeats: dict, warmup: dict) -> dict:
    """Median wall and process-CPU time of each ``fns[name]()``, the runs taken round-robin.

    On a machine whose speed drifts (shared cores, other jobs), interleaving exposes every variant
    to the same conditions, so the ratios stay meaningful even when the absolute times move.

    Returns:
        ``name -> (median wall s, median cpu s, last output)``.
    """
    outs = {name: fn() if warmup[name] else None for name, fn in fns.items()}
    walls: dict = {name: [] for name in fns}
    cpus: dict = {name: [] for name in fns}
    for r in range(max(repeats.values())):
        for name, fn in fns.items():
            if r >= repeats[name]:
                continue
            wall0, cpu0 = time.perf_counter(), time.process_time()
            outs[name] = fn()
            cpus[name].append(time.process_time() - cpu0)
            walls[name].append(time.perf_counter() - wall0)
    return {name: (statistics.median(walls[name]), statistics.median(cpus[name]), outs[name]) for name in fns}


def _fmt(wall: float, cpu: float) -> str:
    return f"{wall * 1e3:10.2f} ms wall {cpu * 1e3:10.2f} ms cpu"


def synchronized(fn):
    """`fn` bracketed by CUDA synchronizes (so the time is the device's work, not its launch)."""
    import torch

    def run():
        torch.cuda.synchronize()
        out = fn()
        torch.cuda.synchronize()
        return out

    return run


def per_solve_counts(fn, device_tensors) -> tuple[int, int, int]:
    """`(aten ops, kernel launches, host syncs)` of one call (tools/bench/step_audit.py; torch's syncs on CUDA)."""
    from step_audit import OpCount, SyncAudit, cuda_sync_count

    if any(t.is_cuda for t in device_tensors):
        with OpCount() as ops:
            syncs = cuda_sync_count(fn)
        return ops.ops, ops.kernels, syncs
    audit = SyncAudit(device_tensors)
    ops = OpCount(on_device=lambda: audit.device_call)
    audit._pause = ops.pause
    with ops, audit:
        fn()
    syncs = sum(n for (kind, _site, _call), n in audit.events.items() if kind in ("sync", "h2d"))
    return ops.ops, ops.kernels, syncs


def compiled_round_kernels(gram_NN, mu_N, dom_N, caps_C, k: int, code_path: str | None = None) -> int:
    """Kernels one compiled round of `solver_loop: device_compiled` runs: the calls in the code inductor
    generated for it (fused kernels, the library GEMMs, any aten fallback). On a GPU each is a launch, or a
    node of the CUDA graph the rounds are replayed as; the eager round is about 60 (58, 63 once a weight has dropped). Resets dynamo's caches
    (the code is only generated when the round compiles)."""
    import re

    import torch
    from torch._inductor.utils import run_and_get_code

    from composer_algos.selection.active_set_device import omp_exact_on_device
    from composer_algos.selection.refit import default_grad_tol

    torch._dynamo.reset()
    _, sources = run_and_get_code(
        lambda: omp_exact_on_device(gram_NN, mu_N, dom_N, caps_C, k, 1e-6, default_grad_tol(mu_N), graph=False, compile=True)
    )
    if code_path is not None:  # the kernels themselves, for fusing them further
        Path(code_path).write_text("\n\n# ----- next generated module -----\n\n".join(sources))
    call = re.compile(r"^\s+(?:buf\w+ = )?(cpp_fused_\w+|triton_\w+\.run|extern_kernels\.\w+|(?:torch\.ops\.)?aten\.\w+)")
    return sum(1 for src in sources for line in src.splitlines() if call.match(line) and "async_compile" not in line)


@contextlib.contextmanager
def triton_blocks(override: dict):
    """`omp_triton.BLOCKS` with ``override`` applied within the block, as it was after it (a solve reads the block
    sizes when it starts)."""
    from composer_algos.selection import omp_triton

    base = dict(omp_triton.BLOCKS)
    omp_triton.BLOCKS.update(override)
    try:
        yield
    finally:
        omp_triton.BLOCKS.clear()
        omp_triton.BLOCKS.update(base)


def sweep_triton_blocks(gram_NN, mu_N, dom_N, caps_C, k: int, repeats: int, wrap=lambda fn: fn) -> list[tuple[dict, float, bool]]:
    """The Triton rounds' solve under `omp_triton.BLOCKS` and under each of `omp_triton.SWEEP`, timed interleaved:
    ``(the override, median wall ms, the eager rounds' picks)`` for each, the default first. ``wrap`` brackets a
    solve (with a synchronize on CUDA). The block sizes are read when a solve starts; they are restored after each."""
    import torch

    from composer_algos.selection import active_set_device as asd
    from composer_algos.selection import omp_triton
    from composer_algos.selection.active_set_device import omp_exact_on_device
    from composer_algos.selection.refit import default_grad_tol

    args = (gram_NN, mu_N, dom_N, caps_C, k, 1e-6, default_grad_tol(mu_N))
    eager = omp_exact_on_device(*args)
    configs = [{}, *omp_triton.SWEEP]

    def solve_with(override: dict):
        def solve():
            with triton_blocks(override):
                return omp_exact_on_device(*args, triton=True)

        return wrap(solve)

    fns = {i: solve_with(cfg) for i, cfg in enumerate(configs)}
    # Each setting solves in its own workspace (the block sizes are in its key): keep them all, or the interleaved
    # settings evict each other and every timed solve records its graphs again (as the first H100 sweep did).
    kept = asd._WORKSPACES_PER_THREAD
    asd._WORKSPACES_PER_THREAD = max(kept, len(configs) + 1)
    try:
        timed = time_interleaved(fns, dict.fromkeys(fns, repeats), dict.fromkeys(fns, True))
    finally:
        asd._WORKSPACES_PER_THREAD = kept
    return [(cfg, timed[i][0] * 1e3, bool(torch.equal(timed[i][2].sel_K, eager.sel_K))) for i, cfg in enumerate(configs)]


def _solver_inputs(case: dict, instance: tuple) -> tuple:
    """``(K, mu, domain ids, capacities)`` of the case's instance on its features' device, for the solver alone."""
    import torch

    from composer_algos.selection.objective import build_objective

    features, val_feature, domain_ids = instance
    gram_NN, mu_N, _ = build_objective(features, val_feature, ETA)
    caps_C = torch.full((case["num_domains"],), case["kappa"], dtype=torch.long, device=gram_NN.device)
    return gram_NN, mu_N, domain_ids.to(gram_NN.device), caps_C


def _print_triton_sweep(args: argparse.Namespace, case: dict, instance: tuple) -> None:
    """`--triton-sweep`: the Triton rounds' solve under each block-size setting, against the default's time."""
    from composer_algos.selection import omp_triton

    wrap = synchronized if args.device == "cuda" else (lambda fn: fn)
    rows = sweep_triton_blocks(*_solver_inputs(case, instance), case["kappa"], args.repeats, wrap)
    default_ms = rows[0][1]
    print(f"\n  Triton block sizes (omp_triton.BLOCKS = {omp_triton.BLOCKS}), one solve each, median of {args.repeats}:")
    for override, ms, same in rows:
        label = "default" if not override else ", ".join(f"{key}={val}" for key, val in override.items())
        print(f"    {label:<32} {ms:9.2f} ms  {ms / default_ms:5.2f}x the default; the eager rounds' picks: {same}")


def main() -> int:
    parser = _build_parser()
    args = parser.parse_args()
    if args.quick:
        args.cases, args.repeats, args.apga_repeats, args.pool_repeats = ["small"], 1, 1, 1
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.triton_sweep:
        from composer_algos.selection.omp_triton import kernels_available

        if not kernels_available(torch.device(args.device)):
            parser.error(f"--triton-sweep: Triton's kernels do not run on {args.device} (use --device cuda, or TRITON_INTERPRET=1)")
    torch.set_num_threads(args.threads)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"threads {torch.get_num_threads()}"
    print(
        f"torch {torch.__version__}, {args.device} ({where}), float32, eta={ETA},"
        f" cpu_single_thread={args.cpu_single_thread}, load average {os.getloadavg()[0]:.2f}"
    )
    for name in args.cases:
        _bench_case(args, name)
    return 0


def _build_parser() -> argparse.ArgumentParser:
    """The benchmark's options: repeats, cases, threads, the variants to add or leave out, the device."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of exact and exact+swap (median)")
    parser.add_argument("--apga-repeats", type=int, default=3, help="timed runs of the support APGA")
    parser.add_argument(
        "--pool-repeats",
        type=int,
        default=None,
        help="timed runs of the full-pool APGA (default 3 with a warm-up for n <= 512, else 1 without)",
    )
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    parser.add_argument(
        "--cpu-single-thread",
        action="store_true",
        help="pass cpu_single_thread=True (OMP rounds and swap checks with one intra-op thread)",
    )
    parser.add_argument("--skip-pool", action="store_true", help="leave out the slow full-pool APGA")
    parser.add_argument(
        "--seed", type=int, default=0,
        help="the instance's seed (default 0). At n = 2048, kappa = 512 seed 0's exact solve has 2 Lawson-Hanson "
        "drops and 2 re-entries (the device loops repair those rounds on the device), seeds 1 and 2 none",
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="smoke run, not a measurement: --cases small with one timed run of every variant (overrides those)",
    )
    parser.add_argument(
        "--compiled", action="store_true",
        help="add the compiled rounds (solver_loop: device_compiled): compiles twice, tens of seconds on a CPU",
    )
    parser.add_argument(
        "--triton", action="store_true",
        help="add the Triton rounds (solver_loop: device_triton); on a CPU they are the eager rounds",
    )
    parser.add_argument(
        "--triton-sweep", action="store_true",
        help="time the Triton rounds under each block-size setting of omp_triton.SWEEP (CUDA, or TRITON_INTERPRET=1)",
    )
    parser.add_argument(
        "--kernel-table", action="store_true",
        help="profile one solve of each device-side loop: device busy time against the wall, the busiest kernels",
    )
    parser.add_argument("--round-code", help="with --compiled: write the code inductor generated for one round here")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="where the features live and the solver runs (cuda: every call bracketed by a synchronize)",
    )
    return parser


def _bench_case(args: argparse.Namespace, name: str) -> None:
    """Time every variant on one case, then print their times, objectives, op counts and ratios to exact."""
    case = CASES[name]
    features, val_feature, domain_ids = make_instance(case["n"], case["dim"], case["num_domains"], seed=args.seed)
    # The selection step hands the solver device features and host domain ids (the loader's).
    features, val_feature = features.to(args.device), val_feature.to(args.device)
    common = dict(
        features=features,
        val_feature=val_feature,
        domain_ids=domain_ids,
        num_domains=case["num_domains"],
        kappa=case["kappa"],
        eta=ETA,
        generator=None,
        cpu_single_thread=args.cpu_single_thread,
    )
    fns, repeats, warmup = _case_variants(args, case, common, features)
    timed = time_interleaved(fns, repeats, warmup)
    w_gram, c_gram, _ = timed["gram"]
    w_ex, c_ex, res_ex = timed["exact"]
    w_sw, c_sw, res_sw = timed["swap"]
    w_dv, c_dv, res_dv = timed["device"]
    w_cp, c_cp, res_cp = timed["cpu"]
    w_ap, c_ap, res_ap = timed["apga"]
    rows = [("exact", w_ex, c_ex, res_ex), ("exact, device loop", w_dv, c_dv, res_dv), ("exact, on the CPU", w_cp, c_cp, res_cp), ("apga (support) x128", w_ap, c_ap, res_ap)]
    for key, label in (("triton_eager_repairs", "exact, Triton, eager repairs"), ("triton_step", "exact, Triton, in a step"),
                       ("triton", "exact, Triton rounds"),
                       ("compiled", "exact, compiled rounds")):
        if key in timed:
            rows.insert(2, (label, *timed[key]))
    if not args.skip_pool:
        w_po, c_po, res_po = timed["pool"]
        rows.append(("apga_pool (paper) x128", w_po, c_po, res_po))
    rows.append(("exact + swap", w_sw, c_sw, res_sw))
    f_ex = float(res_ex.objective)
    _print_rows(args, name, case, rows, w_gram, c_gram, res_ex)
    k = case["kappa"]
    _print_solve_counts(args, common, [features, val_feature], k)
    same = res_dv.indices.tolist() == res_ex.indices.tolist()
    fallback = int(res_dv.info.get("device_loop_fallback", 0))
    print(
        f"  device loop / host loop {w_dv / w_ex:6.2f}x wall, {c_dv / c_ex:6.2f}x cpu; the same picks: {same};"
        f" handed over to the host loop: {bool(fallback)}; repaired on the device:"
        f" {0 if fallback else int(res_dv.info['weight_drops'])} drops, {0 if fallback else int(res_dv.info['weight_reentries'])}"
        f" re-entries (the host loop: {int(res_ex.info['weight_drops'])}, {int(res_ex.info['weight_reentries'])})"
        f"{_reads_and_rounds(res_dv, k)}"
    )
    _print_fused_rounds(args, case, timed, (features, val_feature, domain_ids))
    if args.triton_sweep:
        _print_triton_sweep(args, case, (features, val_feature, domain_ids))
    if args.kernel_table:
        loops = ["host", "device"] + (["device_compiled"] if args.compiled else []) + (["device_triton"] if args.triton else [])
        _print_kernel_tables(args, common, loops)
    print(
        f"  cpu solve / host loop   {w_cp / w_ex:6.2f}x wall, {c_cp / c_ex:6.2f}x cpu; the same picks:"
        f" {res_cp.indices.tolist() == res_ex.indices.tolist()}"
    )
    gain = (float(res_sw.objective) - f_ex) / abs(f_ex)
    print(f"  swap extra              {_fmt(w_sw - w_ex, c_sw - c_ex)}   f(S) gain {gain:+.3%}")
    for label, wall, cpu, res in [r for r in rows if r[0].startswith("apga")]:
        ok = (f_ex - float(res.objective)) >= -1e-6 * abs(float(res.objective))
        print(
            f"  exact vs {label:<22}: {wall / w_ex:6.1f}x wall, {cpu / c_ex:6.1f}x cpu faster;"
            f" solve only (Gram subtracted) {(wall - w_gram) / (w_ex - w_gram):6.1f}x wall,"
            f" {(cpu - c_gram) / (c_ex - c_gram):6.1f}x cpu; objective at least as high (1e-6): {ok}"
        )


def _print_fused_rounds(args: argparse.Namespace, case: dict, timed: dict, instance: tuple) -> None:
    """``--compiled`` and ``--triton``: each one's time against the host loop's, and the kernels a round."""
    import torch

    w_ex, c_ex, res_ex = timed["exact"]

    def ratio(label: str, key: str, note: str = "") -> None:
        wall, cpu, res = timed[key]
        print(
            f"  {label} / host loop {wall / w_ex:6.2f}x wall, {cpu / c_ex:6.2f}x cpu; the same picks:"
            f" {res.indices.tolist() == res_ex.indices.tolist()}; handed over:"
            f" {bool(res.info.get('device_loop_fallback', 0))}{note}{_reads_and_rounds(res, case['kappa'])}"
        )

    if args.compiled:
        ratio("compiled rounds", "compiled")
        calls = compiled_round_kernels(*_solver_inputs(case, instance), min(case["kappa"], 16), args.round_code)
        print(f"  one compiled round: {calls} kernels (inductor's generated code, {args.device}); the eager round about 60 ops")
        if args.round_code:
            print(f"  the compiled round's code: {args.round_code}")
    if args.triton:
        from composer_algos.selection.omp_triton import kernels_available

        if not kernels_available(torch.device(args.device)):
            note = " (on a CPU: the eager rounds; Triton's kernels run on GPUs)"
        else:
            from composer_algos.selection.omp_triton import BLOCKS

            note = ("; 2 kernels a round (3 after a drop)" if BLOCKS["fused"] else "; 3 kernels a round") + ("" if args.device == "cuda" else ", in Triton's interpreter (not a GPU's times)")
        ratio("Triton rounds", "triton", note)
        ratio("Triton rounds in a step", "triton_step")
        (w_tr, _, res_tr), (w_te, _, res_te) = timed["triton"], timed["triton_eager_repairs"]
        (w_ts, _, res_ts), (w_so, _, res_so) = timed["triton_step"], timed["triton_solve"]
        print(
            f"  Triton rounds: the selection {w_tr * 1e3:.2f} ms, in a step {w_ts * 1e3:.2f} ms ({w_ts / w_tr:.2f}x),"
            f" the solve alone {w_so * 1e3:.2f} ms (K and mu given; the Gram alone is above); the same picks:"
            f" {res_ts.indices.tolist() == res_tr.indices.tolist() == sorted(res_so.sel_K.tolist())}"
        )
        print(
            f"  Triton rounds, repairs graphed / eager {w_tr / w_te:6.2f}x wall; the same picks:"
            f" {res_tr.indices.tolist() == res_te.indices.tolist()}; repairs: {int(res_tr.info['weight_drops'])} drops,"
            f" {int(res_tr.info['weight_reentries'])} re-entries"
        )


def _reads_and_rounds(res, k: int) -> str:
    """A device-loop solve's host reads and rounds launched (frozen ones included: device time a GPU wastes)."""
    if "device_loop_reads" not in res.info:
        return ""  # handed over to the host loop
    return f"; {res.info['device_loop_reads']} reads, {res.info['device_loop_rounds']} rounds launched for {k} picks"


def _with_eager_repairs(fn):
    """``fn`` with the device loop's repairs run eagerly (`active_set_device.REPAIR_GRAPHS` off for the call): on
    CUDA their graphed segments' gain, side by side; on a CPU the same solve (nothing is graphed there)."""
    from composer_algos.selection import active_set_device as asd

    def call():
        kept, asd.REPAIR_GRAPHS = asd.REPAIR_GRAPHS, False
        try:
            return fn()
        finally:
            asd.REPAIR_GRAPHS = kept

    return call


def _as_in_a_step(common: dict, case: dict, loop: str):
    """The selection as a training step makes it: `solve_problem` with the strategy's checks deferred, then
    `settle_on_host`'s one transfer (the picks, weights, counters and checks). Outside a step a selection reads
    the device for its finiteness check before the solve and for the ridge share after it."""
    from composer_algos.data_selection.step import SelectionProblem, settle_on_host, solve_problem
    from composer_algos.selection import DeferredChecks, compute_capacities

    problem = SelectionProblem(
        domain_P=common["domain_ids"], kappa=case["kappa"], features_PD=common["features"], gbar_D=common["val_feature"]
    )
    options = {"refit": "exact", "solver_loop": loop, "cpu_single_thread": common["cpu_single_thread"]}
    # The other arms' capacities (deterministic rounding), so it solves their instance: a step draws its rounding.
    same_caps = lambda counts_C, k, gen: compute_capacities(counts_C, k)  # noqa: E731
    c = case["num_domains"]

    def call():
        checks = DeferredChecks()
        outcome = solve_problem(
            problem, "partitionsel", eta=ETA, seed=0, num_domains=c, options=options, capacity_fn=same_caps, deferred=checks
        )
        outcome, _, failed = settle_on_host(outcome, problem, {"solver": checks}, num_domains=c, seed=0, capacity_fn=same_caps)
        if failed or outcome.fallback:
            raise RuntimeError(f"the step's selection fell back: {outcome.fallback or failed}")
        return outcome.result

    return call


def _solve_alone(case: dict, instance: tuple):
    """The Triton rounds' solve alone (`omp_exact_on_device` on K and mu computed once): the whole selection less
    the Gram, the checks and the bookkeeping around the solve."""
    import torch

    from composer_algos.selection.active_set_device import omp_exact_on_device
    from composer_algos.selection.capacities import resolve_capacities
    from composer_algos.selection.partitionsel import PartitionSelOptions
    from composer_algos.selection.refit import default_grad_tol

    gram_NN, mu_N, dom_N, _ = _solver_inputs(case, instance)
    # The selection's capacities (proportional to the pool's domains), not the sweep's unconstrained ones.
    caps_C = resolve_capacities("partitionsel", None, instance[2], case["num_domains"], case["kappa"])
    grad_tol = default_grad_tol(mu_N)
    ridge_abs = PartitionSelOptions().ridge * torch.diagonal(gram_NN).mean()  # the default, relative to mean diag K
    return lambda: omp_exact_on_device(gram_NN, mu_N, dom_N, caps_C, case["kappa"], ridge_abs, grad_tol, triton=True)


def _case_variants(args: argparse.Namespace, case: dict, common: dict, features) -> tuple[dict, dict, dict]:
    """(functions, timed runs, warm-up or not) of every variant timed on the case, by key."""
    from composer_algos.selection import compute_gram, select_partitionsel

    apga = dict(apga_max_iters=APGA_ITERS, apga_tol=0.0)
    small = case["n"] <= 512
    fns = {
        "gram": lambda: compute_gram(features),
        "exact": lambda: select_partitionsel(**common, refit="exact", solver_loop="host"),
        "device": lambda: select_partitionsel(**common, refit="exact", solver_loop="device"),
        "cpu": lambda: select_partitionsel(**common, refit="exact", solver_loop="cpu"),
        "swap": lambda: select_partitionsel(**common, refit="exact", refine="swap"),
        "apga": lambda: select_partitionsel(**common, refit="apga", **apga),
    }
    repeats = {
        "gram": args.repeats,
        "exact": args.repeats,
        "device": args.repeats,
        "cpu": args.repeats,
        "swap": args.repeats,
        "apga": args.apga_repeats,
    }
    if args.compiled:
        fns["compiled"] = lambda: select_partitionsel(**common, refit="exact", solver_loop="device_compiled")
        repeats["compiled"] = args.repeats
    if args.triton:
        fns["triton"] = lambda: select_partitionsel(**common, refit="exact", solver_loop="device_triton")
        repeats["triton"] = args.repeats
        fns["triton_eager_repairs"] = _with_eager_repairs(fns["triton"])
        repeats["triton_eager_repairs"] = args.repeats
        fns["triton_step"] = _as_in_a_step(common, case, "device_triton")
        repeats["triton_step"] = args.repeats
        fns["triton_solve"] = _solve_alone(case, (features, common["val_feature"], common["domain_ids"]))
        repeats["triton_solve"] = args.repeats
    warmup = dict.fromkeys(fns, True)
    if not args.skip_pool:
        fns["pool"] = lambda: select_partitionsel(**common, refit="apga_pool", **apga)
        repeats["pool"] = args.pool_repeats if args.pool_repeats is not None else (3 if small else 1)
        warmup["pool"] = small
    if args.device == "cuda":
        fns = {key: synchronized(fn) for key, fn in fns.items()}
    return fns, repeats, warmup


def _print_rows(args: argparse.Namespace, name: str, case: dict, rows: list, w_gram: float, c_gram: float, res_ex) -> None:
    """The case's heading, the Gram's time, then each variant's time and objective against exact's."""
    f_ex = float(res_ex.objective)
    rows_computed = res_ex.info.get("gram_rows_computed")
    gram_note = "full Gram" if rows_computed is None else f"lazy Gram, {int(rows_computed)} rows"
    print(
        f"\n[{name}] n={case['n']} kappa={case['kappa']} C={case['num_domains']} D={case['dim']} seed={args.seed}"
        f"\n  gram alone              {_fmt(w_gram, c_gram)}"
    )
    for label, wall, cpu, res in rows:
        f = float(res.objective)
        extra = ""
        if "slow_refits" in res.info:
            extra = f"  slow refits {int(res.info['slow_refits'])}, {gram_note}"
        if "swaps" in res.info:
            extra += f", swaps {int(res.info['swaps'])} in {int(res.info['swap_rounds'])} rounds"
        print(
            f"  {label:<23} {_fmt(wall, cpu)}   f(S) = {f:.6f}  (exact - this) / |this| ="
            f" {(f_ex - f) / abs(f):+.2e}{extra}"
        )


def _print_kernel_tables(args: argparse.Namespace, common: dict, loops: list[str], top: int = 12) -> None:
    """One solve of each loop under torch.profiler: where its device time goes, kernel by kernel.

    The wall against the union of the device's busy intervals says how much of the solve is launch and
    read latency; the table, which kernels the rest is (on a CPU: the busiest ops, not a GPU's figure).
    """
    import torch
    from step_audit import device_busy_intervals, device_work
    from torch.profiler import ProfilerActivity, profile

    from composer_algos.selection import select_partitionsel

    cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for loop in loops:
        def solve():
            select_partitionsel(**common, refit="exact", solver_loop=loop)
            if cuda:
                torch.cuda.synchronize()

        solve()  # warm: graphs recorded, rounds compiled
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            solve()
        wall_ms = (time.perf_counter() - t0) * 1e3
        busy = sum(end - start for start, end in device_busy_intervals(prof.events()))
        print(
            f"\n  kernels of one solve, solver_loop {loop}: {wall_ms:.1f} ms wall (profiled), device busy"
            f" {busy / 1e3:.1f} ms, {len(device_work(prof.events()))} device events"
        )
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=top, max_name_column_width=60))


def _print_solve_counts(args: argparse.Namespace, common: dict, device_tensors: list, k: int) -> None:
    """One exact solve's aten ops, kernel launches and host syncs for each solver loop, in total and per pick."""
    from composer_algos.selection import select_partitionsel

    for loop in ("host", "device", "cpu"):
        ops, kernels, syncs = per_solve_counts(
            lambda: select_partitionsel(**common, refit="exact", solver_loop=loop), device_tensors
        )
        print(
            f"  exact ({loop} loop), one solve: {ops} aten ops ({kernels} kernel launches), {syncs} host syncs"
            f" ({'torch' if args.device == 'cuda' else 'emulated'}); per pick {ops / k:.1f} ops,"
            f" {kernels / k:.1f} launches, {syncs / k:.2f} syncs"
        )
    # The fused rounds: torch's sync count only (the op count's dispatch mode would run under the fused code's feet).
    from step_audit import cuda_sync_count

    for wanted, loop, label in ((args.compiled, "device_compiled", "compiled"), (args.triton, "device_triton", "Triton")):
        if wanted and args.device == "cuda":
            syncs = cuda_sync_count(lambda loop=loop: select_partitionsel(**common, refit="exact", solver_loop=loop))
            print(f"  exact ({label} rounds), one solve: {syncs} host syncs (torch)")


if __name__ == "__main__":
    raise SystemExit(main())
