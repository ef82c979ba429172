"""Whole selections with two versions of the Triton round kernels, side by side in one process.

Loads another copy of `composer_algos/selection/omp_triton.py` (a past commit's, say) beside the tree's and
times ``select_partitionsel(refit="exact", solver_loop="device_triton")`` with each, and with the tree's
kernels under each ``--blocks`` override of their block sizes: the runs interleaved round-robin, so a process
whose host runs slower (on the lent H200s the same GEMMs took 0.77 to 1.39 ms from one process to the next)
slows every arm alike. Prints each arm's median and minimum, its ratio to the other kernels, and whether it made
the host loop's picks in every run (the warm-up's too). `bench_selection.py --triton-sweep` times block sizes of the tree's kernels only, and
the solve alone; this compares kernel code on what a selection costs.

Example (from the project root, on a GPU):
    git show f410456:composer_algos/selection/omp_triton.py > /tmp/omp_triton_f410456.py
    python tools/bench/compare_triton_kernels.py --kernels /tmp/omp_triton_f410456.py --seeds 0 1 --repeats 21 \\
        --blocks '{"reduce": 512, "p_rows": 8}'

On a CPU the kernels run only in Triton's interpreter (``TRITON_INTERPRET=1``, as the smoke test runs it at a
tiny size): its times are not a GPU's.
"""

from __future__ import annotations

import argparse
import functools
import importlib.machinery
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]  # tools/, the project

# torch and the selection core load in the functions that use them, so --help is fast.


def _blocks(text: str) -> dict:
    """One ``--blocks`` value: a JSON object of block sizes (its keys checked against BLOCKS in `main`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): {text!r}") from None
    if not isinstance(value, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        raise argparse.ArgumentTypeError(f"must be a JSON object of integers, e.g. '{{\"reduce\": 512}}', got {text!r}")
    for key, size in value.items():
        if key == "fused" and size not in (0, 1):
            raise argparse.ArgumentTypeError(f"{text!r}: fused must be 0 or 1, got {size}")
        if key != "fused" and (size < 1 or size & (size - 1)):
            raise argparse.ArgumentTypeError(f"{text!r}: {key} must be a power of two (Triton's blocks are), got {size}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", type=Path, required=True, help="another omp_triton.py to time beside the tree's")
    parser.add_argument("--blocks", type=_blocks, action="append", default=[],
                        help="a JSON object of block sizes (keys of omp_triton.BLOCKS) for one more arm of the tree's "
                        "kernels; repeat for more arms")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                        help="bench_selection's instances (seed 0 has 2 drops and 2 re-entries at the default size)")
    parser.add_argument("--repeats", type=int, default=15, help="timed selections of each arm (median)")
    parser.add_argument("--n", type=int, default=2048, help="pool size")
    parser.add_argument("--kappa", type=int, default=512, help="picks")
    parser.add_argument("--dim", type=int, default=4096, help="feature dimensions")
    parser.add_argument("--domains", type=int, default=8, help="domains")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda",
                        help="cuda (every selection bracketed by a synchronize); cpu only with TRITON_INTERPRET=1")
    return parser


def _load_kernels(path: Path):
    """The other kernels as a module of their own, their block sizes marked so their workspaces stay apart."""
    spec = importlib.util.spec_from_loader("omp_triton_other", importlib.machinery.SourceFileLoader("omp_triton_other", str(path)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in ("BLOCKS", "TritonRound"):
        if not hasattr(module, name):
            raise SystemExit(f"--kernels {path}: no {name} in it; is it a copy of composer_algos/selection/omp_triton.py?")
    module.BLOCKS["other kernels"] = 1  # in the workspace key (active_set_device._workspace); TritonRound ignores it
    return module


def _arm(module, override: dict, device: str):
    """One selection with ``module``'s kernels (the tree's under ``override``): ``(seconds, result)``."""
    from bench_selection import synchronized, triton_blocks

    from composer_algos import selection as package
    from composer_algos.selection import active_set_device as asd
    from composer_algos.selection import omp_triton as tree
    from composer_algos.selection import select_partitionsel

    def run(common: dict):
        select = functools.partial(select_partitionsel, **common, refit="exact", solver_loop="device_triton")
        package.omp_triton, asd.TritonRound = module, module.TritonRound
        try:
            with triton_blocks(override):
                start = time.perf_counter()
                result = (synchronized(select) if device == "cuda" else select)()
                return time.perf_counter() - start, result
        finally:
            package.omp_triton, asd.TritonRound = tree, tree.TritonRound

    return run


def main() -> int:
    parser = _build_parser()
    args = parser.parse_args()
    if not args.kernels.is_file():
        parser.error(f"--kernels {args.kernels}: no such file")
    if args.repeats < 1 or min(args.n, args.kappa, args.dim, args.domains) < 1 or args.kappa > args.n:
        parser.error("--repeats, --n, --kappa, --dim and --domains must be at least 1, and --kappa at most --n")
    import torch

    from composer_algos.selection import active_set_device as asd
    from composer_algos.selection import omp_triton as tree
    from composer_algos.selection import select_partitionsel

    for override in args.blocks:
        unknown = sorted(set(override) - set(tree.BLOCKS))
        if unknown:
            parser.error(f"--blocks {json.dumps(override)}: unknown keys {unknown}; allowed: {sorted(tree.BLOCKS)}")
    if not tree.kernels_available(torch.device(args.device)):
        parser.error(f"--device {args.device}: Triton's kernels do not run there (a GPU, or a CPU with TRITON_INTERPRET=1)")
    from bench_selection import ETA, make_instance

    other = _load_kernels(args.kernels)
    arms = {f"other kernels ({args.kernels.name})": _arm(other, {}, args.device), "this tree's kernels": _arm(tree, {}, args.device)}
    for override in args.blocks:
        arms["this tree's, " + ", ".join(f"{k}={v}" for k, v in override.items())] = _arm(tree, override, args.device)
    asd._WORKSPACES_PER_THREAD = max(asd._WORKSPACES_PER_THREAD, 2 * len(arms))  # every arm keeps its graphs
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu, Triton's interpreter: not a GPU's times"
    print(f"torch {torch.__version__}, {where}; n={args.n} kappa={args.kappa} D={args.dim} C={args.domains}, float32, "
          f"eta={ETA}; this tree's BLOCKS = {tree.BLOCKS}")
    for seed in args.seeds:
        features, val_feature, domain_ids = make_instance(args.n, args.dim, args.domains, seed=seed)
        common = dict(features=features.to(args.device), val_feature=val_feature.to(args.device), domain_ids=domain_ids,
                      num_domains=args.domains, kappa=args.kappa, eta=ETA, generator=None, cpu_single_thread=False)
        host = select_partitionsel(**common, refit="exact", solver_loop="host").indices.tolist()
        times: dict = {name: [] for name in arms}
        same: dict = {}
        for name, fn in arms.items():  # warm-up: Triton compiles, the workspaces record their graphs
            same[name] = fn(common)[1].indices.tolist() == host
        for _ in range(args.repeats):
            for name, fn in arms.items():
                seconds, result = fn(common)
                times[name].append(seconds)
                same[name] = same[name] and result.indices.tolist() == host  # every run's, the warm-up's too
        base = statistics.median(times[next(iter(arms))])
        print(f"\nseed {seed}: whole selections, median of {args.repeats}, interleaved")
        for name in arms:
            median = statistics.median(times[name])
            print(f"  {name:<52} {median * 1e3:8.2f} ms  {median / base:6.3f}x the other kernels"
                  f"  min {min(times[name]) * 1e3:8.2f} ms  the host loop's picks (every run): {same[name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
