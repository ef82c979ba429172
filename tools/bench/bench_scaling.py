"""Solver time of global-scope PartitionSel at the pool sizes many ranks produce, and the per-step traffic.

Part 1 times ``select_partitionsel`` (``refit="exact"``, float32, Gram included) end to end at
``n`` in {512, 1024, 2048, 4096, 8192} pooled examples with ``kappa = n/2`` and ``n/8`` and
``D = 2048`` features, with 1 and 2 torch threads: the median of ``--repeats`` runs after a
warm-up (a case whose first run takes longer than ``--slow-s`` is timed from that one run, so the
whole table stays within about ten minutes on two cores). Part 2 prints, from the recipes' sizes,
the bytes each rank moves per step (the all-gather of features, domain ids and validation features,
and the example exchange) and the global pool every solve faces at 8 to 1024 ranks.

On a shared machine the wall times vary 2-4x between runs; the table reports medians and the
process CPU time next to them. A case that fails is reported in its row and the table goes on;
the exit code is then 1.

Example:
    .venv/bin/python tools/bench/bench_scaling.py
    .venv/bin/python tools/bench/bench_scaling.py --sizes 512 1024 --threads 1 --repeats 5
    .venv/bin/python tools/bench/bench_scaling.py --traffic-only
    .venv/bin/python tools/bench/bench_scaling.py --quick        # smoke run: n = 256, one thread, one timed run
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# torch and the selection core load in the functions that use them, so --help and --traffic-only are fast.

SIZES = (512, 1024, 2048, 4096, 8192)
DIM = 2048
ETA = 0.5
NUM_DOMAINS = 8
RANKS = (8, 64, 256, 1024)

# The recipes' sizes. Per-rank pools are the recipe's global batch over 8 ranks, held fixed as the
# world grows (weak scaling: a recipe's global batch of 32 cannot be split over 64 ranks).
RECIPES = {
    "llama1b_dolma": dict(
        yaml="yamls/llama1b_dolma.yaml",
        kappa_rank=4,
        oversampling=2,
        proj_dim=2048,
        seq_len=512,
        num_domains=7,
    ),
    "qwen2.5-3b_metamathqa": dict(
        yaml="yamls/qwen2.5-3b_metamathqa.yaml",
        kappa_rank=8,
        oversampling=2,
        proj_dim=2048,
        seq_len=512,
        num_domains=8,
    ),
}


def time_solve(n: int, kappa: int, repeats: int, slow_s: float) -> tuple[float, float, int]:
    """Median (wall s, cpu s) of the exact PartitionSel solve, and how many runs were timed."""
    from bench_selection import make_instance  # the quality-test instance family

    from composer_algos.selection import select_partitionsel

    features, val_feature, domain_ids = make_instance(n, DIM, NUM_DOMAINS)

    def run() -> None:
        select_partitionsel(
            features=features,
            val_feature=val_feature,
            domain_ids=domain_ids,
            num_domains=NUM_DOMAINS,
            kappa=kappa,
            eta=ETA,
            generator=None,
            refit="exact",
        )

    walls, cpus = [], []
    for r in range(repeats + 1):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        run()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if r == 0 and wall < slow_s:
            continue  # warm-up
        walls.append(wall)
        cpus.append(cpu)
        if wall >= slow_s:
            break
    return statistics.median(walls), statistics.median(cpus), len(walls)


def traffic_rows(recipe: dict, ranks: int) -> dict[str, float]:
    """Per-step bytes received by one rank under global scope, and the global problem size.

    The all-gather pads every rank's pool to the largest (equal here) and receives W x N rows of
    float32 features (D x 4 bytes) and int64 domain ids, plus one float32 (D + 1) validation vector
    per rank. The example exchange moves only the overflow: in the worst case every one of a rank's
    kappa examples comes from another rank, each carrying input_ids, labels (int64) and attention mask
    (int64) of seq_len tokens, sent through a padded all-gather (W x kappa x 3 x T x 8 bytes received).
    """
    n_rank = recipe["kappa_rank"] * recipe["oversampling"]
    d, t = recipe["proj_dim"], recipe["seq_len"]
    pool = n_rank * ranks
    gather = ranks * n_rank * (d * 4 + 8) + ranks * (d + 1) * 4
    exchange = ranks * recipe["kappa_rank"] * 3 * t * 8
    return {
        "pool": pool,
        "kappa": recipe["kappa_rank"] * ranks,
        "gather_bytes": gather,
        "exchange_bytes": exchange,
        "gram_bytes": pool * pool * 4,
    }


def _mib(x: float) -> str:
    return f"{x / 2**20:9.2f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="pooled examples n")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case after a warm-up (median)")
    parser.add_argument(
        "--slow-s", type=float, default=15.0, help="a case whose run takes this long is timed once"
    )
    parser.add_argument(
        "--kappa-divisors", type=int, nargs="+", default=[2, 8], help="kappa = n / each of these"
    )
    parser.add_argument("--traffic-only", action="store_true", help="print only the traffic table")
    parser.add_argument(
        "--quick", action="store_true",
        help="smoke run, not a measurement: --sizes 256 --threads 1 --repeats 1 (overrides those)",
    )
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.threads, args.repeats = [256], [1], 1
    for name in ("sizes", "threads", "kappa_divisors"):
        bad = [v for v in getattr(args, name) if v < 1]
        if bad:
            parser.error(f"--{name.replace('_', '-')} must all be >= 1, got {bad}")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")

    print("traffic per step and rank under global scope (weak scaling; D = proj_dim, float32 features)")
    print(
        f"{'recipe':<22} {'ranks':>5} {'pool P':>7} {'K':>6} {'all-gather recv':>16} {'exchange <=':>16} {'Gram':>14}"
    )
    for name, recipe in RECIPES.items():
        for w in RANKS:
            row = traffic_rows(recipe, w)
            print(
                f"{name:<22} {w:>5} {row['pool']:>7} {row['kappa']:>6} {_mib(row['gather_bytes']):>16}"
                f" {_mib(row['exchange_bytes']):>16} {_mib(row['gram_bytes']):>14}"
            )
    if args.traffic_only:
        return 0

    import torch

    print(
        f"\nexact PartitionSel solve (Gram included), float32, D={DIM}, C={NUM_DOMAINS}, eta={ETA}; "
        f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}"
    )
    print(f"{'threads':>7} {'n':>6} {'kappa':>6} {'wall s (median)':>16} {'cpu s':>9} {'runs':>5}")
    failed = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for n in args.sizes:
            for kappa in (n // k for k in args.kappa_divisors):
                start = time.perf_counter()
                try:
                    wall, cpu, runs = time_solve(n, kappa, args.repeats, args.slow_s)
                except Exception as err:  # report a failing case and go on with the table
                    took = time.perf_counter() - start
                    print(f"{threads:>7} {n:>6} {kappa:>6}   failed after {took:.1f} s: {err!r}", flush=True)
                    failed.append(f"threads {threads} n {n} kappa {kappa}")
                    continue
                print(f"{threads:>7} {n:>6} {kappa:>6} {wall:>16.3f} {cpu:>9.3f} {runs:>5}", flush=True)
    if failed:
        print(f"FAILED cases (see their rows): {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
