"""The selection study on dm_math, end to end with one command (docs/results/study_dm_math.md).

Parts (each reuses what an earlier, interrupted invocation finished):
  shard      ../shared/data/dm_math -> OUT/shards/dm_math (train.json; val.json as the val split)
  base       regime (a) checkpoints: a from-scratch run (random within capacities) saved at an early
             and a later step; regime (b) base: the model first trained on another mixture (four
             of the eight domains), cached
  lookahead  tools/studies/lookahead.py at the early and the later checkpoint: every arm's one-step drop on
             held-out examples against random subsets with the same capacities
  main       tools/run_experiment.py: every strategy x seed, equal steps, paired against random,
             regime (a) from scratch and regime (b) fine-tuning the base
  wallclock  equal compute for the main contenders, regime (a): run_experiment --compute-budget
             (each configuration's step cost measured by a calibration run, then each run trains
             the steps the budget buys, its learning-rate schedule laid over them)
  ablations  PartitionSel settings varied one at a time (paired against random), regime (a)
  ablations_finetune  the settings regime (a) credits (FINETUNE_ABLATIONS), checked on regime (b)
  report     docs/results/study_dm_math.md, curves and the cost-vs-quality frontier PNGs

Example:
    python tools/studies/study_dm_math.py --out runs/study                  # everything (hours on 2 cores: see the doc)
    python tools/studies/study_dm_math.py --out runs/study --parts lookahead --pools 60
    python tools/studies/study_dm_math.py --out runs/study --quick          # a few steps of each part (a smoke test)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data" / "dm_math"
YAML = REPO / "yamls" / "study" / "dm_math.yaml"
PARTS = ("shard", "base", "lookahead", "main", "wallclock", "ablations", "ablations_finetune", "report")
STRATEGIES = "partitionsel,id,random,random_stratified,greats,gradnorm,colm"
WALLCLOCK_STRATEGIES = "random,id,greats"
# PartitionSel at the library's default preconditioner (the prec_pool ablation that made it the default).
WALLCLOCK_VARIANTS = ["partitionsel=partitionsel,algorithms.data_selection.features.precondition=pool"]
# The regime (b) base trains on these four domains only, then every strategy fine-tunes on all eight.
BASE_DOMAINS = "[arithmetic,numbers,comparison,measurement]"
SEL = "algorithms.data_selection"
# One setting changed at a time from the yaml's PartitionSel (paired against random).
ABLATIONS = {
    # Ordered so the settings the one-step check and the first seed point at finish first.
    "prec_pool": [f"{SEL}.features.precondition=pool"],
    "weighted": [f"{SEL}.weighted_loss=true"],
    # Averaging needs a raw validation side (the algorithm rejects it with `both`): paired with prec_pool.
    "valavg": [f"{SEL}.features.precondition=pool", f"{SEL}.validation.average_beta=0.9"],
    "val16": [f"{SEL}.validation.batch_size=16"],
    "r4": [f"{SEL}.oversampling=4"],
    "r8": [f"{SEL}.oversampling=8"],
    "prec_split": [f"{SEL}.features.precondition=split"],
    "norm_none": [f"{SEL}.features.normalization=none"],
    "proj128": [f"{SEL}.features.proj_dim=128"],
    "last2": [f"{SEL}.features.last_n_blocks=2"],
    "lmhead": [f"{SEL}.features.include_lm_head=true"],
    "uniform_caps": [f"{SEL}.capacity_fractions=uniform"],
    # Issue 15's cost knobs (their Jaccard and feature-time ratio: tools/studies/knob_fidelity.py,
    # docs/data_selection.md "Cost knobs"); a variant's overrides are comma-separated, so no commas.
    "score_tokens32": [f"{SEL}.features.score_tokens=32"],
    "mlp_only": [f"{SEL}.features.target_modules=['mlp\\.down_proj']"],
    "interval2_stale": [f"{SEL}.interval=2", f"{SEL}.between=stale_topk"],
    "interval2_random": [f"{SEL}.interval=2"],
}
# Checked on regime (b) as well: the settings whose regime (a) ablation decides a default.
FINETUNE_ABLATIONS = ("prec_pool",)
# Lookahead arms: the settings before the signal-chain fixes, the yaml's default, each fix, and
# diagnostics. The guide set holds 64 examples; an arm uses its first `guide_size` (a larger guide
# stands in for the running average of validation features, which a fixed checkpoint cannot show).
ARMS = [
    "before=partitionsel,features.precondition=both,features.proj_dim=128,guide_size=4",
    "default=partitionsel,features.precondition=both,features.proj_dim=1024,guide_size=4",
    "default_w=partitionsel,features.precondition=both,features.proj_dim=1024,guide_size=4,weighted_loss=true",
    "default_g64_w=partitionsel,features.precondition=both,features.proj_dim=1024,guide_size=64,weighted_loss=true",
    "pool_1024_w=partitionsel,features.precondition=pool,features.proj_dim=1024,guide_size=4,weighted_loss=true",
    "id=id,features.precondition=both,features.proj_dim=1024,guide_size=4",
    "oracle_g4=oracle,guide_size=4",
    "oracle_eval=oracle_eval",
]


def main(argv: list[str] | None = None) -> int:
    p = _build_parser()
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}; allowed: {', '.join(PARTS)}")
    ablations = [x for x in (args.ablations or ",".join(ABLATIONS)).split(",") if x]
    unknown = [x for x in ablations if x not in ABLATIONS]
    if unknown:
        p.error(f"--ablations: unknown {unknown}; allowed: {', '.join(ABLATIONS)}")
    if not DATA.is_dir():
        p.error(f"the dm_math corpus is not at {DATA} (it ships in ../shared/data/dm_math)")
    if args.quick:
        args.steps, args.early, args.pools, args.seeds = 6, 3, 2, "1,2"
    out = args.out.resolve()
    shards = out / "shards" / "dm_math"
    base_a, base_b = out / "base_scratch", out / "base_other"
    steps = args.steps

    if "shard" in parts and not (shards / "manifest.json").exists():
        _run(
            [
                sys.executable,
                "tools/shard.py",
                "metamathqa",
                str(DATA / "train.json"),
                "--val-file",
                str(DATA / "val.json"),
                "--out",
                str(shards),
                "--max-seq-len",
                "160",
                "--overwrite",
            ]
        )
    common = [f"variables.shard_dir={shards}"]
    if "base" in parts:
        _train_bases(common, base_a, base_b, steps=steps, early=args.early)
    if "lookahead" in parts:
        _lookahead(out, base_a, common, steps=steps, early=args.early, pools=args.pools)
    _experiments(args, parts, ablations, out=out, shards=shards, base_b=base_b, steps=steps)
    if "report" in parts:
        from study_report import write_report  # tools/studies/study_report.py

        write_report(out, args.doc, steps=steps, early=args.early)
        print(f"wrote {args.doc}")
    return 0


def _build_parser() -> argparse.ArgumentParser:
    """The study's command line: its parts, sizes, budget, ablations and jobs."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "study")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument(
        "--steps", type=int, default=200, help="training steps of every comparison run (default 200)"
    )
    p.add_argument("--early", type=int, default=50, help="the early lookahead checkpoint step (default 50)")
    p.add_argument("--pools", type=int, default=24, help="lookahead pools per checkpoint (default 24)")
    p.add_argument(
        "--compute-budget",
        default=None,
        help="the wallclock part's budget, run_experiment's --compute-budget (default: random=STEPS, the "
        "cost of random's --steps steps)",
    )
    p.add_argument(
        "--cost-clock",
        choices=("wall", "cpu"),
        default="cpu",
        help="the clock the wallclock part measures step costs on (default cpu: the study runs on a CPU "
        "shared with other jobs, where the process's CPU time varies less with their load than the wall clock)",
    )
    p.add_argument(
        "--ablations",
        default=None,
        help=f"comma-separated subset of the ablations to run (default: all: {','.join(ABLATIONS)})",
    )
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument(
        "--report-only",
        action="store_true",
        help="the experiment parts train nothing and tabulate the runs already finished (run_experiment --report-only)",
    )
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes everywhere (a smoke test of the pipeline)"
    )
    p.add_argument("--doc", type=Path, default=REPO / "docs" / "results" / "study_dm_math.md")
    return p


def _train_bases(common: list[str], base_a: Path, base_b: Path, *, steps: int, early: int) -> None:
    """The base part: regime (a)'s from-scratch run with its checkpoints, regime (b)'s base on another mixture."""
    if not (base_a / f"ep0-ba{steps}-rank0.pt").exists():
        _run(
            _train(
                common
                + [
                    f"{SEL}.strategy=random_stratified",
                    f"save_folder={base_a}",
                    f"save_interval={early}ba",
                    f"max_duration={steps}ba",
                    "save_overwrite=true",
                    "run_name=study-base-scratch",
                ]
            )
        )
    if not (base_b / "latest-rank0.pt").exists():
        _run(
            _train(
                common
                + [
                    f"{SEL}.strategy=random",
                    f"train_loader.dataset.domains={BASE_DOMAINS}",
                    f"save_folder={base_b}",
                    f"save_interval={steps}ba",
                    f"max_duration={steps}ba",
                    "save_overwrite=true",
                    "eval_loader=null",
                    "run_name=study-base-other",
                ]
            )
        )


def _lookahead(out: Path, base_a: Path, common: list[str], *, steps: int, early: int, pools: int) -> None:
    """The lookahead part: tools/studies/lookahead.py at the early and the later checkpoint of regime (a)."""
    for step in (early, steps):
        dest = out / "lookahead" / f"ba{step}"
        if (dest / "summary.json").exists():
            continue
        cmd = [
            sys.executable,
            "tools/studies/lookahead.py",
            "--yaml",
            str(YAML),
            "--checkpoint",
            str(base_a / f"ep0-ba{step}-rank0.pt"),
            "--pools",
            str(pools),
            "--n-random",
            "8",
            "--eval-size",
            "128",
            "--guide-size",
            "64",
            "--sgd-lr",
            "1e-3",
            "--out",
            str(dest),
        ]
        for arm in ARMS:
            cmd += ["--arm", arm]
        _run(cmd + common)


def _experiments(
    args: argparse.Namespace, parts: list[str], ablations: list[str], *, out: Path, shards: Path, base_b: Path, steps: int
) -> None:
    """The tools/run_experiment.py parts: main, wallclock, ablations and ablations_finetune."""
    experiment = [
        sys.executable,
        "tools/run_experiment.py",
        "--yaml",
        str(YAML),
        "--shard-dir",
        str(shards),
        "--seeds",
        args.seeds,
        "--jobs",
        str(args.jobs),
        "--paired-baseline",
        "random",
        *(["--report-only"] if args.report_only else []),
    ]
    # Regime (a) from scratch; regime (b) fine-tunes the base trained on another mixture.
    regimes = {
        "main_scratch": [],
        "main_finetune": [
            f"load_path={base_b / 'latest-rank0.pt'}",
            "load_weights_only=true",
            "optimizer.lr=5.0e-4",
        ],
    }
    if "main" in parts:
        for name, overrides in regimes.items():
            cmd = experiment + ["--strategies", STRATEGIES, "--steps", str(steps), "--log-selected-ids"]
            _run(cmd + ["--out", str(out / name)] + (["--", *overrides] if overrides else []))
    if "wallclock" in parts:
        cmd = experiment + [
            "--strategies",
            WALLCLOCK_STRATEGIES,
            "--compute-budget",
            args.compute_budget or f"random={steps}",
            "--cost-clock",
            args.cost_clock,
            "--out",
            str(out / "wallclock_scratch"),
        ]
        for variant in WALLCLOCK_VARIANTS:
            cmd += ["--variant", variant]
        _run(cmd)
    if "ablations" in parts:
        cmd = experiment + ["--strategies", "random", "--steps", str(steps), "--out", str(out / "ablations")]
        for name in ablations:
            cmd += ["--variant", ",".join([f"ps_{name}=partitionsel", *ABLATIONS[name]])]
        _run(cmd)
    if "ablations_finetune" in parts:
        dest = out / "ablations_finetune"
        cmd = experiment + ["--strategies", "random", "--steps", str(steps), "--out", str(dest)]
        for name in FINETUNE_ABLATIONS:
            cmd += ["--variant", ",".join([f"ps_{name}=partitionsel", *ABLATIONS[name]])]
        _run(cmd + ["--", *regimes["main_finetune"]])


def _train(overrides: list[str]) -> list[str]:
    return [sys.executable, "train.py", str(YAML), *overrides]


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
