"""Run several selection strategies (and seeds) on equal budgets and compare them.

Example:
    python tools/run_experiment.py --yaml yamls/testing/demo_dolma.yaml \
        --shard-dir demo_out/shards/dolma --strategies partitionsel,id,random,greats \
        --seeds 1,2 --steps 200 --out demo_out/experiments/demo

Every run uses the same shards, model, number of steps and kappa (`global_train_batch_size`);
only `algorithms.data_selection.strategy` and the seed change. The seed sets the model's
initialisation and the selection and validation draws; the data order stays the yaml's
`train_loader.dataset.shuffle_seed`, so every strategy chooses from the same sequence of pools
(pass `-- train_loader.dataset.shuffle_seed=N` to vary it too). Extra `key=value` arguments after
`--` are passed to every run (e.g. `-- optimizer.lr=1e-3`). Runs already finished in `--out`
are reused unless `--rerun`.

`--jobs N` runs N trainings at a time (on CPU each with cores/N threads, which is much faster
than N processes fighting over every core).

Writes OUT/comparison.md, OUT/comparison.json and OUT/curves.png: per-domain validation
log-perplexity at the last evaluation (mean +- std over seeds), their average, wall time and
the share of it spent selecting (features + solve + exchange).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STRATEGIES = ("partitionsel", "greats", "id", "iwd", "gradnorm", "colm", "random", "random_stratified", "none")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--yaml", type=Path, required=True, help="base run yaml")
    parser.add_argument("--shard-dir", required=True, help="shards every run trains on (variables.shard_dir)")
    parser.add_argument("--strategies", default="partitionsel,id,random,greats", help="comma-separated strategies")
    parser.add_argument("--seeds", default="1,2", help="comma-separated seeds")
    parser.add_argument("--steps", type=int, required=True, help="training steps of every run")
    parser.add_argument("--eval-interval", type=int, default=None, help="evaluate every N steps (default: steps/5)")
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--rerun", action="store_true", help="rerun runs that already have results")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time (default 1); on CPU each gets cores/jobs threads (OMP_NUM_THREADS), on GPUs "
        "give each job its own device with CUDA_VISIBLE_DEVICES in --gpus",
    )
    parser.add_argument("--gpus", default=None, help="comma-separated GPU ids handed out to jobs in turn")
    args = parser.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        parser.error(f"--strategies: unknown {bad}; allowed: {', '.join(STRATEGIES)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.yaml.is_file():
        parser.error(f"--yaml: no such file {args.yaml}")
    eval_interval = args.eval_interval or max(1, args.steps // 5)

    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    gpus = [g for g in (args.gpus or "").split(",") if g]
    args.out.mkdir(parents=True, exist_ok=True)
    todo = []
    for strategy, seed in [(s, seed) for s in strategies for seed in seeds]:
        run_dir = args.out / f"{strategy}-seed{seed}"
        if (run_dir / "eval_results.json").exists() and not args.rerun:
            print(f"{run_dir.name}: already done, reusing", flush=True)
            continue
        cmd = [
            sys.executable,
            str(REPO / "train.py"),
            str(args.yaml),
            f"variables.shard_dir={args.shard_dir}",
            f"algorithms.data_selection.strategy={strategy}",
            f"seed={seed}",
            f"algorithms.data_selection.seed={seed}",
            f"max_duration={args.steps}ba",
            f"eval_interval={eval_interval}ba",
            f"save_folder={run_dir}",
            "save_overwrite=true",
            f"save_interval={args.steps}ba",
            "save_num_checkpoints_to_keep=0",
            f"run_name={args.out.name}-{strategy}-seed{seed}",
            *extra,
        ]
        todo.append((run_dir, cmd))
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    running: list[tuple[Path, subprocess.Popen, float, object]] = []
    started = 0
    failed = []
    while todo or running:
        while todo and len(running) < args.jobs:
            run_dir, cmd = todo.pop(0)
            run_dir.mkdir(parents=True, exist_ok=True)
            env = dict(os.environ)
            if args.jobs > 1:
                env["OMP_NUM_THREADS"] = str(threads)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus[started % len(gpus)]
            log = open(run_dir.with_suffix(".log"), "w")
            started += 1
            print(f"[{started}] {run_dir.name}: training {args.steps} steps (log {log.name})", flush=True)
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((run_dir, proc, time.perf_counter(), log))
            if args.jobs > 1:
                _wait_until_training(run_dir, proc)
        time.sleep(1)
        for item in list(running):
            run_dir, proc, t0, log = item
            if proc.poll() is None:
                continue
            running.remove(item)
            log.close()
            if proc.returncode:
                failed.append(run_dir.name)
                print(f"  {run_dir.name} failed (exit {proc.returncode}); see {log.name}", flush=True)
            else:
                print(f"  {run_dir.name} done in {time.perf_counter() - t0:.0f}s", flush=True)
    if failed:
        print(f"failed runs: {failed}")
        return 1

    table = collect(args.out, strategies, seeds)
    md = format_markdown(table, args.steps)
    print("\n" + md)
    (args.out / "comparison.md").write_text(md + "\n")
    (args.out / "comparison.json").write_text(json.dumps(table, indent=2))
    plot_curves(args.out, strategies, seeds, args.out / "curves.png")
    print(f"\nwrote {args.out / 'comparison.md'}, comparison.json and curves.png")
    return 0


def _wait_until_training(run_dir: Path, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    """Wait until a run has built its datasets (its first step is logged) before starting another.

    Streaming registers each dataset in a machine-wide shared-memory namespace; two processes
    registering at the same instant can collide, so starts are staggered.
    """
    t0 = time.perf_counter()
    while proc.poll() is None and time.perf_counter() - t0 < timeout_s:
        if (run_dir / "mixture_steps.csv").exists():
            return
        time.sleep(1)


def collect(out: Path, strategies: list[str], seeds: list[int]) -> dict:
    """Aggregate every run's eval_results.json into mean and std per strategy."""
    table: dict = {"strategies": {}, "seeds": seeds}
    for strategy in strategies:
        per_seed = []
        for seed in seeds:
            path = out / f"{strategy}-seed{seed}" / "eval_results.json"
            if path.exists():
                per_seed.append(json.loads(path.read_text()))
        if not per_seed:
            continue
        domains = sorted(per_seed[0]["val_cross_entropy"])
        entry = {"runs": len(per_seed), "domains": {}}
        for d in domains:
            entry["domains"][d] = _mean_std([r["val_cross_entropy"].get(d, math.nan) for r in per_seed])
        entry["average"] = _mean_std([r["val_cross_entropy_mean"] for r in per_seed])
        entry["wall_time_s"] = _mean_std([r["wall_time_s"] for r in per_seed])
        entry["selection_time_s"] = _mean_std([r["selection_time_s"] for r in per_seed])
        table["strategies"][strategy] = entry
    return table


def format_markdown(table: dict, steps: int) -> str:
    """The comparison as a markdown table (mean +- std over seeds)."""
    strategies = list(table["strategies"])
    if not strategies:
        return "(no finished runs)"
    domains = list(table["strategies"][strategies[0]]["domains"])
    head = ["strategy", *domains, "average", "wall s", "selection %"]
    lines = [
        f"Validation log-perplexity (cross-entropy) after {steps} steps, mean +- std over seeds {table['seeds']}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for s in strategies:
        e = table["strategies"][s]
        cells = [s] + [_fmt(e["domains"].get(d)) for d in domains] + [_fmt(e["average"])]
        wall = e["wall_time_s"]["mean"]
        sel = e["selection_time_s"]["mean"]
        cells += [f"{wall:.0f}", f"{100 * sel / wall:.1f}" if wall > 0 else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_curves(out: Path, strategies: list[str], seeds: list[int], path: Path) -> None:
    """Average validation loss against steps, one line per strategy (mean over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strategy in strategies:
        by_step: dict[int, list[float]] = defaultdict(list)
        for seed in seeds:
            hist = out / f"{strategy}-seed{seed}" / "eval_history.csv"
            if not hist.exists():
                continue
            per_step: dict[int, list[float]] = defaultdict(list)
            with open(hist, newline="") as f:
                for row in csv.DictReader(f):
                    per_step[int(row["step"])].append(float(row["cross_entropy"]))
            for step, values in per_step.items():
                by_step[step].append(sum(values) / len(values))
        if by_step:
            steps = sorted(by_step)
            ax.plot(steps, [sum(by_step[s]) / len(by_step[s]) for s in steps], marker="o", label=strategy)
    ax.set_xlabel("step")
    ax.set_ylabel("mean per-domain validation log-perplexity")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mean_std(values: list[float]) -> dict[str, float]:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return {"mean": math.nan, "std": math.nan}
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return {"mean": mean, "std": std}


def _fmt(ms: dict[str, float] | None) -> str:
    if ms is None or not math.isfinite(ms["mean"]):
        return "-"
    return f"{ms['mean']:.4f} +- {ms['std']:.4f}"


if __name__ == "__main__":
    raise SystemExit(main())
