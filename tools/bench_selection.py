"""Benchmark of PartitionSel refits: exact active-set vs the paper-faithful APGA, side by side in one run.

Times ``select_partitionsel`` end to end given ``G`` and ``gbar`` (Gram computation included), in
float32, after a warm-up, as the median of several runs, for the two cases of project issue 6:
(n=256, kappa=64, C=8, D=1024) and (n=2048, kappa=512, C=8, D=4096). Also reports the objective of
each refit, the extra time of ``refine: swap`` and the Gram time alone.

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


def time_call(fn, repeats: int) -> tuple[float, object]:
    """Median wall time of ``fn()`` over ``repeats`` runs after one warm-up run."""
    out = fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


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
        t_gram, _ = time_call(lambda: compute_gram(features), args.repeats)
        t_exact, res_exact = time_call(lambda: select_partitionsel(**common, refit="exact"), args.repeats)
        t_swap, res_swap = time_call(lambda: select_partitionsel(**common, refit="exact", refine="swap"), args.repeats)
        t_apga, res_apga = time_call(
            lambda: select_partitionsel(**common, refit="apga", apga_max_iters=APGA_ITERS, apga_tol=0.0),
            args.apga_repeats,
        )
        f_exact = float(res_exact.objective)
        f_apga = float(res_apga.objective)
        f_swap = float(res_swap.objective)
        rel = (f_exact - f_apga) / abs(f_apga)
        print(
            f"\n[{name}] n={case['n']} kappa={case['kappa']} C={case['num_domains']} D={case['dim']}"
            f"\n  gram alone            {t_gram * 1e3:9.2f} ms"
            f"\n  exact                 {t_exact * 1e3:9.2f} ms   f(S) = {f_exact:.6f}"
            f"   (solve only {(t_exact - t_gram) * 1e3:.2f} ms, slow refits {int(res_exact.info['slow_refits'])})"
            f"\n  apga x{APGA_ITERS}             {t_apga * 1e3:9.2f} ms   f(S) = {f_apga:.6f}"
            f"   (solve only {(t_apga - t_gram) * 1e3:.2f} ms)"
            f"\n  exact + swap          {t_swap * 1e3:9.2f} ms   f(S) = {f_swap:.6f}"
            f"   (swap extra {(t_swap - t_exact) * 1e3:.2f} ms, swaps {int(res_swap.info['swaps'])})"
            f"\n  speed-up apga/exact   {t_apga / t_exact:9.1f} x    (solve only {(t_apga - t_gram) / (t_exact - t_gram):.1f} x)"
            f"\n  objective exact vs apga: relative difference {rel:+.3e} (>= -1e-6 wanted)"
        )


if __name__ == "__main__":
    main()
