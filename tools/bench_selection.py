"""Benchmark of PartitionSel refits: exact active-set vs the paper-faithful APGA, side by side in one run.

Times ``select_partitionsel`` end to end given ``G`` and ``gbar`` (Gram computation included), in
float32, after a warm-up, as the median of several runs, for the two cases of project issue 6:
(n=256, kappa=64, C=8, D=1024) and (n=2048, kappa=512, C=8, D=4096). Also reports the objective of
each refit, the extra time of ``refine: swap`` and the Gram time alone. Every figure is given as
wall time and as process CPU time; on a shared machine the wall time includes waiting for a core,
and with one thread the CPU time is the better estimate of the time on an idle machine.

Example:
    .venv/bin/python tools/bench_selection.py
    .venv/bin/python tools/bench_selection.py --repeats 3 --cases small
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from composer_algos.selection import compute_gram, select_partitionsel

CASES = {
    "small": dict(n=256, kappa=64, num_domains=8, dim=1024),
    "large": dict(n=2048, kappa=512, num_domains=8, dim=4096),
}
ETA = 0.5
APGA_ITERS = 128


def make_instance(n: int, dim: int, num_domains: int, seed: int = 0):
    """The quality-test family: G ~ N(0, 1/D), gbar = 0.3 mean(G) + N(0, 1/D), uniform domains."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(n, dim, generator=gen) / dim**0.5
    val_feature = 0.3 * features.mean(0) + torch.randn(dim, generator=gen) / dim**0.5
    domain_ids = torch.randint(0, num_domains, (n,), generator=gen)
    return features, val_feature, domain_ids


def time_call(fn, repeats: int) -> tuple[float, float, object]:
    """Median wall and process-CPU time of ``fn()`` over ``repeats`` runs after one warm-up run."""
    out = fn()
    walls, cpus = [], []
    for _ in range(repeats):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        out = fn()
        cpus.append(time.process_time() - cpu0)
        walls.append(time.perf_counter() - wall0)
    return statistics.median(walls), statistics.median(cpus), out


def _fmt(wall: float, cpu: float) -> str:
    return f"{wall * 1e3:9.2f} ms wall {cpu * 1e3:9.2f} ms cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per configuration (median)")
    parser.add_argument("--apga-repeats", type=int, default=3, help="timed runs of the slow APGA path")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, float32, eta={ETA}")
    for name in args.cases:
        case = CASES[name]
        features, val_feature, domain_ids = make_instance(case["n"], case["dim"], case["num_domains"])
        common = dict(
            features=features,
            val_feature=val_feature,
            domain_ids=domain_ids,
            num_domains=case["num_domains"],
            kappa=case["kappa"],
            eta=ETA,
            generator=None,
        )
        w_gram, c_gram, _ = time_call(lambda: compute_gram(features), args.repeats)
        w_exact, c_exact, res_exact = time_call(lambda: select_partitionsel(**common, refit="exact"), args.repeats)
        w_swap, c_swap, res_swap = time_call(
            lambda: select_partitionsel(**common, refit="exact", refine="swap"), args.repeats
        )
        w_apga, c_apga, res_apga = time_call(
            lambda: select_partitionsel(**common, refit="apga", apga_max_iters=APGA_ITERS, apga_tol=0.0),
            args.apga_repeats,
        )
        f_exact = float(res_exact.objective)
        f_apga = float(res_apga.objective)
        f_swap = float(res_swap.objective)
        rel = (f_exact - f_apga) / abs(f_apga)
        print(
            f"\n[{name}] n={case['n']} kappa={case['kappa']} C={case['num_domains']} D={case['dim']}"
            f"\n  gram alone        {_fmt(w_gram, c_gram)}"
            f"\n  exact             {_fmt(w_exact, c_exact)}   f(S) = {f_exact:.6f}"
            f"  (slow refits {int(res_exact.info['slow_refits'])})"
            f"\n  apga x{APGA_ITERS}         {_fmt(w_apga, c_apga)}   f(S) = {f_apga:.6f}"
            f"\n  exact + swap      {_fmt(w_swap, c_swap)}   f(S) = {f_swap:.6f}"
            f"  (swaps {int(res_swap.info['swaps'])} in {int(res_swap.info['swap_rounds'])} rounds)"
            f"\n  swap extra        {_fmt(w_swap - w_exact, c_swap - c_exact)}"
            f"\n  speed-up apga/exact: {w_apga / w_exact:.1f}x wall, {c_apga / c_exact:.1f}x cpu;"
            f" solve only (gram subtracted): {(w_apga - w_gram) / (w_exact - w_gram):.1f}x wall,"
            f" {(c_apga - c_gram) / (c_exact - c_gram):.1f}x cpu"
            f"\n  objective exact vs apga: relative difference {rel:+.3e} (>= -1e-6 wanted);"
            f" swap vs exact {(f_swap - f_exact) / abs(f_exact):+.3%}"
        )


if __name__ == "__main__":
    main()
