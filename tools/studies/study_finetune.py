"""The fine-tuning study (issue 29; docs/results/study_finetune.md): LoRA on a real pretrained LM, dm_math domains.

Does PartitionSel beat random within the domain capacities (`random_stratified`) when it fine-tunes
a pretrained model, the regime the method was made for? SmolLM2-135M-Instruct (GGUF, converted once
and cached), the 8 dm_math areas as domains, prompts in the model's chat template, loss on the answer
only, LoRA on the top blocks (yamls/smollm2-135m_dm_math.yaml). Every arm is compared at equal steps
and at equal compute (the cost of --steps random steps; tools/run_experiment.py's calibrated cost
model, every schedule decayed over its own steps), paired by seed against random and against
random_stratified (then against partitionsel and full_pool where they ran), on the held-out loss
and on the exact-match accuracy of greedy answers.

Parts (each reuses what an earlier, interrupted invocation finished, so a study can span sittings):
  setup   ../shared/data/dm_math -> OUT/shards (tools/shard.py, the model's chat template)
  floor   the base model before fine-tuning: held-out loss (tools/evaluate.py ppl) and answer accuracy
          (tools/evaluate.py answers) on the questions every run is evaluated on -> OUT/floor.json
  study   tools/run_experiment.py at equal steps (OUT/equal_steps) and equal compute (OUT/equal_compute)
  report  OUT/study.md: the tables, the induced mixture and the conflict fraction (the docs quote it)

Profiles (--profile):
  quick  random, random_stratified, partitionsel; the main table
  full   the ten arms of the tables (the paper's baselines, the best earlier setting, and random on the
         whole pool: what selection approximates at half the memory); ps_ahead only through --arms

Example:
    python tools/studies/study_finetune.py --out runs/finetune --parts setup,floor,study,report --profile quick
    python tools/studies/study_finetune.py --out runs/finetune --parts study,report --profile full --seeds 1,2,3,4,5
    python tools/studies/study_finetune.py --out runs/finetune_smoke --smoke     # a few steps of everything
    python tools/studies/study_finetune.py --gpu --out runs/finetune_gpu --seeds 1,2,3,4,5   # issue 29.6, on one GPU

Every training process runs with one thread (OMP_NUM_THREADS=1); `--jobs` (default 2) run at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data"
MODEL = DATA / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
YAML = REPO / "yamls" / "smollm2-135m_dm_math.yaml"
PARTS = ("setup", "floor", "study", "report")
SEL = "algorithms.data_selection"
# label -> (strategy, overrides). `partitionsel` is the library's defaults; `ps_r4` the setting the dm_math
# study found best at equal steps (pools of 4 x kappa: docs/results/study_dm_math.md, "Larger oversampling
# helps"); `ps_reuse` the defaults at a cheaper step; `full_pool` trains on the whole pool of 2 x kappa
# every step (strategy none); `ps_ahead` the defaults with each step's selection made during the step before
# (select_ahead: from weights one step older; issue 31's cheaper step on a GPU, its quality measured here).
ARMS: dict[str, tuple[str, list[str]]] = {
    "random": ("random", []),
    "random_stratified": ("random_stratified", []),
    "partitionsel": ("partitionsel", []),
    "ps_r4": ("partitionsel", [f"{SEL}.oversampling=4"]),
    # The library's defaults with the training forward taking the frozen blocks' output from the scoring pass
    # (model.reuse_scoring_prefix): the same selections up to rounding, a cheaper step.
    "ps_reuse": ("partitionsel", ["model.reuse_scoring_prefix=true"]),
    "ps_ahead": ("partitionsel", [f"{SEL}.select_ahead=true"]),
    "id": ("id", []),
    "greats": ("greats", []),
    "colm": ("colm", []),
    "gradnorm": ("gradnorm", []),
    "full_pool": ("none", []),
}
QUICK_ARMS = ("random", "random_stratified", "partitionsel")
# The full profile: the arms of the committed ten-arm tables. `ps_ahead` came later and ran in its own directory
# (docs/results/study_finetune.md, "Selecting one step ahead"); name it in --arms.
FULL_ARMS = tuple(arm for arm in ARMS if arm != "ps_ahead")
# The report also pairs every arm against these: the selector, and training on every row of the pool.
REFERENCE_ARMS = ("partitionsel", "full_pool")
# Evaluation at the last step only: 16 held-out examples per domain for the loss (the same 16 in every
# run, so paired differences cancel their sampling), 10 questions per domain for the answers.
EVAL_OVERRIDES = ["eval_loader.subset_num_batches=1", "eval_loader.device_eval_batch_size=16"]
# The recipe now shuffles with py1br (its comments say why); the study's runs were made with py1e, whose
# first pools lean towards equal domain shares (the same pools for every arm), and every sitting keeps
# that order so that the arms and seeds stay paired on the same pools.
STUDY_LOADER = ["train_loader.dataset.shuffle_algo=py1e"]
# Likewise the recipe now hands the scoring pass's frozen-block output on to the training forward (a cheaper
# PartitionSel step, the same losses); the study's runs were made without it, and its `ps_reuse` arm turns it on.
STUDY_MODEL = ["model.reuse_scoring_prefix=false"]
# `--gpu` (issue 29.6): the study at a larger shape on one GPU, in the recipes' precision. dm_math rows are at
# most 134 tokens, so the larger shape is more rows a step (kappa 32: pools of 64), not longer rows; more steps
# and 50 questions a domain (400 in all: an accuracy step of 0.0025, against 0.0125 with 80). Costs are priced
# on the wall clock (the GPU's time is not the process's CPU time).
GPU = {
    "overrides": ["device=gpu", "precision=amp_bf16", "global_train_batch_size=32", "device_train_microbatch_size=32",
                  "eval_loader.subset_num_batches=4"],
    "steps": 100, "jobs": 1, "per_domain": 50, "clock": "wall",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "finetune")
    p.add_argument("--parts", default="setup,floor,study,report", help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--profile", choices=("quick", "full"), default="quick", help="quick (the main table) or full (every arm)")
    p.add_argument("--seeds", default="1,2,3,4,5", help="comma-separated seeds (default 1-5)")
    p.add_argument("--steps", type=int, default=None, help="equal steps, and the equal-compute budget in random steps (default 20; --gpu 100)")
    p.add_argument("--jobs", type=int, default=None, help="training processes at once (default 2; --gpu 1)")
    p.add_argument("--arms", default=None, help=f"instead of the profile's arms, a subset of {','.join(ARMS)}")
    p.add_argument(
        "--budgets", default="steps,compute",
        help="comma-separated subset of steps,compute: the budgets the study part trains (default both; compute "
        "prices its arms from the equal-steps runs already in --out, so it needs them)",
    )
    p.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE",
        help="a recipe setting for every run of the study part, after the study's own (repeatable; e.g. "
        "optimizer.lr=3e-3). Give each setting its own --out: runs are reused by name",
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes everywhere (a test of the pipeline, not a study)")
    p.add_argument(
        "--gpu", action="store_true",
        help=f"the larger shape on one GPU (issue 29.6): amp_bf16, kappa 32, {GPU['steps']} steps unless --steps says, "
        f"{GPU['per_domain']} questions a domain, wall-clock costs, one job at a time unless --jobs says",
    )
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}; allowed: {', '.join(PARTS)}")
    bad_overrides = [o for o in args.override if "=" not in o or o.startswith("=")]
    if bad_overrides:
        p.error(f"--override: KEY=VALUE expected, got {bad_overrides}")
    budgets = [x for x in args.budgets.split(",") if x]
    if not budgets or any(b not in ("steps", "compute") for b in budgets):
        p.error(f"--budgets: a comma-separated subset of steps,compute, got {args.budgets!r}")
    arms = [a for a in (args.arms or ",".join(QUICK_ARMS if args.profile == "quick" else FULL_ARMS)).split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        p.error(f"--arms: unknown {unknown}; allowed: {', '.join(ARMS)}")
    if "random" not in arms:
        p.error("--arms: random is the budget's reference and every pairing's baseline; keep it")
    for path, what in ((DATA / "dm_math" / "train.json", "the dm_math corpus"), (MODEL, "the SmolLM2 GGUF file")):
        if not path.exists():
            p.error(f"{what} is not at {path} (it ships in ../shared/data)")
    if args.gpu and args.smoke:
        p.error("--gpu and --smoke: choose one")
    args.steps = args.steps if args.steps is not None else (GPU["steps"] if args.gpu else 20)
    args.jobs = args.jobs if args.jobs is not None else (GPU["jobs"] if args.gpu else 2)
    if args.steps < 2 or args.jobs < 1:
        p.error(f"--steps must be >= 2 and --jobs >= 1, got {args.steps} and {args.jobs}")
    if args.smoke:
        args.steps, args.seeds = 6, "1,2"  # 6: a budget of 6 random steps buys partitionsel at least one
    out = args.out.resolve()
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    shards = out / "shards"
    t0 = time.perf_counter()
    if "setup" in parts:
        setup(shards, env, smoke=args.smoke)
    if "floor" in parts:
        # The floor runs alone before the trainings: it may use every core the jobs will (one thread each).
        floor(out, shards, dict(env, OMP_NUM_THREADS=str(args.jobs)), smoke=args.smoke,
              per_domain=GPU["per_domain"] if args.gpu else None)
    if "study" in parts:
        cmds = study_commands(out, shards=shards, arms=arms, seeds=args.seeds, steps=args.steps, jobs=args.jobs,
                              smoke=args.smoke, gpu=args.gpu, settings=tuple(args.override))
        for budget, cmd in zip(("steps", "compute"), cmds):
            if budget in budgets:
                _run(cmd, env)
    if "report" in parts:
        print(study_report(out))
    print(f"study_finetune: {', '.join(parts)} took {time.perf_counter() - t0:.0f} s of wall time in this invocation "
          f"(load average {_loadavg()})", flush=True)
    return 0


def setup(shards: Path, env: dict[str, str], *, smoke: bool = False) -> None:
    """The dm_math shards in the model's chat template (kept when they exist)."""
    if (shards / "manifest.json").exists():
        return
    cmd = [
        sys.executable, "tools/shard.py", "metamathqa", str(DATA / "dm_math" / "train.json"),
        "--val-file", str(DATA / "dm_math" / "val.json"), "--out", str(shards), "--tokenizer", str(MODEL),
        "--prompt-template", "chat", "--max-seq-len", "160", "--no-progress",
    ]
    _run(cmd, env)


def floor(out: Path, shards: Path, env: dict[str, str], *, smoke: bool = False, per_domain: int | None = None) -> None:
    """The base model's held-out loss and answer accuracy: what fine-tuning starts from (OUT/floor.json)."""
    path = out / "floor.json"
    if path.exists():
        return
    common = ["--model", str(MODEL), "--shards", str(shards), "--no-progress", "--batch-size", "16"]
    ppl, answers = out / "floor_ppl.json", out / "floor_answers.json"
    if not ppl.exists():  # the first batch of 16 held-out examples per domain, as the runs' evaluators
        _run([sys.executable, "tools/evaluate.py", "ppl", *common, "--max-batches", "1", "--out", str(ppl)], env)
    if not answers.exists():
        per_domain = str(per_domain) if per_domain is not None else ("2" if smoke else "10")
        _run([sys.executable, "tools/evaluate.py", "answers", *common, "--per-domain", per_domain, "--out", str(answers)], env)
    loss = json.loads(ppl.read_text())["domains"]
    acc = json.loads(answers.read_text())
    summary = {
        "val_cross_entropy": {d: v["log_ppl"] for d, v in loss.items()},
        "answer_accuracy": acc["per_domain"],
        "answer_accuracy_mean": acc["average"],
        "answer_contains_mean": acc.get("contains_average"),
    }
    values = list(summary["val_cross_entropy"].values())
    summary["val_cross_entropy_mean"] = sum(values) / len(values)
    path.write_text(json.dumps(summary, indent=2))


def study_commands(
    out: Path, *, shards: Path, arms: list[str], seeds: str, steps: int, jobs: int, smoke: bool = False, gpu: bool = False,
    settings: tuple[str, ...] = (),
) -> list[list[str]]:
    """run_experiment's command lines: equal steps, then equal compute (the cost of `steps` random steps)."""
    plain = [a for a in arms if ARMS[a][0] == a and not ARMS[a][1]]
    base = [
        sys.executable, "tools/run_experiment.py", "--yaml", str(YAML), "--shard-dir", str(shards),
        "--strategies", ",".join(plain), "--seeds", seeds, "--paired-baseline", "random", "--jobs", str(jobs),
        "--eval-interval", "1000000",  # the last step only (train_budget evaluates there)
    ]
    for label in arms:
        if label not in plain:
            strategy, overrides = ARMS[label]
            base += ["--variant", ",".join([f"{label}={strategy}", *overrides])]
    # Every run evaluates the same held-out examples and questions with the same frozen blocks below the
    # adapters: the first evaluation records those blocks' outputs, the others skip them
    # (composer_algos/models/frozen_prefix.py; the same results bit for bit).
    tail = ["--", *EVAL_OVERRIDES, f"model.eval_prefix_cache={out / 'prefix_cache'}", *STUDY_LOADER, *STUDY_MODEL]
    tail += ["callbacks.answer_accuracy.per_domain=2"] if smoke else []
    tail += [*GPU["overrides"], f"callbacks.answer_accuracy.per_domain={GPU['per_domain']}"] if gpu else []
    tail += list(settings)  # last: the user's settings win over the study's
    # The step costs come from the equal-steps runs just trained (each run's timed steps are one calibration
    # round, measured on this machine at the same --jobs), not from rounds of their own: 8 minutes saved in the
    # quick profile. An arm the calibration file already prices keeps its samples (the committed tables' plans).
    calibration = ["--calibration-from", str(out / "equal_steps"), "--calibration-rounds", "2"]
    calibration += ["--calibration-steps", "2", "--calibration-warmup", "1"] if smoke else []
    return [
        base + ["--steps", str(steps), "--out", str(out / "equal_steps"), *tail],
        # Arms of random's work (random_stratified) train random's steps at equal compute: their equal-steps
        # runs are reused, not trained twice.
        base + ["--compute-budget", f"random={steps}", "--cost-clock", GPU["clock"] if gpu else "cpu", *calibration,
                "--reuse-from", str(out / "equal_steps"), "--out", str(out / "equal_compute"), *tail],
    ]


def study_report(out: Path) -> str:
    """OUT/study.md: per budget, each arm's loss and accuracy, paired against random and random_stratified, then
    against partitionsel and full_pool (where they ran)."""
    sys.path.insert(0, str(REPO))
    from composer_algos.analysis.experiment_stats import paired_comparison

    lines = [f"# Fine-tuning study tables ({out})", ""]
    floor_path = out / "floor.json"
    if floor_path.exists():
        f = json.loads(floor_path.read_text())
        lines += [
            f"Base model before fine-tuning (the floor): held-out loss {f['val_cross_entropy_mean']:.4f}, exact-match "
            f"accuracy {f['answer_accuracy_mean']:.3f}"
            + (f" (the reference number anywhere in its answer: {f['answer_contains_mean']:.3f})" if f.get("answer_contains_mean") is not None else "")
            + ".",
            "",
        ]
    for name, title in (("equal_steps", "Equal steps"), ("equal_compute", "Equal compute")):
        cmp_path = out / name / "comparison.json"
        if not cmp_path.exists():
            continue
        comparison = json.loads(cmp_path.read_text())
        plan = json.loads((out / name / "plan.json").read_text()) if (out / name / "plan.json").exists() else None
        lines += [f"## {title}", ""]
        if plan is not None:
            lines += [_plan_line(plan), ""]
        per_seed = {k: {int(s): v for s, v in runs.items()} for k, runs in comparison["per_seed"].items()}
        acc_seed = {k: {int(s): v for s, v in runs.items()} for k, runs in comparison.get("per_seed_accuracy", {}).items()}
        pairs = {
            (metric, base): paired_comparison(data, baseline=base)["strategies"] if base in data else {}
            for metric, data in (("loss", per_seed), ("accuracy", acc_seed))
            for base in ("random", "random_stratified", *REFERENCE_ARMS)
        }
        lines += [
            "| arm | steps | loss (mean +- std) | accuracy | loss - random | loss - random_stratified "
            "| accuracy - random | accuracy - random_stratified |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for label, entry in comparison["strategies"].items():
            steps = plan["steps"].get(label) if plan else entry.get("steps", {}).get("mean")
            cells = [
                label, _int(steps), _ms(entry.get("average")), _ms(entry.get("accuracy"), 3),
                *(_ci(pairs[(m, b)].get(label, {}).get("average"), 4 if m == "loss" else 3)
                  for m in ("loss", "accuracy") for b in ("random", "random_stratified")),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        lines += _reference_table(comparison["strategies"], pairs)
        lines += _domain_table("Per domain, loss - random_stratified", pairs[("loss", "random_stratified")], 3)
        lines += _domain_table("Per domain, accuracy - random_stratified", pairs[("accuracy", "random_stratified")], 2)
        for extra in ("sensitivity.md", "selection.md"):
            if (out / name / extra).exists():
                lines += [(out / name / extra).read_text().strip(), ""]
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "study.md").write_text(text + "\n")
    return text


def _reference_table(labels, pairs: dict) -> list[str]:
    """Each arm against the selector and against training on the whole pool (what selection approximates)."""
    refs = [r for r in REFERENCE_ARMS if pairs[("loss", r)]]
    if not refs:
        return []
    cols = [(m, r) for m in ("loss", "accuracy") for r in refs]
    lines = [
        "Against PartitionSel and the whole pool (mean [95% CI] over paired seeds):", "",
        "| arm | " + " | ".join(f"{m} - {r}" for m, r in cols) + " |", "|---|" + "---:|" * len(cols),
    ]
    for label in labels:
        cells = [_ci(pairs[(m, r)].get(label, {}).get("average"), 4 if m == "loss" else 3) for m, r in cols]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + [""]


def _plan_line(plan: dict) -> str:
    spread = plan.get("spread") or {}
    costs = ", ".join(
        f"{k} {v:.2f}" + (f" +- {100 * spread[k]:.1f}%" if spread.get(k) else "") for k, v in plan["step_costs_s"].items()
    )
    calibration = plan.get("calibration") or {}
    rounds = f"; {calibration['rounds']} calibration rounds" if calibration else ""
    return f"Budget: {plan['budget']}; step costs (CPU s): {costs}{rounds}."


def _domain_table(title: str, paired: dict, digits: int) -> list[str]:
    domains = sorted({d for v in paired.values() for d in v.get("domains", {})})
    if not domains:
        return []
    lines = [f"{title} (mean [95% CI] over paired seeds):", "", "| arm | " + " | ".join(domains) + " |",
             "|---|" + "---:|" * len(domains)]
    for label, v in paired.items():
        lines.append(f"| {label} | " + " | ".join(_ci(v["domains"].get(d), digits) for d in domains) + " |")
    return lines + [""]


def _ci(summary: dict | None, digits: int) -> str:
    import math

    if not summary or summary.get("n", 0) == 0 or not math.isfinite(summary["mean"]):
        return "-"
    if not math.isfinite(summary["ci_low"]):
        return f"{summary['mean']:+.{digits}f} (n {summary['n']})"
    return f"{summary['mean']:+.{digits}f} [{summary['ci_low']:+.{digits}f}, {summary['ci_high']:+.{digits}f}] (n {summary['n']})"


def _ms(entry: dict | None, digits: int = 4) -> str:
    import math

    if not entry or not math.isfinite(entry.get("mean", math.nan)):
        return "-"
    return f"{entry['mean']:.{digits}f} +- {entry['std']:.{digits}f}"


def _int(value) -> str:
    return "-" if value is None else str(int(round(float(value))))


def _run(cmd: list[str], env: dict[str, str]) -> None:
    print("+ " + " ".join(str(c) for c in cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, env=env, check=True)


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


if __name__ == "__main__":
    raise SystemExit(main())
