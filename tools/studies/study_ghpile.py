"""The ghpile pretraining setup and the diagnosis of issue 22 (docs/results/study_ghpile.md).

Parts (each reuses what an earlier, interrupted invocation finished):
  setup      ../shared/data/ghpile -> OUT/docs (train / guide / eval documents, tools/split_documents.py)
             -> OUT/shards/s512, s1024 (train + guide documents) and s512_eval, s1024_eval (evaluation
             documents), tokenised with assets/ghpile_tokenizer
  timing     training steps of random, PartitionSel and PartitionSel on 128-token windows at S = 512
             and S = 1024 with the same tokens a step (16 x 512 = 8 x 1024), one thread each, one
             run at a time: the measured cost that picks S
  base       a from-scratch run (random within capacities) of --steps steps, checkpoints at --early
             and --later
  lookahead  tools/studies/lookahead.py at both checkpoints: full-length scoring against windows (start /
             random, t = 64 / 128), guides of 4 / 16 / 64 rows, exact-gradient oracles, and the
             guiding gradient's cosine with the held-out one; with --r4, the same at pools of 64
  diagnose   tools/run_experiment.py at equal steps, paired against random by seed: PartitionSel
             full-length, with windows, with larger guides and at r = 4
  fidelity   tools/studies/knob_fidelity.py --set windows on a real PartitionSel run: Jaccard and score
             rank correlation of windowed selections with the full-length one on the same pools
  study      the study proper (tools/run_experiment.py): every arm at equal compute (the cost of
             --budget-steps random steps; step costs calibrated first) and, with --profile full, at
             equal steps (--budget-steps each), 3 seeds, paired against random by seed
  more       MORE_ARMS (random, random_stratified, the 64-token window) at equal compute for --more-seeds
             seeds (default 1-7) with the study's calibrated step costs (OUT/study_s512/equal_compute_more;
             the study's finished seeds are linked, not retrained)
  report     the study's tables, verdicts and the cost-vs-loss frontier (OUT/study_s512/study.md,
             OUT/study_s512/frontier.png; docs/results/study_ghpile.md quotes them)

Profiles of `study` (--profile):
  quick  equal compute only; random, PartitionSel on whole rows, on 64- and 128-token windows, and on
         128-token windows at r = 4: the main table (32 minutes measured on 2 idle cores)
  full   equal compute and equal steps; all STUDY_ARMS (see docs/results/study_ghpile.md for its
         measured time)

Example:
    python tools/studies/study_ghpile.py --out runs/ghpile --parts setup,timing
    python tools/studies/study_ghpile.py --out runs/ghpile --parts base,lookahead --pools 16
    python tools/studies/study_ghpile.py --out runs/ghpile --parts diagnose --seeds 1,2,3
    python tools/studies/study_ghpile.py --out runs/ghpile --parts study,report --profile quick   # the main table
    python tools/studies/study_ghpile.py --out runs/ghpile --quick        # a few steps of each part (smoke test)

Every training process runs with one thread (OMP_NUM_THREADS=1); `--jobs` (default 2) bounds how
many run at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data" / "ghpile"
YAML = REPO / "yamls" / "study" / "ghpile.yaml"
TOKENIZER = REPO / "assets" / "ghpile_tokenizer"
PARTS = ("setup", "timing", "base", "lookahead", "diagnose", "fidelity", "study", "more", "report")
SEL = "algorithms.data_selection"
# Documents held out per domain: a guide part (selection's validation batches) and an evaluation part.
GUIDE_FRACTION, EVAL_FRACTION = 0.06, 0.06
SEQ_LENS = (512, 1024)
TIMING_TOKENS = 8192  # tokens trained a step in the timing runs (kappa = TIMING_TOKENS / S)
TIMING_RUNS = {
    "random": ["random"],
    "partitionsel": ["partitionsel"],
    "ps_window128": ["partitionsel", f"{SEL}.features.score_window=128"],
}
# Lookahead arms (tools/studies/lookahead.py): the yaml's PartitionSel scored on whole rows, on windows, with a
# 16-row guide (the arms take the first guide_size rows of the 16-row guide set), and exact-gradient
# oracles. Every subset's one-step effect costs a forward of the evaluation and guide rows, so the
# arms are what a loaded 2-core machine allows (the other window settings: the `fidelity` part).
ARMS = [
    "full=partitionsel,guide_size=4",
    "w64_start=partitionsel,features.score_window=64,features.score_window_position=start,guide_size=4",
    "w128_random=partitionsel,features.score_window=128,features.score_window_position=random,guide_size=4",
    "full_g16=partitionsel,guide_size=16",
    "oracle_g4=oracle,guide_size=4",
    "oracle_g16=oracle,guide_size=16",
    "oracle_eval=oracle_eval",
    # top ||g_i|| (Adam-normalised): what the diagonal bonus (eta/2) ||g_i||^2 of PartitionSel's mu picks alone
    "gradnorm=gradnorm",
]
R4_ARMS = [ARMS[0], ARMS[2], ARMS[3], "oracle_g4=oracle,guide_size=4", "oracle_eval=oracle_eval"]
# The guide-vs-evaluation gradient cosine per guide size, over independent draws (lookahead with no
# pools computes only the cosines): is a 4-row guide's gradient the held-out gradient's direction?
COSINE_SIZES = (4, 16, 64)
# Equal-steps comparison, paired against random: one change at a time from the yaml's PartitionSel.
DIAGNOSE_VARIANTS = {
    "ps_full": [],
    "ps_w64_start": [f"{SEL}.features.score_window=64"],
    "ps_w128_random": [f"{SEL}.features.score_window=128", f"{SEL}.features.score_window_position=random"],
    "ps_g16": [f"{SEL}.validation.batch_size=16"],
    "ps_g64": [f"{SEL}.validation.batch_size=64"],
    "ps_r4": [f"{SEL}.oversampling=4"],
}
# The study's arms (issue 22.5): label -> (strategy, overrides). Windows sit at the row's start: on
# the fidelity run they kept more of the full-length ranking than random positions did (Spearman
# 0.62 against 0.42 at t = 128), at the same cost. The larger pools score 128-token windows, the
# window that kept the most of the full-length selection (fidelity) at a cost within 1% of t = 64's
# at r = 2 (calibration): chosen before the study ran, not from its outcome.
STUDY_ARMS: dict[str, tuple[str, list[str]]] = {
    "random": ("random", []),
    "random_stratified": ("random_stratified", []),
    "partitionsel": ("partitionsel", []),
    "ps_w64": ("partitionsel", [f"{SEL}.features.score_window=64"]),
    "ps_w128": ("partitionsel", [f"{SEL}.features.score_window=128"]),
    "ps_w128_r4": ("partitionsel", [f"{SEL}.features.score_window=128", f"{SEL}.oversampling=4"]),
    "ps_w128_r8": ("partitionsel", [f"{SEL}.features.score_window=128", f"{SEL}.oversampling=8"]),
    "id": ("id", []),
    "colm": ("colm", []),
    "gradnorm": ("gradnorm", []),
}
QUICK_ARMS = ("random", "partitionsel", "ps_w64", "ps_w128", "ps_w128_r4")
# `more`: the equal-compute arms whose 3-seed intervals left the headline question open (the best
# window against random, and against random within the same capacities), run at more seeds with the
# step costs of the study's calibration, so every seed trains the same steps as the first three.
MORE_ARMS = ("random", "random_stratified", "ps_w64")
# Every run's warm-up is a tenth of its own steps (the yaml's 20 of 200), so a run the compute budget
# shortens still warms up and decays over its own steps. The guide is 16 rows a step, not the yaml's
# 4: a 4-row guide's gradient had a cosine of 0.17 with the held-out gradient against 0.41 for 16
# (the diagnosis in docs/results/study_ghpile.md); windows score the guide rows on windows too.
STUDY_EVAL_INTERVAL = 1_000_000
STUDY_OVERRIDES = ["scheduler.t_warmup=0.1dur", f"{SEL}.validation.batch_size=16"]


def main(argv: list[str] | None = None) -> int:
    p = _build_parser()
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}; allowed: {', '.join(PARTS)}")
    variants = [x for x in (args.variants or ",".join(DIAGNOSE_VARIANTS)).split(",") if x]
    unknown = [x for x in variants if x not in DIAGNOSE_VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; allowed: {', '.join(DIAGNOSE_VARIANTS)}")
    if not DATA.is_dir():
        p.error(f"the ghpile corpus is not at {DATA} (it ships in ../shared/data/ghpile)")
    if args.quick:
        args.steps, args.early, args.later, args.pools, args.eval_size = 6, 2, 4, 1, 8
        args.timing_steps, args.fidelity_steps, args.seeds, args.budget_steps = 3, 3, "1", 4
    out = args.out.resolve()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")

    if "setup" in parts:
        setup(out, env)
    shards = out / "shards" / f"s{args.seq_len}"
    common = [f"variables.shard_dir={shards}", f"variables.max_seq_len={args.seq_len}"]
    if "timing" in parts:
        timing(out, env, steps=args.timing_steps)
    base = out / f"base_s{args.seq_len}"
    if "base" in parts:
        _train_base(base, common, env, args)
    if "lookahead" in parts:
        _lookahead(out, base, common, env, args)
    if "diagnose" in parts:
        diagnose(
            out / f"diagnose_s{args.seq_len}", env, shards=shards, seq_len=args.seq_len, variants=variants,
            seeds=[int(x) for x in args.seeds.split(",") if x], steps=args.steps, jobs=args.jobs,
        )
    if "fidelity" in parts:
        dest = out / f"fidelity_s{args.seq_len}"
        if not (dest / "knob_fidelity.json").exists():
            cmd = [
                sys.executable, "tools/studies/knob_fidelity.py", "--yaml", str(YAML), "--shards", str(shards),
                "--set", "windows", "--steps", str(args.fidelity_steps), "--out", str(dest),
                "--override", f"variables.max_seq_len={args.seq_len}",
            ]
            _run(cmd, env)
    study_dir = out / f"study_s{args.seq_len}"
    if "study" in parts:
        study(
            study_dir, env, shards=shards, seq_len=args.seq_len, profile=args.profile, seeds=args.seeds,
            budget_steps=args.budget_steps, jobs=args.jobs, quick=args.quick,
        )
    if "more" in parts:
        cmd = more_seeds_command(
            study_dir, shards=shards, seq_len=args.seq_len, seeds=args.more_seeds, jobs=args.jobs,
            budget_steps=args.budget_steps,
        )
        _run(cmd, env)
    if "report" in parts:
        print(study_report(study_dir))
    return 0


def _build_parser() -> argparse.ArgumentParser:
    """The study's command line: its parts, S, seeds, sizes of each part, jobs and the study's profile."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "ghpile")
    p.add_argument("--parts", default="setup,timing", help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--seq-len", type=int, default=512, choices=SEQ_LENS, help="S of every part after timing")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--steps", type=int, default=200, help="steps of the base run and each diagnosis run (default 200)")
    p.add_argument("--early", type=int, default=50, help="the early lookahead checkpoint (default 50)")
    p.add_argument("--later", type=int, default=150, help="the later lookahead checkpoint (default 150)")
    p.add_argument("--pools", type=int, default=8, help="lookahead pools per checkpoint (default 8)")
    p.add_argument("--cosine-draws", type=int, default=8, help="lookahead: guide draws for the cosines (default 8)")
    p.add_argument(
        "--cosine-eval-size", type=int, default=100_000,
        help="lookahead: evaluation rows of the cosines' held-out gradient (default: all of them)",
    )
    p.add_argument("--eval-size", type=int, default=64, help="lookahead held-out rows (default 64)")
    p.add_argument("--r4", action="store_true", help="lookahead: also pools of 64 (r = 4) at each checkpoint")
    p.add_argument("--timing-steps", type=int, default=12, help="steps of each timing run (default 12; the first is left out)")
    p.add_argument("--variants", default=None, help=f"diagnose: subset of {','.join(DIAGNOSE_VARIANTS)}")
    p.add_argument("--fidelity-steps", type=int, default=50, help="steps of the fidelity run (default 50)")
    p.add_argument("--jobs", type=int, default=2, help="diagnose, study: training processes at once (default 2)")
    p.add_argument("--profile", choices=("quick", "full"), default="quick", help="study: quick (the main table) or full")
    p.add_argument(
        "--budget-steps", type=int, default=80,
        help="study: the equal-compute budget, the cost of this many random steps, and the equal-steps length (default 80)",
    )
    p.add_argument("--more-seeds", default="1,2,3,4,5,6,7", help="more: the seeds of MORE_ARMS (default 1-7)")
    p.add_argument("--quick", action="store_true", help="tiny sizes everywhere (a smoke test of the pipeline)")
    return p


def _train_base(base: Path, common: list[str], env: dict[str, str], args: argparse.Namespace) -> None:
    """The base part: random within capacities, checkpoints at the lookahead steps (kept when finished)."""
    last = base / f"ep0-ba{args.steps}-rank0.pt"
    if not last.exists():
        _run(
            _train(
                common
                + [
                    f"{SEL}.strategy=random_stratified",
                    f"save_folder={base}",
                    f"save_interval={_gcd(args.early, args.later, args.steps)}ba",
                    f"max_duration={args.steps}ba",
                    f"eval_interval={args.steps}ba",
                    "save_overwrite=true",
                    "run_name=ghpile-base",
                ]
            ),
            env,
        )


def _lookahead(out: Path, base: Path, common: list[str], env: dict[str, str], args: argparse.Namespace) -> None:
    """The lookahead part: each arm's one-step check at the early and later checkpoint, then the guide cosines."""
    runs = [("", 32, ARMS)] + ([("_r4", 64, R4_ARMS)] if args.r4 else [])
    for step in (args.early, args.later):
        for suffix, pool, arms in runs:
            dest = out / "lookahead" / f"ba{step}{suffix}"
            if (dest / "summary.json").exists():
                continue
            cmd = [
                sys.executable, "tools/studies/lookahead.py", "--yaml", str(YAML),
                "--checkpoint", str(base / f"ep0-ba{step}-rank0.pt"),
                "--pools", str(args.pools), "--pool-size", str(pool), "--kappa", "16",
                "--n-random", "6", "--eval-size", str(args.eval_size), "--guide-size", "16",
                "--step-kinds", "opt", "--out", str(dest),
            ]
            for arm in arms:
                cmd += ["--arm", arm]
            _run(cmd + common, env)
        cosines(
            out / "lookahead" / f"ba{step}_cosine", env, checkpoint=base / f"ep0-ba{step}-rank0.pt",
            draws=args.cosine_draws, eval_size=args.cosine_eval_size, common=common,
        )


def _experiment_command(arms: dict[str, tuple[str, list[str]]], *, shards: Path, seeds: str, jobs: int) -> list[str]:
    """run_experiment's command line for `arms` (label -> (strategy, overrides)), paired against random."""
    plain = [label for label, (strategy, extra) in arms.items() if not extra and label == strategy]
    cmd = [
        sys.executable, "tools/run_experiment.py", "--yaml", str(YAML), "--shard-dir", str(shards),
        "--strategies", ",".join(plain), "--seeds", seeds, "--paired-baseline", "random", "--jobs", str(jobs),
        # The last step only (train_budget always evaluates there): an evaluation of the held-out
        # documents costs about 16 random steps, and run_experiment's default is 5 of them a run.
        "--eval-interval", str(STUDY_EVAL_INTERVAL),
    ]
    for label, (strategy, extra) in arms.items():
        if label not in plain:
            cmd += ["--variant", ",".join([f"{label}={strategy}", *extra])]
    return cmd


def study_commands(
    dest: Path, *, shards: Path, seq_len: int, profile: str, seeds: str, budget_steps: int, jobs: int, quick: bool = False
) -> list[list[str]]:
    """The tools/run_experiment.py commands of the study: equal compute, then (full) equal steps."""
    arms = STUDY_ARMS if profile == "full" else {k: STUDY_ARMS[k] for k in QUICK_ARMS}
    base = _experiment_command(arms, shards=shards, seeds=seeds, jobs=jobs)
    tail = ["--", f"variables.max_seq_len={seq_len}", *STUDY_OVERRIDES]
    # The calibration: run_experiment's defaults (rounds of 10 timed steps after 2 until every arm's cost
    # is within 1% of its bootstrap spread against random's, at most 8 rounds).
    calibration = ["--calibration-steps", "2", "--calibration-warmup", "1", "--calibration-rounds", "2"] if quick else []
    cmds = [
        base + ["--compute-budget", f"random={budget_steps}", "--cost-clock", "cpu", *calibration,
                "--out", str(dest / "equal_compute"), *tail]
    ]
    if profile == "full":  # random's equal-compute runs are its equal-steps runs: reused, not trained twice
        cmds.append(base + ["--steps", str(budget_steps), "--reuse-from", str(dest / "equal_compute"),
                            "--out", str(dest / "equal_steps"), *tail])
    return cmds


def study(
    dest: Path, env: dict[str, str], *, shards: Path, seq_len: int, profile: str, seeds: str, budget_steps: int,
    jobs: int, quick: bool,
) -> None:
    """Run the study's experiments one after the other (each reuses the runs it finished before)."""
    import time

    t0 = time.perf_counter()
    for cmd in study_commands(
        dest, shards=shards, seq_len=seq_len, profile=profile, seeds=seeds, budget_steps=budget_steps, jobs=jobs,
        quick=quick,
    ):
        _run(cmd, env)
    print(f"study ({profile}) took {time.perf_counter() - t0:.0f} s of wall time in this invocation", flush=True)


def study_calibration(dest: Path) -> Path | None:
    """The study's calibration file when it holds this version's samples (run_experiment's format 2), else None."""
    path = dest / "equal_compute" / "calibration.json"
    return path if path.exists() and json.loads(path.read_text()).get("format") == 2 else None


def more_seeds_command(
    dest: Path, *, shards: Path, seq_len: int, seeds: str, jobs: int, budget_steps: int = 80
) -> list[str]:
    """run_experiment at equal compute for MORE_ARMS, planned with the study's calibration when it has one.

    The study's calibration file (`study_calibration`) holds the measured steps of every
    configuration, so the added seeds train the steps the study's seeds did (and the study's runs are
    reused, not retrained: `--reuse-from`); without one (a fresh directory, or a study calibrated by an older
    version) run_experiment calibrates MORE_ARMS itself, in DEST/equal_compute_more.
    """
    calibration = study_calibration(dest)
    cmd = _experiment_command({label: STUDY_ARMS[label] for label in MORE_ARMS}, shards=shards, seeds=seeds, jobs=jobs)
    return cmd + [
        "--compute-budget", f"random={budget_steps}", "--cost-clock", "cpu",
        *(["--calibration", str(calibration)] if calibration is not None else []),
        # The study's finished seeds of these arms, where they trained the steps planned here.
        "--reuse-from", str(dest / "equal_compute"),
        "--out", str(dest / "equal_compute_more"), "--", f"variables.max_seq_len={seq_len}", *STUDY_OVERRIDES,
    ]


def study_report(dest: Path) -> str:
    """OUT/study.md (the paired tables and verdicts of each experiment) and OUT/frontier.png."""
    lines = [f"# ghpile study tables ({dest})", ""]
    points = []
    for name, title in (
        ("equal_compute", "Equal compute"), ("equal_compute_more", "Equal compute, more seeds (MORE_ARMS)"),
        ("equal_steps", "Equal steps"),
    ):
        cmp_path, paired_path = dest / name / "comparison.json", dest / name / "paired.json"
        if not cmp_path.exists():
            continue
        lines += [f"## {title}", ""]
        comparison = json.loads(cmp_path.read_text())
        strategies = comparison["strategies"]
        plan = json.loads((dest / name / "plan.json").read_text()) if (dest / name / "plan.json").exists() else None
        lines += [
            "| arm | steps | train CPU s / step | avg loss (mean +- std) | FLOPs (mean) | arm - random (mean [95% CI], n) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        paired = json.loads(paired_path.read_text()) if paired_path.exists() else {}
        lines += _arm_rows(name, strategies, paired, plan, points)
        lines.append("")
        calibration = (plan or {}).get("calibration") or {}
        if calibration:
            lines += [
                f"Calibration: {calibration['rounds']} interleaved rounds, timed steps "
                + ", ".join(f"{k} {v}" for k, v in calibration["timed_steps"].items())
                + f"; the largest spread of an arm's cost against random's {100 * calibration['max_spread']:.2f}% "
                "(bootstrap; arms of random's work have none and train random's steps).",
                "",
            ]
        if (dest / name / "sensitivity.md").exists():
            lines += [(dest / name / "sensitivity.md").read_text().strip(), ""]
        # PartitionSel's capacities stratify its picks by domain; random_stratified is random with
        # the same stratification, so the difference from it is what the guided choice adds.
        if "random_stratified" in comparison.get("per_seed", {}):
            sys.path.insert(0, str(REPO))
            from composer_algos.analysis.experiment_stats import paired_comparison

            per_seed = {k: {int(s): v for s, v in runs.items()} for k, runs in comparison["per_seed"].items()}
            strat = paired_comparison(per_seed, baseline="random_stratified")["strategies"]
            cells = [
                f"{label} {e['average']['mean']:+.4f} [{e['average']['ci_low']:+.4f}, {e['average']['ci_high']:+.4f}]"
                for label, e in strat.items()
                if STUDY_ARMS.get(label, ("",))[0] == "partitionsel" and e["average"]["n"] >= 2
            ]
            if cells:
                lines += ["Against random_stratified (random within the same capacities), average: " + "; ".join(cells) + ".", ""]
        lines += _per_domain_table(paired)
    frontier = _plot_study_frontier(points, dest / "frontier.png")
    if frontier is not None:
        lines += [f"![cost against loss]({frontier.name})", ""]
    text = "\n".join(lines)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "study.md").write_text(text + "\n")
    return text


def _arm_rows(
    name: str, strategies: dict[str, Any], paired: dict[str, Any], plan: dict[str, Any] | None, points: list
) -> list[str]:
    """One experiment's table rows, an arm a row; adds each arm with FLOPs and a finite loss to `points`."""
    import math

    lines = []
    for label, entry in strategies.items():
        avg = entry.get("average", {})
        diff = paired.get("strategies", {}).get(label, {}).get("average", {}) if label != "random" else {}
        steps = plan["steps"].get(label) if plan else entry.get("steps", {}).get("mean")
        if isinstance(steps, float) and steps.is_integer():
            steps = int(steps)  # a mean over seeds of equal step counts
        cost = plan["step_costs_s"].get(label) if plan else None
        spread = (plan or {}).get("spread", {}).get(label)
        flops = (entry.get("flops") or {}).get("mean")
        d = (
            f"{diff['mean']:+.4f} [{diff['ci_low']:+.4f}, {diff['ci_high']:+.4f}], {diff['n']}"
            if diff.get("mean") is not None and diff.get("ci_low") is not None
            else "-"
        )
        lines.append(
            f"| {label} | {steps if steps is not None else '-'} | "
            f"{f'{cost:.3f}' if cost else '-'}{f' +- {100 * spread:.2f}%' if spread else ''} | "
            f"{avg.get('mean', float('nan')):.4f} +- {avg.get('std', float('nan')):.4f} | "
            f"{f'{flops:.3g}' if flops else '-'} | {d} |"
        )
        if flops and avg.get("mean") is not None and math.isfinite(avg["mean"]):
            points.append((name, label, float(flops), float(avg["mean"])))
    return lines


def _per_domain_table(paired: dict[str, Any]) -> list[str]:
    """Each arm's paired difference from random per domain (empty without per-domain results)."""
    lines: list[str] = []
    domains = sorted({d for v in paired.get("strategies", {}).values() for d in v.get("domains", {})})
    if domains:
        lines += [
            "Per domain, arm - random (mean [95% CI] over paired seeds):",
            "",
            "| arm | " + " | ".join(domains) + " |",
            "|---|" + "---:|" * len(domains),
        ]
        for label, v in paired["strategies"].items():
            cells = []
            for d in domains:
                e = v.get("domains", {}).get(d, {})
                ok = e.get("ci_low") is not None and e.get("mean") is not None
                cells.append(f"{e['mean']:+.3f} [{e['ci_low']:+.3f}, {e['ci_high']:+.3f}]" if ok else "-")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _plot_study_frontier(points: list[tuple[str, str, float, float]], path: Path) -> Path | None:
    """Final average held-out loss against estimated FLOPs, one marker per experiment."""
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name, marker in (("equal_compute", "o"), ("equal_steps", "s")):
        sub = [p for p in points if p[0] == name]
        if not sub:
            continue
        ax.scatter([p[2] for p in sub], [p[3] for p in sub], marker=marker, label=name.replace("_", " "))
        for _, label, x, y in sub:
            ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("estimated FLOPs per run (training + selection's scoring; compute_plan.py)")
    ax.set_ylabel("final average held-out log-perplexity")
    ax.set_title("ghpile (S = 512, small Llama from scratch): cost against loss, mean over seeds")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def cosines(
    dest: Path, env: dict[str, str], *, checkpoint: Path, draws: int, eval_size: int, common: list[str]
) -> None:
    """Guide-vs-evaluation gradient cosines for COSINE_SIZES over `draws` seeds; writes DEST/cosine.md."""
    for seed in range(draws):
        sub = dest / f"seed{seed}"
        if (sub / "summary.json").exists():
            continue
        cmd = [
            sys.executable, "tools/studies/lookahead.py", "--yaml", str(YAML), "--checkpoint", str(checkpoint),
            "--pools", "0", "--eval-size", str(eval_size), "--guide-size", str(max(COSINE_SIZES)),
            "--seed", str(seed), "--out", str(sub),
        ]
        for size in COSINE_SIZES:
            cmd += ["--arm", f"g{size}=partitionsel,guide_size={size}"]
        _run(cmd + common, env)
    by_size: dict[str, list[float]] = {}
    for seed in range(draws):
        summary = json.loads((dest / f"seed{seed}" / "summary.json").read_text())
        for size, cos in summary["guide_eval_cosine"].items():
            by_size.setdefault(str(size), []).append(float(cos))
    lines = [
        f"Cosine of the guiding gradient (first k rows of a {max(COSINE_SIZES)}-row guide draw) with the gradient "
        f"of the evaluation rows (at most {eval_size}), full model, at {checkpoint.name}; {draws} independent draws",
        "",
        "| guide rows k | mean | min | max |",
        "|---:|---:|---:|---:|",
    ]
    for size in sorted(by_size, key=int):
        v = by_size[size]
        lines.append(f"| {size} | {sum(v) / len(v):.3f} | {min(v):.3f} | {max(v):.3f} |")
    text = "\n".join(lines)
    (dest / "cosine.md").write_text(text + "\n")
    print(text)


def diagnose(
    dest: Path,
    env: dict[str, str],
    *,
    shards: Path,
    seq_len: int,
    variants: list[str],
    seeds: list[int],
    steps: int,
    jobs: int,
) -> None:
    """Random and the PartitionSel variants at equal steps, paired by seed; tables by run_experiment.

    The runs are tools/run_experiment.py's own train.py commands (`train_command`), queued here so
    that each process has one thread whatever `jobs` is (run_experiment gives cores / jobs), then
    `run_experiment --report-only` writes comparison.md and paired.md from them. Evaluation at the
    last step only (the evaluation documents' forward costs about 16 random steps).
    """
    sys.path.insert(0, str(REPO / "tools"))
    import run_experiment as rx

    runs = {"random": ("random", [])} | {v: ("partitionsel", DIAGNOSE_VARIANTS[v]) for v in variants}
    todo = []
    for seed in seeds:  # seed-major, as run_experiment queues: an interrupted study stays balanced
        for label, (strategy, overrides) in runs.items():
            run_dir = dest / f"{label}-seed{seed}"
            if (run_dir / "eval_results.json").exists():
                continue
            cmd = rx.train_command(
                yaml=YAML, shard_dir=str(shards), strategy=strategy, seed=seed, steps=steps, eval_interval=steps,
                run_dir=run_dir, run_name=f"{dest.name}-{label}-seed{seed}",
                extra=[f"variables.max_seq_len={seq_len}", *overrides],
            )
            todo.append((run_dir, cmd))
    _queue(todo, env, jobs=jobs)
    report = [
        sys.executable, "tools/run_experiment.py", "--yaml", str(YAML), "--shard-dir", str(shards),
        "--seeds", ",".join(map(str, seeds)), "--paired-baseline", "random", "--strategies", "random",
        "--steps", str(steps), "--out", str(dest), "--report-only",
    ]
    for v in variants:
        report += ["--variant", ",".join([f"{v}=partitionsel", *DIAGNOSE_VARIANTS[v]])]
    _run(report, env)


def _queue(todo: list[tuple[Path, list[str]]], env: dict[str, str], *, jobs: int) -> None:
    """Run the commands `jobs` at a time (one thread each); a failed run stops the study."""
    import time

    running: list[tuple[Path, subprocess.Popen]] = []
    while todo or running:
        while todo and len(running) < jobs:
            run_dir, cmd = todo.pop(0)
            run_dir.mkdir(parents=True, exist_ok=True)
            print(f"+ {run_dir.name}: {' '.join(cmd[2:])}", flush=True)
            with open(run_dir.with_suffix(".log"), "w") as log:
                proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            running.append((run_dir, proc))
            # Streaming registers datasets in shared memory: start the next one after this one's first step.
            while proc.poll() is None and not (run_dir / "mixture_steps.csv").exists():
                time.sleep(1)
        time.sleep(2)
        for item in list(running):
            run_dir, proc = item
            if proc.poll() is None:
                continue
            running.remove(item)
            if proc.returncode:
                raise SystemExit(f"{run_dir.name} failed (exit {proc.returncode}); see {run_dir.with_suffix('.log')}")
            print(f"  {run_dir.name} done", flush=True)


def setup(out: Path, env: dict[str, str]) -> None:
    """Split the documents and write the shards for every S (what exists is kept)."""
    docs = out / "docs"
    if not (docs / "split.json").exists():
        _run(
            [
                sys.executable, "tools/split_documents.py", str(DATA), "--out", str(docs),
                "--part", f"guide={GUIDE_FRACTION}", "--part", f"eval={EVAL_FRACTION}", "--overwrite",
            ],
            env,
        )
    for s in SEQ_LENS:
        # Training shards: train documents, the guide documents as their val split.
        # Evaluation shards: the evaluation documents as the val split (the train split, the guide
        # documents, is never read: tools/shard.py needs one and rejects a file given twice).
        for name, train_docs, val_docs in ((f"s{s}", "train", "guide"), (f"s{s}_eval", "guide", "eval")):
            dest = out / "shards" / name
            if (dest / "manifest.json").exists():
                continue
            _run(
                [
                    sys.executable, "tools/shard.py", "dolma", str(docs / train_docs),
                    "--val-file", str(docs / val_docs), "--out", str(dest), "--tokenizer", str(TOKENIZER),
                    "--max-seq-len", str(s), "--no-progress", "--overwrite",
                ],
                env,
            )


def timing(out: Path, env: dict[str, str], *, steps: int) -> None:
    """Per-step training time of each strategy at each S with equal tokens a step; writes OUT/timing/timing.md."""
    dest = out / "timing"
    rows = []
    for s in SEQ_LENS:
        kappa = TIMING_TOKENS // s
        for name, (strategy, *overrides) in TIMING_RUNS.items():
            run_dir = dest / f"s{s}_{name}"
            result = run_dir / "train_budget.json"
            if not result.exists():
                _run(
                    _train(
                        [
                            f"variables.shard_dir={out / 'shards' / f's{s}'}",
                            f"variables.max_seq_len={s}",
                            f"global_train_batch_size={kappa}",
                            f"{SEL}.strategy={strategy}",
                            f"max_duration={steps}ba",
                            "eval_loader=null",
                            "callbacks.train_budget.budget_seconds=null",  # writes train_budget.json
                            f"save_folder={run_dir}",
                            f"save_interval={steps}ba",
                            "save_num_checkpoints_to_keep=0",
                            "save_overwrite=true",
                            f"run_name=ghpile-timing-s{s}-{name}",
                            *overrides,
                        ]
                    ),
                    env,
                )
            budget = json.loads(result.read_text())
            step_s = budget.get("step_time_s") or budget["train_time_s"] / max(1, budget["steps"])
            rows.append({"S": s, "kappa": kappa, "run": name, "steps": budget["steps"], "step_s": step_s})
    by = {(r["S"], r["run"]): r["step_s"] for r in rows}
    lines = [
        f"Training time per step ({TIMING_TOKENS} tokens trained a step, pools of 2 x kappa rows; one thread; "
        f"mean after the first of {steps} steps), load average at the end: {_loadavg()}",
        "",
        "| S | kappa | run | s / step | / random at this S | trained tokens / s |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        ratio = r["step_s"] / by[(r["S"], "random")]
        lines.append(
            f"| {r['S']} | {r['kappa']} | {r['run']} | {r['step_s']:.2f} | {ratio:.2f} | {TIMING_TOKENS / r['step_s']:.0f} |"
        )
    text = "\n".join(lines)
    (dest / "timing.md").write_text(text + "\n")
    (dest / "timing.json").write_text(json.dumps(rows, indent=1))
    print(text)


def _train(overrides: list[str]) -> list[str]:
    return [sys.executable, str(REPO / "train.py"), str(YAML), *overrides]


def _run(cmd: list[str], env: dict[str, str]) -> None:
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, env=env, check=True)


def _gcd(*values: int) -> int:
    import math

    return math.gcd(*values)


def _loadavg() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


if __name__ == "__main__":
    raise SystemExit(main())
