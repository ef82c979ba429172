"""Run several selection strategies (and seeds) on equal budgets and compare them.

Example:
    python tools/run_experiment.py --yaml yamls/testing/demo_dolma.yaml \
        --shard-dir demo_out/shards/dolma --strategies partitionsel,id,random,greats \
        --seeds 1,2,3 --steps 200 --paired-baseline random --log-selected-ids --out demo_out/experiments/demo
    # equal wall-clock instead of equal steps: 120 s of training each (evaluation excluded)
    python tools/run_experiment.py ... --budget-seconds 120 --steps 400 --paired-baseline random

Every run uses the same shards, model and kappa (`global_train_batch_size`); only
`algorithms.data_selection.strategy` and the seed change. The seed sets the model's
initialisation and the selection and validation draws; the data order stays the yaml's
`train_loader.dataset.shuffle_seed`, so every strategy chooses from the same sequence of pools
(pass `-- train_loader.dataset.shuffle_seed=N` to vary it too). Extra `key=value` arguments after
`--` are passed to every run (e.g. `-- optimizer.lr=1e-3`). Runs already finished in `--out`
are reused unless `--rerun`.

Variants: `--variant NAME=STRATEGY[,yaml.key=value...]` adds a named configuration that is run,
reported and paired like a strategy (e.g. `ps_w=partitionsel,algorithms.data_selection.weighted_loss=true`),
for one-at-a-time studies of a setting.

Budgets: `--steps N` trains every run N steps. `--budget-seconds S` gives every run S seconds of
training time instead (Composer's wall-clock account: data loading, selection and the training
step; evaluation excluded), so a slower strategy trains fewer steps; `--steps` is then the step
cap and the learning-rate schedule's horizon (default 1000000: a constant rate after warmup).
Every run evaluates at its last step.

Evaluation reads the held-out part of each domain's `val` split; the selection's validation
batches come from the other part (see docs/evaluation.md, `guide_fraction`), so no evaluated
example ever guided a selection.

Runs are queued seed-major (seed 1 of every strategy, then seed 2, ...), so an interrupted
comparison stays balanced across strategies. `--jobs N` runs N trainings at a time, each with
OMP_NUM_THREADS = cores/N (set for every N, 1 included).

Writes OUT/comparison.md, OUT/comparison.json and OUT/curves.png: per-domain validation
log-perplexity at the last evaluation (mean +- std over seeds), their average, steps, training
and wall time and the share spent selecting. With `--paired-baseline B`, OUT/paired.md and
OUT/paired.json: per seed, each strategy's final loss minus B's (average and per domain), with
the mean and a 95% t interval. OUT/selection.md and OUT/selection.json: the conflict fraction,
the induced domain mixture beside the natural one (both as shares of training examples) and,
with `--log-selected-ids`, the Jaccard overlap of each strategy's selected examples with
random's on the same pools (after checking the pools are identical).
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
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_STEP_CAP = 1_000_000


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    known = known_strategies()
    bad = [s for s in strategies if s not in known]
    if bad:
        parser.error(f"--strategies: unknown {bad}; allowed: {', '.join(known)}")
    # label -> (strategy, overrides): plain strategies, then the named variants.
    runs_of: dict[str, tuple[str, list[str]]] = {s: (s, []) for s in strategies}
    for text in args.variant:
        try:
            label, strategy, overrides = parse_variant(text)
        except ValueError as e:
            parser.error(str(e))
        if strategy not in known:
            parser.error(f"--variant {text!r}: unknown strategy {strategy!r}; allowed: {', '.join(known)}")
        if label in runs_of:
            parser.error(f"--variant {text!r}: the name {label!r} is already used")
        runs_of[label] = (strategy, overrides)
    strategies = list(runs_of)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not args.yaml.is_file():
        parser.error(f"--yaml: no such file {args.yaml}")
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.budget_seconds is not None and not args.budget_seconds > 0:
        parser.error(f"--budget-seconds must be > 0, got {args.budget_seconds}")
    if args.report_only and args.rerun:
        parser.error("--report-only and --rerun contradict each other")
    if args.steps is None and args.budget_seconds is None:
        parser.error("give --steps (equal steps) or --budget-seconds (equal training time)")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.paired_baseline is not None and args.paired_baseline not in strategies:
        parser.error(f"--paired-baseline {args.paired_baseline!r} must be one of --strategies {strategies}")
    steps = args.steps if args.steps is not None else DEFAULT_STEP_CAP
    if args.eval_interval is not None:
        eval_interval = args.eval_interval
    else:
        # Equal steps: 5 evaluations. Budget without a step cap: only the final one.
        eval_interval = max(1, steps // 5) if args.steps is not None else steps

    gpus = [g for g in (args.gpus or "").split(",") if g]
    args.out.mkdir(parents=True, exist_ok=True)
    todo = []
    for label, seed in plan_runs(strategies, seeds):
        strategy, variant_overrides = runs_of[label]
        run_dir = args.out / f"{label}-seed{seed}"
        if (run_dir / "eval_results.json").exists() and not args.rerun:
            print(f"{run_dir.name}: already done, reusing", flush=True)
            continue
        cmd = train_command(
            yaml=args.yaml,
            shard_dir=args.shard_dir,
            strategy=strategy,
            seed=seed,
            steps=steps,
            eval_interval=eval_interval,
            run_dir=run_dir,
            run_name=f"{args.out.name}-{label}-seed{seed}",
            budget_seconds=args.budget_seconds,
            log_selected_ids=args.log_selected_ids,
            extra=extra + variant_overrides,
        )
        todo.append((run_dir, cmd))
    if args.report_only:
        if todo:
            print(f"--report-only: {len(todo)} runs not finished, left out: {', '.join(d.name for d, _ in todo)}")
        todo = []
    failed = _run_queue(todo, jobs=args.jobs, gpus=gpus, budget_seconds=args.budget_seconds, steps=args.steps)
    if failed:
        print(f"failed runs: {failed}")
        return 1
    report(
        args.out,
        strategies,
        seeds,
        steps=args.steps,
        budget_seconds=args.budget_seconds,
        paired_baseline=args.paired_baseline,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--yaml", type=Path, required=True, help="base run yaml")
    parser.add_argument("--shard-dir", required=True, help="shards every run trains on (variables.shard_dir)")
    parser.add_argument(
        "--strategies", default="partitionsel,id,random,greats", help="comma-separated strategies"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="a named configuration compared like a strategy: NAME=STRATEGY[,yaml.key=value...] "
        "(repeatable), e.g. ps_w=partitionsel,algorithms.data_selection.weighted_loss=true",
    )
    parser.add_argument("--seeds", default="1,2", help="comma-separated seeds")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps of every run (with --budget-seconds: the step cap)",
    )
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=None,
        help="equal wall-clock: each run trains until it has spent this many seconds training (evaluation excluded)",
    )
    parser.add_argument(
        "--paired-baseline",
        default=None,
        help="report per-seed differences of every other strategy against this one (e.g. random), with 95%% intervals",
    )
    parser.add_argument(
        "--log-selected-ids",
        action="store_true",
        help="log the pool's and the selection's sample ids every step (selected_ids.jsonl) and report overlaps",
    )
    parser.add_argument(
        "--eval-interval", type=int, default=None, help="evaluate every N steps (default: steps/5)"
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument("--rerun", action="store_true", help="rerun runs that already have results")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: write the tables from the runs already finished in --out (the rest are listed as missing)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time (default 1); each gets cores/jobs threads (OMP_NUM_THREADS), on GPUs "
        "give each job its own device with CUDA_VISIBLE_DEVICES in --gpus",
    )
    parser.add_argument("--gpus", default=None, help="comma-separated GPU ids handed out to jobs in turn")
    return parser


def known_strategies() -> tuple[str, ...]:
    """What `algorithms.data_selection.strategy` accepts (the algorithm's names, plugins included).

    Imported here, after argument parsing, so `--help` stays free of torch and Composer.
    """
    from composer_algos.selection import strategy_names
    from composer_algos.selection_algorithm import SELECTION_STRATEGIES

    return (*SELECTION_STRATEGIES, *(n for n in strategy_names() if n not in SELECTION_STRATEGIES))


def parse_variant(text: str) -> tuple[str, str, list[str]]:
    """`NAME=STRATEGY[,key=value...]` -> (name, strategy, overrides).

    Raises:
        ValueError: a malformed variant, naming it.
    """
    if "=" not in text:
        raise ValueError(f"--variant {text!r}: expected NAME=STRATEGY[,yaml.key=value...]")
    label, rest = text.split("=", 1)
    strategy, *overrides = _split_top_level(rest)
    if not label or not strategy:
        raise ValueError(f"--variant {text!r}: expected NAME=STRATEGY[,yaml.key=value...]")
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ValueError(f"--variant {text!r}: {bad} are not key=value")
    return label, strategy, overrides


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets and braces (`a={x:1,y:2},b=3` -> two items)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "[{"
        depth -= ch in "]}"
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def plan_runs(strategies: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """(strategy, seed) in seed-major order: every strategy's seed 1 before any seed 2."""
    return [(s, seed) for seed in seeds for s in strategies]


def run_env(base: dict[str, str], *, jobs: int, cores: int, gpu: str | None = None) -> dict[str, str]:
    """The environment of one training process: cores/jobs OpenMP threads, and its GPU if any."""
    env = dict(base)
    env["OMP_NUM_THREADS"] = str(max(1, cores // jobs))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def train_command(
    *,
    yaml: Path,
    shard_dir: str,
    strategy: str,
    seed: int,
    steps: int,
    eval_interval: int,
    run_dir: Path,
    run_name: str,
    budget_seconds: float | None = None,
    log_selected_ids: bool = False,
    extra: list[str] | None = None,
) -> list[str]:
    """The `train.py` command line of one run."""
    cmd = [
        sys.executable,
        str(REPO / "train.py"),
        str(yaml),
        f"variables.shard_dir={shard_dir}",
        f"algorithms.data_selection.strategy={strategy}",
        f"seed={seed}",
        f"algorithms.data_selection.seed={seed}",
        f"max_duration={steps}ba",
        f"eval_interval={eval_interval}ba",
        f"save_folder={run_dir}",
        "save_overwrite=true",
        f"save_interval={steps}ba",
        "save_num_checkpoints_to_keep=0",
        f"run_name={run_name}",
        # Always present: it evaluates at the last step, before eval_results.json is written.
        f"callbacks.train_budget.budget_seconds={'null' if budget_seconds is None else budget_seconds}",
    ]
    if log_selected_ids:
        cmd.append("callbacks.mixture_monitor.log_selected_ids=true")
    return cmd + list(extra or [])


def report(
    out: Path,
    strategies: list[str],
    seeds: list[int],
    *,
    steps: int | None,
    budget_seconds: float | None = None,
    paired_baseline: str | None = None,
    reference: str = "random",
) -> dict[str, Any]:
    """Write (and print) the comparison, the paired comparison and the selection report."""
    from composer_algos.experiment_stats import format_paired_markdown, paired_comparison

    table = collect(out, strategies, seeds)
    md = format_markdown(table, steps, budget_seconds=budget_seconds)
    print("\n" + md)
    written = [out / "comparison.md", out / "comparison.json"]
    if paired_baseline is not None:
        paired = paired_comparison(table["per_seed"], baseline=paired_baseline)
        paired_md = format_paired_markdown(paired)
        print("\n" + paired_md)
        (out / "paired.md").write_text(paired_md + "\n")
        (out / "paired.json").write_text(json.dumps(paired, indent=2))
        table["paired"] = paired
        written += [out / "paired.md", out / "paired.json"]
    selection = selection_report(out, strategies, seeds, reference=reference)
    selection_md = format_selection_markdown(selection)
    print("\n" + selection_md)
    (out / "selection.md").write_text(selection_md + "\n")
    (out / "selection.json").write_text(json.dumps(selection, indent=2))
    written += [out / "selection.md", out / "selection.json"]
    (out / "comparison.md").write_text(md + "\n")
    (out / "comparison.json").write_text(json.dumps(_jsonable(table), indent=2))
    plot_curves(out, strategies, seeds, out / "curves.png")
    written.append(out / "curves.png")
    print("\nwrote " + ", ".join(str(p) for p in written))
    return table


def collect(out: Path, strategies: list[str], seeds: list[int]) -> dict:
    """Aggregate every run's eval_results.json (and train_budget.json) into mean and std per strategy.

    Also keeps each run's final losses under `per_seed[strategy][seed]` for the paired comparison.
    """
    table: dict = {"strategies": {}, "seeds": seeds, "per_seed": {}}
    for strategy in strategies:
        per_seed = {}
        for seed in seeds:
            run_dir = out / f"{strategy}-seed{seed}"
            path = run_dir / "eval_results.json"
            if path.exists():
                r = json.loads(path.read_text())
                budget = run_dir / "train_budget.json"
                r["train_time_s"] = (
                    json.loads(budget.read_text())["train_time_s"] if budget.exists() else math.nan
                )
                per_seed[seed] = r
        if not per_seed:
            continue
        runs = list(per_seed.values())
        domains = sorted(runs[0]["val_cross_entropy"])
        entry = {"runs": len(runs), "domains": {}}
        for d in domains:
            entry["domains"][d] = _mean_std([r["val_cross_entropy"].get(d, math.nan) for r in runs])
        entry["average"] = _mean_std([r["val_cross_entropy_mean"] for r in runs])
        entry["steps"] = _mean_std([r.get("steps", math.nan) for r in runs])
        entry["train_time_s"] = _mean_std([r["train_time_s"] for r in runs])
        entry["wall_time_s"] = _mean_std([r["wall_time_s"] for r in runs])
        entry["selection_time_s"] = _mean_std([r["selection_time_s"] for r in runs])
        table["strategies"][strategy] = entry
        table["per_seed"][strategy] = {
            seed: {"average": r["val_cross_entropy_mean"], "domains": dict(r["val_cross_entropy"])}
            for seed, r in per_seed.items()
            if r["val_cross_entropy_mean"] is not None
        }
    return table


def format_markdown(table: dict, steps: int | None, *, budget_seconds: float | None = None) -> str:
    """The comparison as a markdown table (mean +- std over seeds)."""
    strategies = list(table["strategies"])
    if not strategies:
        return "(no finished runs)"
    domains = list(table["strategies"][strategies[0]]["domains"])
    head = ["strategy", *domains, "average", "steps", "train s", "wall s", "selection %"]
    if budget_seconds is not None:
        budget = f"an equal training-time budget of {budget_seconds:g} s each (evaluation excluded)"
    else:
        budget = f"{steps} steps"
    lines = [
        f"Held-out validation log-perplexity (cross-entropy) after {budget}, mean +- std over seeds {table['seeds']}",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for s in strategies:
        e = table["strategies"][s]
        cells = [s] + [_fmt(e["domains"].get(d)) for d in domains] + [_fmt(e["average"])]
        wall = e["wall_time_s"]["mean"]
        sel = e["selection_time_s"]["mean"]
        train_s = e["train_time_s"]["mean"]
        cells += [
            f"{e['steps']['mean']:.0f}" if math.isfinite(e["steps"]["mean"]) else "-",
            f"{train_s:.0f}" if math.isfinite(train_s) else "-",
            f"{wall:.0f}",
            f"{100 * sel / wall:.1f}" if wall > 0 else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def selection_report(
    out: Path, strategies: list[str], seeds: list[int], *, reference: str = "random"
) -> dict:
    """Per strategy: conflict fraction, induced vs natural mixture and, when logged, overlap with `reference`.

    The induced mixture (`mixture.json` weights: the mean over steps of each domain's share of
    the trained examples) and the natural one (`mixture.json` natural: each domain's share of the
    training split's examples) are both in examples. Overlaps use `selected_ids.jsonl`: for each
    seed the strategy's pools are first checked against the reference's at every step.
    """
    from composer_algos.experiment_stats import read_selected_ids, selection_overlap
    from composer_algos.mixture_io import read_mixture_json

    result: dict[str, Any] = {
        "reference": reference,
        "units": "shares of training examples",
        "strategies": {},
    }
    ref_ids = {}
    for seed in seeds:
        path = out / f"{reference}-seed{seed}" / "selected_ids.jsonl"
        if path.exists():
            ref_ids[seed] = read_selected_ids(path)
    natural: dict[str, float] | None = None
    for strategy in strategies:
        conflicts, mixtures, overlaps = [], [], {}
        for seed in seeds:
            run_dir = out / f"{strategy}-seed{seed}"
            conflicts += _column_mean(run_dir / "selection_log.csv", "conflict_fraction")
            if (run_dir / "mixture.json").exists():
                mix = read_mixture_json(run_dir / "mixture.json")
                mixtures.append(dict(mix.weights))
                natural = natural or (dict(mix.natural) if mix.natural else None)
            ids_path = run_dir / "selected_ids.jsonl"
            if strategy != reference and seed in ref_ids and ids_path.exists():
                overlaps[seed] = selection_overlap(read_selected_ids(ids_path), ref_ids[seed])
        if not (conflicts or mixtures or overlaps):
            continue
        names = sorted(set().union(*mixtures)) if mixtures else []
        induced = {n: sum(m.get(n, 0.0) for m in mixtures) / len(mixtures) for n in names}
        jac = [o["mean_jaccard"] for o in overlaps.values() if math.isfinite(o["mean_jaccard"])]
        result["strategies"][strategy] = {
            "conflict_fraction": sum(conflicts) / len(conflicts) if conflicts else None,
            "induced_mixture": induced or None,
            "overlap": {str(k): v for k, v in overlaps.items()},
            "pools_identical": all(o["pools_identical"] for o in overlaps.values()) if overlaps else None,
            "mean_jaccard": sum(jac) / len(jac) if jac else None,
        }
    result["natural"] = natural
    if natural is not None:
        for entry in result["strategies"].values():
            mix = entry["induced_mixture"]
            entry["tv_vs_natural"] = (
                0.5 * sum(abs(mix.get(n, 0.0) - natural.get(n, 0.0)) for n in set(mix) | set(natural))
                if mix
                else None
            )
    return result


def format_selection_markdown(sel: dict) -> str:
    """The selection report as markdown: overlap and conflicts, then the mixtures."""
    ref = sel["reference"]
    if not sel["strategies"]:
        return "(no selection logs)"
    lines = [
        f"Selection: Jaccard overlap of the selected examples with {ref}'s on the same pools (mean over steps "
        "and seeds), mean conflict fraction, and total variation of the induced mixture from the natural one",
        "",
        f"| strategy | pools identical to {ref}'s | Jaccard vs {ref} | conflict fraction | TV vs natural |",
        "|---|---|---:|---:|---:|",
    ]
    for name, e in sel["strategies"].items():
        if name == ref:
            pools = "(reference)"
        elif e["pools_identical"] is None:
            pools = "- (no ids logged)"
        elif e["pools_identical"]:
            pools = f"yes (seeds {', '.join(e['overlap'])})"
        else:
            bad = {
                s: o["first_pool_mismatch_step"] for s, o in e["overlap"].items() if not o["pools_identical"]
            }
            pools = "NO: first differing step per seed " + ", ".join(f"{s}: {v}" for s, v in bad.items())
        cells = [
            name,
            pools,
            "-" if e["mean_jaccard"] is None else f"{e['mean_jaccard']:.4f}",
            "-" if e["conflict_fraction"] is None else f"{e['conflict_fraction']:.4f}",
            "-" if e.get("tv_vs_natural") is None else f"{e['tv_vs_natural']:.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    natural = sel.get("natural")
    mixes = {n: e["induced_mixture"] for n, e in sel["strategies"].items() if e["induced_mixture"]}
    if mixes:
        domains = sorted(set().union(*mixes.values(), natural or {}))
        lines += [
            "",
            f"Induced domain mixture against the natural one ({sel['units']}; mean over steps and seeds)",
            "",
            "| mixture | " + " | ".join(domains) + " |",
            "|---|" + "---:|" * len(domains),
        ]
        if natural:
            lines.append("| natural | " + " | ".join(f"{natural.get(d, 0.0):.4f}" for d in domains) + " |")
        for name, mix in mixes.items():
            lines.append(f"| {name} | " + " | ".join(f"{mix.get(d, 0.0):.4f}" for d in domains) + " |")
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
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run_queue(
    todo: list[tuple[Path, list[str]]],
    *,
    jobs: int,
    gpus: list[str],
    budget_seconds: float | None,
    steps: int | None,
) -> list[str]:
    """Run the queued trainings, `jobs` at a time, in order; returns the names of the failed runs."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    what = f"{budget_seconds:g} s of training" if budget_seconds is not None else f"{steps} steps"
    running: list[tuple[Path, subprocess.Popen, float, Any]] = []
    started = 0
    failed = []
    while todo or running:
        while todo and len(running) < jobs:
            run_dir, cmd = todo.pop(0)
            run_dir.mkdir(parents=True, exist_ok=True)
            env = run_env(
                dict(os.environ), jobs=jobs, cores=cores, gpu=gpus[started % len(gpus)] if gpus else None
            )
            log = open(run_dir.with_suffix(".log"), "w")
            started += 1
            print(f"[{started}] {run_dir.name}: training {what} (log {log.name})", flush=True)
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
            running.append((run_dir, proc, time.perf_counter(), log))
            if jobs > 1:
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
    return failed


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


def _column_mean(path: Path, column: str) -> list[float]:
    """The mean of a CSV column's non-empty values, as a one-element list (empty when there are none)."""
    if not path.exists():
        return []
    with open(path, newline="") as f:
        values = [float(r[column]) for r in csv.DictReader(f) if r.get(column)]
    return [sum(values) / len(values)] if values else []


def _jsonable(table: dict) -> dict:
    """JSON keys must be strings: the per-seed map is keyed by int seeds."""
    out = dict(table)
    out["per_seed"] = {s: {str(k): v for k, v in runs.items()} for s, runs in table["per_seed"].items()}
    return out


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
