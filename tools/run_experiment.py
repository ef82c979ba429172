"""Run several selection strategies (and seeds) on equal budgets and compare them.

Example:
    python tools/run_experiment.py --yaml yamls/testing/demo_dolma.yaml \
        --shard-dir demo_out/shards/dolma --strategies partitionsel,id,random,greats \
        --seeds 1,2,3 --steps 200 --paired-baseline random --log-selected-ids --out demo_out/experiments/demo
    # equal compute: each run trains the steps that the cost of 200 random steps buys, its
    # learning-rate schedule laid over its own steps (step costs measured first)
    python tools/run_experiment.py ... --compute-budget random=200 --paired-baseline random

Every run uses the same shards, model and kappa (`global_train_batch_size`); only
`algorithms.data_selection.strategy` and the seed change. The seed sets the model's
initialisation and the selection and validation draws; the data order stays the yaml's
`train_loader.dataset.shuffle_seed`, so every strategy chooses from the same sequence of pools
(pass `-- train_loader.dataset.shuffle_seed=N` to vary it too). Extra `key=value` arguments after
`--` are passed to every run (e.g. `-- optimizer.lr=1e-3`). A run already finished in `--out` is
reused (unless `--rerun`) when its saved config.yaml is the configuration this invocation would
train, its save folder, name and evaluation interval aside; one finished with other settings
(another `-- optimizer.lr`, other steps) is trained again, and the line saying so names the
settings that differ; the finished run is moved to OUT/replaced/. A training always starts in an
empty run folder (a `--reuse-from` link is removed, not trained through; `--rerun` replaces a run).

Variants: `--variant NAME=STRATEGY[,yaml.key=value...]` adds a named configuration that is run,
reported and paired like a strategy (e.g. `ps_w=partitionsel,algorithms.data_selection.weighted_loss=true`),
for one-at-a-time studies of a setting.

Budgets (one of):
- `--steps N`: every run trains N steps (equal steps).
- `--compute-budget B`: equal compute. B is `LABEL=N` (what N steps of LABEL cost, e.g.
  `random=200`; LABEL one of `--strategies`, a `--variant`'s name or a label of the given
  `--step-costs`, checked before anything runs) or `S`/`Ss` (S seconds of training). Each
  configuration's cost per step (seconds of training: Composer's wall-clock account of data
  loading, selection and the training step, evaluation excluded) is first measured by a
  calibration run (`--step-costs calibrate`, the
  default: the first seed, `--calibration-warmup` steps left out, then `--calibration-steps`
  timed, no evaluation; OUT/calibration.json, reused by any later plan, or `--calibration FILE`;
  `--calibration-from DIR` takes the timed steps of finished runs of the same configurations, e.g.
  the equal-steps runs of the same study, instead of running rounds of its own) or given
  (`--step-costs random=0.41,partitionsel=0.97`, e.g. from tools/bench/bench_step.py). The calibrated
  cost is a model (`compute_plan.fit_cost_model`: seconds per training FLOP, per scoring FLOP, and
  the rest of each configuration's step) fitted to interleaved rounds of every group of configurations that do the same work
  (random and random_stratified are one group: the same cost, the same steps), run until each
  arm's cost spread against the reference is within `--calibration-target` (docs/evaluation.md).
  Each run then
  trains floor(budget / its cost) steps with `max_duration` = those steps, so its warm-up and
  decay are laid over its own steps and it ends at the schedule's final rate; durations in `dur`
  (`t_warmup: 0.03dur`, the selection's `start`/`end`) are fractions of its own steps. A plan
  with a run that would not leave a warm-up given in `ba` is rejected before training.
  OUT/plan.json holds the costs, their spreads and the steps. With `--sensitivity` (default) an
  arm is also trained at the step counts its cost one calibration spread lower or higher would
  buy, where they differ from its plan (runs `<label>@<steps>-seed<s>`), and OUT/sensitivity.md
  says whether its paired verdict holds across them.
- `--budget-seconds S --steps N`: every run stops once it has trained S seconds (same account),
  so a slower strategy trains fewer steps. N is the step cap and the schedule's horizon: a run the
  budget stops ends wherever its schedule then is (not decayed; the runs stop at different points
  of it), and `dur` fractions are fractions of N. Kept for measuring the cost of a fixed schedule;
  compare strategies with `--compute-budget`.
Every run evaluates at its last step. The reports give, per run, the steps, the training time and
the estimated FLOPs (training and selection's scoring; composer_algos/analysis/compute_plan.py says what
the estimate counts).

Evaluation reads the held-out part of each domain's `val` split; the selection's validation
batches come from the other part (see docs/evaluation.md, `guide_fraction`), so no evaluated
example ever guided a selection.

Runs are queued seed-major (seed 1 of every strategy, then seed 2, ...), so an interrupted
comparison stays balanced across strategies. `--jobs N` runs N trainings at a time, each with
OMP_NUM_THREADS = cores/N (set for every N, 1 included); with N > 1 the costlier runs of each seed
are queued first, so the short ones fill the other slots and no long run is left alone at the end.

Writes OUT/comparison.md, OUT/comparison.json and OUT/curves.png: per-domain validation
log-perplexity at the last evaluation (mean +- std over seeds), their average, steps, training
and wall time and the share spent selecting. With `--paired-baseline B`, OUT/paired.md and
OUT/paired.json: per seed, each strategy's final loss minus B's (average and per domain), with
the mean and a 95% t interval. With `--compute-budget` the comparison also lists every run's planned
and trained steps, training time and FLOPs. OUT/selection.md and OUT/selection.json: the conflict fraction,
the induced domain mixture beside the natural one (both as shares of training examples) and,
with `--log-selected-ids`, the Jaccard overlap of each strategy's selected examples with
random's on the same pools (after checking the pools are identical).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    runs_of = _parse_runs(parser, args)
    strategies = list(runs_of)
    seeds = _parse_seeds(parser, args)
    if not args.yaml.is_file():
        parser.error(f"--yaml: no such file {args.yaml}")
    # The runs train in the repository's directory: the paths given relative to this one are made absolute.
    args.yaml, args.out = args.yaml.resolve(), args.out.resolve()
    if "://" not in args.shard_dir:
        if not args.report_only and not (Path(args.shard_dir) / "manifest.json").is_file():
            parser.error(f"--shard-dir: {args.shard_dir} holds no manifest.json (the output directory of tools/shard.py)")
        args.shard_dir = str(Path(args.shard_dir).resolve())
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if args.budget_seconds is not None and not args.budget_seconds > 0:
        parser.error(f"--budget-seconds must be > 0, got {args.budget_seconds}")
    if args.report_only and args.rerun:
        parser.error("--report-only and --rerun contradict each other")
    budget = _parse_budget(parser, args)
    given_costs = _settle_compute_options(parser, args, budget)
    if args.paired_baseline is not None and args.paired_baseline not in strategies:
        parser.error(f"--paired-baseline {args.paired_baseline!r} must be one of --strategies {strategies}")
    if budget is not None and budget.reference is not None and budget.reference not in [*strategies, *(given_costs or {})]:
        # LABEL=N is the cost of N steps of a run's label, measured (calibrated) or given with --step-costs.
        costs = f" or of --step-costs {list(given_costs)}" if given_costs else ""
        parser.error(
            f"--compute-budget {args.compute_budget!r}: {budget.reference!r} must be one of --strategies {strategies}{costs}"
        )

    gpus = [g for g in (args.gpus or "").split(",") if g]
    args.out.mkdir(parents=True, exist_ok=True)
    plan = None
    if budget is not None:
        try:
            plan = plan_compute(args, strategies, runs_of, seeds[0], budget, given_costs, extra, gpus)
        except PlanError as e:
            parser.error(str(e))
        steps_of = dict(plan["steps"])
        for label, counts in plan["sensitivity"].items():  # the same arm at the edges of its calibration noise
            for n in counts:
                runs_of[sensitivity_label(label, n)] = runs_of[label]
                steps_of[sensitivity_label(label, n)] = n
    else:
        steps_of = {label: args.steps for label in strategies}
        if not args.report_only and (problem := _config_problem(args, runs_of, extra)):
            parser.error(problem)  # before any run starts (a plan's runs were loaded by plan_compute)
    from pipeline.config import ConfigError

    try:
        todo, changed = _queue_runs(args, runs_of, steps_of, seeds, extra, plan)
    except ConfigError as e:  # the settings a finished run is compared with do not load
        parser.error(str(e))
    if args.report_only:
        if not _report_only_ready(args, todo, changed, seeds):
            return 2
        todo = []
    failed = _run_queue(todo, jobs=args.jobs, gpus=gpus, budget_seconds=args.budget_seconds)
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
        plan=plan,
    )
    return 0


def _config_problem(args: argparse.Namespace, runs_of: dict[str, tuple[str, list[str]]], extra: list[str]) -> str | None:
    """The first run configuration (the yaml, the overrides after ``--`` and a variant's) that does not load, or None."""
    for label, (strategy, overrides) in runs_of.items():
        try:
            arm_work(args.yaml, args.shard_dir, strategy, extra + overrides)
        except PlanError as e:
            return f"run {label!r}: {e}"
    return None


def _parse_runs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, tuple[str, list[str]]]:
    """label -> (strategy, overrides): the plain `--strategies`, then the named `--variant`s."""
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    known = known_strategies()
    bad = [s for s in strategies if s not in known]
    if bad:
        parser.error(f"--strategies: unknown {bad}; allowed: {', '.join(known)}")
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
    return runs_of


def _parse_seeds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[int]:
    """The `--seeds`, at least one."""
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not seeds:
        parser.error("--seeds: give at least one seed")
    return seeds


def _parse_budget(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The `--compute-budget` (None for equal steps or `--budget-seconds`), once the budget options agree."""
    from composer_algos.analysis.compute_plan import parse_compute_budget

    budget = None
    if args.compute_budget is not None:
        if args.steps is not None or args.budget_seconds is not None:
            parser.error(
                "--compute-budget gives every run its own steps: drop --steps and --budget-seconds"
            )
        try:
            budget = parse_compute_budget(args.compute_budget)
        except ValueError as e:
            parser.error(str(e))
    elif args.budget_seconds is not None and args.steps is None:
        parser.error(
            "--budget-seconds needs --steps: the step cap, which is also the learning-rate schedule's "
            "horizon and what durations in dur (t_warmup, the selection's start/end) are fractions of; "
            "a run the budget stops is not decayed. For runs that each end decayed use --compute-budget"
        )
    elif args.steps is None:
        parser.error(
            "give --steps (equal steps), --compute-budget (equal compute: each run its own steps and "
            "schedule) or --budget-seconds with --steps (stop at a training time)"
        )
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return budget


def _settle_compute_options(
    parser: argparse.ArgumentParser, args: argparse.Namespace, budget: Any
) -> dict[str, float] | None:
    """Check the options only `--compute-budget` takes and fill in their defaults; the given `--step-costs`.

    Returns None when the costs are to be calibrated.
    """
    from composer_algos.analysis.compute_plan import parse_step_costs

    compute_only = {
        "--step-costs": args.step_costs is not None,
        "--cost-clock": args.cost_clock is not None,
        "--calibration-steps": args.calibration_steps is not None,
        "--calibration-warmup": args.calibration_warmup is not None,
        "--calibration-rounds": args.calibration_rounds is not None,
        "--calibration-target": args.calibration_target is not None,
        "--calibration": args.calibration is not None,
        "--calibration-from": args.calibration_from is not None,
        "--sensitivity": args.sensitivity is not None,
    }
    if budget is None and any(compute_only.values()):
        parser.error(f"{', '.join(k for k, v in compute_only.items() if v)} only apply with --compute-budget")
    args.step_costs = args.step_costs or "calibrate"
    args.cost_clock = args.cost_clock or "wall"
    args.calibration_steps = 10 if args.calibration_steps is None else args.calibration_steps
    args.calibration_warmup = 2 if args.calibration_warmup is None else args.calibration_warmup
    args.calibration_rounds = 32 if args.calibration_rounds is None else args.calibration_rounds
    args.calibration_target = 0.01 if args.calibration_target is None else args.calibration_target
    args.sensitivity = True if args.sensitivity is None else args.sensitivity
    if args.calibration_steps < 2 or args.calibration_warmup < 0 or args.calibration_rounds < 1:
        parser.error(
            f"--calibration-steps must be >= 2, --calibration-warmup >= 0 and --calibration-rounds >= 1, got "
            f"{args.calibration_steps}, {args.calibration_warmup} and {args.calibration_rounds}"
        )
    if not 0 < args.calibration_target < 1:
        parser.error(f"--calibration-target must be in (0, 1), got {args.calibration_target}")
    if args.calibration is not None and not args.calibration.is_file():
        parser.error(f"--calibration: no such file {args.calibration}")
    if args.calibration_from is not None and not args.calibration_from.is_dir():
        parser.error(f"--calibration-from: no such directory {args.calibration_from}")
    given_costs = None
    if args.step_costs != "calibrate":
        try:
            given_costs = parse_step_costs(args.step_costs)
        except ValueError as e:
            parser.error(str(e))
    return given_costs


def _queue_runs(
    args: argparse.Namespace,
    runs_of: dict[str, tuple[str, list[str]]],
    steps_of: dict[str, int],
    seeds: list[int],
    extra: list[str],
    plan: dict[str, Any] | None,
) -> tuple[list[tuple[Path, list[str]]], list[str]]:
    """(run folder, train.py command) of every run still to train, in `plan_runs`' order, and the names of
    those among them that finished with other settings.

    A finished run is reused when it was trained with the settings this invocation gives it
    (`_finished_with_other_settings`); otherwise it is queued again, saying which settings differ,
    and moved out of the way (`_move_aside`; a `--reuse-from` link is replaced when it trains).
    """
    todo, changed = [], []
    # With several jobs at once, the costlier runs of each seed start first (plan_runs).
    cost = expected_costs(args, steps_of, runs_of, extra, plan) if args.jobs > 1 and not args.report_only else None
    for label, seed in plan_runs(list(steps_of), seeds, cost):
        strategy, variant_overrides = runs_of[label]
        run_dir = args.out / f"{label}-seed{seed}"
        steps = steps_of[label]
        cmd = train_command(
            yaml=args.yaml,
            shard_dir=args.shard_dir,
            strategy=strategy,
            seed=seed,
            steps=steps,
            eval_interval=args.eval_interval or max(1, steps // 5),  # default: 5 evaluations
            run_dir=run_dir,
            run_name=f"{args.out.name}-{label}-seed{seed}",
            budget_seconds=args.budget_seconds,
            log_selected_ids=args.log_selected_ids,
            extra=extra + variant_overrides,
        )
        if not args.rerun and not run_dir.exists() and args.reuse_from:
            if reuse_finished_run(run_dir, args.reuse_from, steps=steps, command=cmd) is not None:
                continue
        if (run_dir / "eval_results.json").exists() and not args.rerun:
            differ = _finished_with_other_settings(run_dir, cmd, steps=steps, budget_seconds=args.budget_seconds)
            if not differ:
                note = "" if (run_dir / "config.yaml").exists() else " (it has no config.yaml: only its steps were compared)"
                print(f"{run_dir.name}: already done, reusing{note}", flush=True)
                continue
            changed.append(run_dir.name)
            if args.report_only:
                then = ""
            elif run_dir.is_symlink():
                then = "; training it again here (the run it links to stays)"
            else:
                then = f"; training it again (the finished run moved to {_move_aside(run_dir)})"
            print(f"{run_dir.name}: finished with other settings ({_some(differ)}){then}", flush=True)
        todo.append((run_dir, cmd))
    return todo, changed


def _move_aside(run_dir: Path) -> Path:
    """Move a finished run of other settings, with its log, to OUT/replaced/<name> (numbered when taken); its new path."""
    dest, n = run_dir.parent / "replaced" / run_dir.name, 1
    while dest.exists() or dest.is_symlink():
        n += 1
        dest = run_dir.parent / "replaced" / f"{run_dir.name}.{n}"
    dest.parent.mkdir(exist_ok=True)
    run_dir.rename(dest)
    log = run_dir.with_suffix(".log")  # `_run_queue`'s
    if log.is_file():
        log.rename(dest / log.name)
    return dest


def _report_only_ready(
    args: argparse.Namespace, todo: list[tuple[Path, list[str]]], changed: list[str], seeds: list[int]
) -> bool:
    """`--report-only`: list the unfinished runs; False (said on stderr) when a run finished with other settings
    (the tables would report it as one of these) or the paired baseline has no finished run."""
    if changed:
        print(
            f"--report-only: {len(changed)} runs in {args.out} finished with other settings than these: "
            f"{', '.join(changed)}; give the settings they were trained with, or run without --report-only to "
            "train them again",
            file=sys.stderr,
        )
        return False
    if todo:
        print(f"--report-only: {len(todo)} runs not finished, left out: {', '.join(d.name for d, _ in todo)}")
    base = args.paired_baseline
    if base is not None and base not in collect(args.out, [base], seeds)["per_seed"]:
        print(
            f"--report-only: no finished run of the paired baseline {base!r} in {args.out}; nothing to pair "
            "against (run without --report-only to train it, or give another --paired-baseline)",
            file=sys.stderr,
        )
        return False
    return True


# What may differ between two runs of one configuration: where and under which name they are saved,
# and how often they evaluate (every run evaluates at its last step, where its results are taken).
_RUN_ONLY_KEYS = ("run_name", "save_folder", "save_interval", "save_overwrite", "save_num_checkpoints_to_keep", "eval_interval")


def reuse_finished_run(run_dir: Path, sources: list[Path], *, steps: int, command: list[str]) -> Path | None:
    """Link `run_dir` to the same run finished in another experiment's folder, instead of training it again.

    A run of `sources` qualifies when it has the same name (`<label>-seed<s>`), finished (its
    `eval_results.json`) exactly `steps` steps, and its saved `config.yaml` is the configuration
    `command` (run_dir's `train.py` command) resolves to, but for `_RUN_ONLY_KEYS`. The first that
    does is linked (a relative symlink) and returned. E.g. the random runs of an equal-steps
    experiment are its equal-compute runs too when the budget is their steps.
    """
    wanted = None
    for source in sources:
        src = source / run_dir.name
        result = src / "eval_results.json"
        if not result.exists() or json.loads(result.read_text()).get("steps") != steps:
            continue
        if not (src / "config.yaml").exists():
            continue
        if wanted is None:
            wanted = _run_config(Path(command[2]), command[3:])
        differ = _settings_differences(_run_config(None, [], saved=src / "config.yaml"), wanted)
        if differ:
            print(f"{run_dir.name}: {src} finished with other settings ({_some(differ)}); training it here", flush=True)
            continue
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        run_dir.symlink_to(os.path.relpath(src.resolve(), run_dir.parent.resolve()), target_is_directory=True)
        print(f"{run_dir.name}: reusing the finished run {src} ({steps} steps)", flush=True)
        return src
    return None


def _finished_with_other_settings(run_dir: Path, command: list[str], *, steps: int, budget_seconds: float | None) -> list[str]:
    """How the run finished in `run_dir` was trained otherwise than `command` would train it (empty: the same run).

    Its saved `config.yaml` is compared with what `command` resolves to, as `reuse_finished_run`
    does, but for `_RUN_ONLY_KEYS` (`_settings_differences`). A run without one (train.py always
    writes it; a folder made otherwise) can only be compared by its steps: the steps planned, or
    at most them with `--budget-seconds`, which stops runs early.
    """
    if (run_dir / "config.yaml").exists():
        wanted = _run_config(Path(command[2]), command[3:])
        return _settings_differences(_run_config(None, [], saved=run_dir / "config.yaml"), wanted)
    done = json.loads((run_dir / "eval_results.json").read_text()).get("steps")
    if done is None or done == steps or (budget_seconds is not None and done < steps):
        return []
    return [f"steps: {done} -> {steps}"]


def _settings_differences(saved: Any, wanted: Any, prefix: str = "") -> list[str]:
    """`key: saved -> wanted` for every setting (a dotted key) whose value differs between two `_run_config`s."""
    if isinstance(saved, dict) and isinstance(wanted, dict):
        differ = []
        for key in dict.fromkeys([*saved, *wanted]):
            differ += _settings_differences(saved.get(key, "(unset)"), wanted.get(key, "(unset)"), f"{prefix}{key}.")
        return differ
    if saved == wanted or _same_path(saved, wanted):
        return []
    saved_text, wanted_text = (text if len(text := str(v)) <= 24 else text[:21] + "..." for v in (saved, wanted))
    return [f"{prefix.removesuffix('.')}: {saved_text} -> {wanted_text}"]


def _same_path(saved: Any, wanted: Any) -> bool:
    """Two settings naming one existing file or folder, as the runs read them (from the repository's directory): a run
    saved with a relative `--shard-dir` is the same run as one given it absolute (run_experiment resolves them now)."""
    if not (isinstance(saved, str) and isinstance(wanted, str)) or "://" in saved + wanted:
        return False
    a, b = (REPO / v for v in (saved, wanted))  # an absolute path stays itself
    return a.exists() and b.exists() and a.resolve() == b.resolve()


def _some(differ: list[str], at_most: int = 3) -> str:
    """The first differences, and how many more."""
    more = f" and {len(differ) - at_most} more" if len(differ) > at_most else ""
    return ", ".join(differ[:at_most]) + more


def _run_config(yaml: Path | None, overrides: list[str], *, saved: Path | None = None) -> dict[str, Any]:
    """A run's resolved configuration without `_RUN_ONLY_KEYS`: from its yaml and overrides, or its saved config.yaml."""
    from omegaconf import OmegaConf

    from composer_algos.registry import load_run_config
    from pipeline.config import config_to_dict

    if saved is not None:
        data = OmegaConf.to_container(OmegaConf.load(saved), resolve=True)
    else:
        assert yaml is not None
        data = config_to_dict(load_run_config(yaml, overrides))
    assert isinstance(data, dict)
    return {k: v for k, v in data.items() if k not in _RUN_ONLY_KEYS}


def sensitivity_label(label: str, steps: int) -> str:
    """The name of `label`'s run at `steps` steps beside its plan (its run folders: `<name>-seed<s>`)."""
    return f"{label}@{steps}"


class PlanError(ValueError):
    """An equal-compute plan that cannot run (a missing cost, a failed calibration, a run inside its warm-up)."""


def plan_compute(
    args: argparse.Namespace,
    labels: list[str],
    runs_of: dict[str, tuple[str, list[str]]],
    seed: int,
    budget: Any,
    given_costs: dict[str, float] | None,
    extra: list[str],
    gpus: list[str],
) -> dict[str, Any]:
    """Every configuration's step cost (calibrated or given), then its steps; writes OUT/plan.json.

    With a calibration, `spread` gives each arm's relative uncertainty (`compute_plan.cost_spread`)
    and `sensitivity` the step counts on either side of its plan that the spread allows (none for an
    arm whose work is the reference's), which `--sensitivity` trains too.

    Raises:
        PlanError: a configuration without a cost, a calibration run that failed or measured
            nothing, a budget below one step, or a planned run that would end inside a warm-up
            given in `ba`. All before any comparison run starts.
    """
    from composer_algos.analysis.compute_plan import plan_steps, sensitivity_counts

    warmups = {label: _warmup_of(args.yaml, extra + runs_of[label][1]) for label in labels}  # config errors first
    calibration: dict[str, Any] = {}
    if given_costs is not None:
        costs, source, spread = dict(given_costs), "given", {}
    else:
        costs, spread, calibration = calibrate(args, labels, runs_of, seed, extra, gpus, budget.reference)
        source = "calibrated"
    unit = "CPU s" if args.cost_clock == "cpu" else "s"
    try:
        steps = plan_steps(costs, budget, labels)
    except ValueError as e:
        raise PlanError(f"--compute-budget {args.compute_budget}: {e}") from None
    reference = budget.steps * costs[budget.reference] if budget.reference is not None else budget.seconds
    sensitivity = {}
    for label, n in steps.items():
        counts = sensitivity_counts(reference, costs[label], spread.get(label, 0.0)) if args.sensitivity else []
        if counts and label != budget.reference:
            sensitivity[label] = counts
        for count in [n, *sensitivity.get(label, [])]:
            warmup = warmups[label]
            if warmup.endswith("ba") and int(float(warmup[:-2])) >= count:
                raise PlanError(
                    f"--compute-budget {args.compute_budget}: {label} would train {count} steps, inside its "
                    f"scheduler.t_warmup {warmup} (the rate would never decay); raise the budget or give the "
                    "warm-up in dur (a fraction of each run's own steps)"
                )
    plan = {
        "budget": budget.describe(unit),
        "budget_seconds": reference,
        "clock": args.cost_clock,
        "cost_source": source,
        "step_costs_s": {label: costs[label] for label in dict.fromkeys([*labels, *([budget.reference] if budget.reference else [])])},
        "spread": spread,
        "steps": steps,
        "sensitivity": sensitivity,
        "calibration": calibration,
    }
    (args.out / "plan.json").write_text(json.dumps(plan, indent=2))
    print(
        f"equal compute: {plan['budget']} ({reference:.1f} {unit} of training); step costs ({source}) "
        + ", ".join(
            f"{k} {v:.3f} {unit}" + (f" +- {100 * spread[k]:.2f}%" if spread.get(k) else "")
            for k, v in plan["step_costs_s"].items()
        )
        + "; steps "
        + ", ".join(f"{k} {v}" + (f" (also {sensitivity[k]})" if k in sensitivity else "") for k, v in steps.items()),
        flush=True,
    )
    return plan


def arm_work(yaml: Path, shard_dir: str, strategy: str, overrides: list[str]) -> tuple[str, Any]:
    """(work key, `WorkShape`) of one configuration (`compute_plan.config_work`, `work_key`).

    Raises:
        PlanError: the configuration does not load.
    """
    from composer_algos.analysis.compute_plan import config_work, work_key
    from composer_algos.registry import load_run_config
    from pipeline.config import ConfigError

    argv = [f"variables.shard_dir={shard_dir}", f"algorithms.data_selection.strategy={strategy}", *overrides]
    try:
        cfg = load_run_config(yaml, argv)
    except ConfigError as e:
        raise PlanError(f"{yaml} with {argv}: {e}") from None
    work = config_work(cfg)
    return work_key(cfg, work), work


def calibrate(
    args: argparse.Namespace,
    labels: list[str],
    runs_of: dict[str, tuple[str, list[str]]],
    seed: int,
    extra: list[str],
    gpus: list[str],
    reference: str | None,
) -> tuple[dict[str, float], dict[str, float], dict[str, Any]]:
    """Each arm's step cost from a cost model fitted to an interleaved calibration, and its spread.

    Arms are grouped by the work their steps do (`compute_plan.work_key`): one calibration per
    group, so arms of equal work (random and random_stratified) get the same cost and the same
    steps. A round runs every group once (`--calibration-warmup` untimed then `--calibration-steps`
    timed steps, first seed, no evaluation, `--jobs` at a time, the groups' order turning each
    round so that drifts in the machine's load fall on all of them); rounds go on until every
    arm's cost relative to the reference has a bootstrap spread at most `--calibration-target`, or
    `--calibration-rounds` ran. The model (`compute_plan.fit_cost_model`: seconds per training
    FLOP, per scoring FLOP, and the rest of each configuration's step) is fitted to all timed steps.

    The samples are kept in the calibration file (`--calibration`, default OUT/calibration.json)
    under each group's key and reused by any later plan on the same machine settings (clock,
    cores, jobs), so re-running a study reproduces its step counts.

    Returns:
        (costs by label, spreads by label, the calibration's summary for plan.json).

    Raises:
        PlanError: a calibration run that failed or timed nothing, a calibration file of other
            machine settings, or a missing calibration under `--report-only`.
    """
    from composer_algos.analysis.compute_plan import WorkShape, fit_cost_model

    arms = {label: arm_work(args.yaml, args.shard_dir, runs_of[label][0], extra + runs_of[label][1]) for label in labels}
    groups: dict[str, str] = {}  # work key -> the label whose command calibrates it
    for label, (key, _) in arms.items():
        groups.setdefault(key, label)
    path = args.calibration or args.out / "calibration.json"
    machine = {"clock": args.cost_clock, "cores": os.cpu_count() or 1, "jobs": args.jobs}
    known = _read_calibration(path, machine, fresh=args.rerun and args.calibration is None)
    if args.calibration_from is not None:
        _calibration_from_runs(args.calibration_from, known, groups, arms, path)
    rounds = 0
    while True:
        spread = _spread_of(known, arms, reference, machine["clock"]) if all(k in known["groups"] for k in groups) else None
        chunks = min((len(known["groups"].get(k, {}).get("chunks", [])) for k in groups), default=0)
        done = spread is not None and chunks >= 2 and max(spread.values(), default=0.0) <= args.calibration_target
        if done or chunks >= args.calibration_rounds or (args.report_only and spread is not None):
            break
        if args.report_only:
            raise PlanError(f"--report-only: no calibration for {sorted(set(groups) - set(known['groups']))} in {path}")
        order = list(groups)[rounds % len(groups) :] + list(groups)[: rounds % len(groups)]
        todo = [k for k in order if len(known["groups"].get(k, {}).get("chunks", [])) <= chunks]
        _calibration_round(args, todo, groups, runs_of, arms, known, seed, extra, gpus, path)
        rounds += 1
    assert spread is not None
    classes = {
        k: (WorkShape(**known["groups"][k]["work"]).work(known["groups"][k]["model"]), _samples(known["groups"][k], machine["clock"]))
        for k in groups
    }
    model = fit_cost_model(classes)
    costs = {label: model.step_cost(key) for label, (key, _) in arms.items()}
    worst = max(spread.values(), default=0.0)
    if worst > args.calibration_target:
        print(
            f"warning: after {chunks} calibration rounds the step costs' spread is {100 * worst:.2f}% "
            f"(target {100 * args.calibration_target:.2f}%); the sensitivity runs show what it moves",
            flush=True,
        )
    return costs, spread, _calibration_summary(path, machine, chunks, known, groups, arms, model, worst)


def _calibration_summary(
    path: Path,
    machine: dict[str, Any],
    rounds: int,
    known: dict[str, Any],
    groups: dict[str, str],
    arms: dict[str, tuple[str, Any]],
    model: Any,
    worst: float,
) -> dict[str, Any]:
    """plan.json's account of a calibration: its file, machine, rounds, timed steps, groups and fitted model."""
    return {
        "file": str(path),
        "machine": machine,
        "rounds": rounds,
        "timed_steps": {label: sum(len(c["step_times_s"]) for c in known["groups"][key]["chunks"]) for label, (key, _) in arms.items()},
        "groups": {label: key for label, (key, _) in arms.items()},
        "model": {
            "train_s_per_tflop": 1e12 * model.train_s_per_flop,
            "score_s_per_tflop": 1e12 * model.score_s_per_flop,
            "solve_s": {label: model.solve_s[key] for label, (key, _) in arms.items()},
        },
        "max_spread": worst,
        "from_runs": {groups[k]: known["groups"][k]["from_runs"] for k in groups if known["groups"][k].get("from_runs")},
    }


def _calibration_from_runs(
    runs_dir: Path, known: dict[str, Any], groups: dict[str, str], arms: dict[str, tuple[str, Any]], path: Path
) -> None:
    """Seed each group `known` has no samples for with the finished runs of its arms in `runs_dir` (one chunk a run).

    A run trained with the group's work (`<label>-seed<s>` of an arm of the group, `train_budget.json`
    written) did what a calibration round would time, on the same machine, so its timed steps are
    samples as good as a round's. Groups already calibrated keep their samples: adding the runs would
    move costs that earlier plans were made with. A run whose `train_budget.json` predates
    `cpu_step_end` is left out (its last step's CPU time may hold an evaluation callback's work); a
    group left without runs calibrates with rounds of its own.
    """
    for key, first_label in groups.items():
        if key in known["groups"]:
            continue
        labels = [label for label, (k, _) in arms.items() if k == key]
        budgets = sorted(p for label in labels for p in runs_dir.glob(f"{label}-seed*/train_budget.json"))
        chunks, used, model, stale = [], [], None, []
        for budget_path in budgets:
            budget = json.loads(budget_path.read_text())
            if budget.get("cpu_step_end") != "after_train_batch":
                stale.append(str(budget_path))
                continue
            if not budget.get("step_times_s"):
                continue
            chunks.append(_chunk_of(budget_path.parent))
            model = budget.get("model")
            used.append(str(budget_path.parent))
        if chunks:
            known["groups"][key] = {
                "label": first_label,
                "work": dataclasses.asdict(arms[first_label][1]),
                "model": model,
                "chunks": chunks,
                "from_runs": used,
            }
            print(f"calibration of {first_label}: {len(chunks)} finished runs in {runs_dir}", flush=True)
        if stale:
            print(
                f"calibration of {first_label}: {len(stale)} runs left out, written before a step's CPU time left out "
                f"the callbacks that evaluate at its end (e.g. {stale[0]})" + ("" if chunks else "; calibrating with rounds"),
                flush=True,
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(known, indent=1))


def _read_calibration(path: Path, machine: dict[str, Any], *, fresh: bool) -> dict[str, Any]:
    """The calibration file's content ({"machine", "groups"}); empty when absent, of an older format or `fresh`.

    Raises:
        PlanError: the file was measured with other machine settings (clock, cores or jobs).
    """
    empty = {"format": 2, "machine": machine, "groups": {}}
    if fresh or not path.exists():
        return empty
    data = json.loads(path.read_text())
    if data.get("format") != 2:
        print(f"{path}: a calibration of an older format; calibrating anew", flush=True)
        return empty
    if data.get("machine") != machine:
        raise PlanError(
            f"{path} was measured with {data.get('machine')}, this plan runs with {machine}; give the same "
            "--cost-clock and --jobs, or --rerun to calibrate anew"
        )
    return data


# Callbacks that evaluate and so need the eval_loader, which calibration runs drop (they time training only).
_EVALUATION_CALLBACKS = ("answer_accuracy",)


def _without_evaluation_callbacks(yaml_path: Path) -> list[str]:
    """`~callbacks.<name>` overrides removing the yaml's evaluation callbacks from a calibration run."""
    from omegaconf import OmegaConf

    callbacks = OmegaConf.load(yaml_path).get("callbacks") or {}
    return [f"~callbacks.{name}" for name in _EVALUATION_CALLBACKS if name in callbacks]


def _calibration_round(
    args: argparse.Namespace,
    todo: list[str],
    groups: dict[str, str],
    runs_of: dict[str, tuple[str, list[str]]],
    arms: dict[str, tuple[str, Any]],
    known: dict[str, Any],
    seed: int,
    extra: list[str],
    gpus: list[str],
    path: Path,
) -> None:
    """One chunk of each group in `todo` (in that order, `--jobs` at a time); its samples appended to `path`."""
    total = args.calibration_warmup + args.calibration_steps
    queue = []
    no_evaluation_callbacks = _without_evaluation_callbacks(args.yaml)  # the yaml, read once a round
    for key in todo:
        label = groups[key]
        strategy, variant_overrides = runs_of[label]
        index = len(known["groups"].get(key, {}).get("chunks", []))
        run_dir = args.out / "calibration" / key / f"chunk{index}"
        cmd = train_command(
            yaml=args.yaml,
            shard_dir=args.shard_dir,
            strategy=strategy,
            seed=seed,
            steps=total,
            eval_interval=total,
            run_dir=run_dir,
            run_name=f"{args.out.name}-calibration-{label}-{index}",
            extra=extra + variant_overrides + ["eval_loader=null", *no_evaluation_callbacks,
                                                 f"callbacks.train_budget.warmup_steps={args.calibration_warmup}"],
        )
        queue.append((run_dir, cmd))
    print(
        f"calibration round: {len(queue)} configurations, {args.calibration_steps} timed steps each after "
        f"{args.calibration_warmup} ({', '.join(groups[k] for k in todo)})",
        flush=True,
    )
    failed = _run_queue(list(queue), jobs=args.jobs, gpus=gpus, budget_seconds=None)
    if failed:
        raise PlanError(f"calibration runs failed: {failed} (see their logs in {args.out / 'calibration'})")
    for key, (run_dir, _) in zip(todo, queue):
        budget = json.loads((run_dir / "train_budget.json").read_text()) if (run_dir / "train_budget.json").exists() else {}
        if not budget.get("step_times_s"):
            raise PlanError(f"calibration of {groups[key]} timed no step ({run_dir / 'train_budget.json'})")
        group = known["groups"].setdefault(
            key, {"label": groups[key], "work": dataclasses.asdict(arms[groups[key]][1]), "model": budget.get("model"), "chunks": []}
        )
        group["chunks"].append(_chunk_of(run_dir))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(known, indent=1))


def _chunk_of(run_dir: Path) -> dict[str, list[float]]:
    """One calibration chunk: a finished run's timed steps and their selection parts, on both clocks."""
    wall, cpu = _read_samples(run_dir, "wall"), _read_samples(run_dir, "cpu")
    return {
        "step_times_s": list(wall.step_s),
        "step_cpu_times_s": list(cpu.step_s),
        "features_s": list(wall.features_s),
        "selection_s": list(wall.selection_s),
        "features_cpu_s": list(cpu.features_s),
        "selection_cpu_s": list(cpu.selection_s),
    }


def _read_samples(run_dir: Path, clock: str) -> Any:
    from composer_algos.analysis.compute_plan import read_step_samples

    return read_step_samples(run_dir, clock)[0]


def _samples(group: dict[str, Any], clock: str) -> Any:
    """A group's `StepSamples` on `clock`, all its chunks together."""
    from composer_algos.analysis.compute_plan import StepSamples

    cpu = clock == "cpu"
    chunks = group["chunks"]
    pick = lambda wall_key, cpu_key: tuple(x for c in chunks for x in c[cpu_key if cpu else wall_key])  # noqa: E731
    return StepSamples(
        step_s=pick("step_times_s", "step_cpu_times_s"),
        features_s=pick("features_s", "features_cpu_s"),
        selection_s=pick("selection_s", "selection_cpu_s"),
    )


def _spread_of(known: dict[str, Any], arms: dict[str, tuple[str, Any]], reference: str | None, clock: str) -> dict[str, float]:
    """Each arm's bootstrap spread (`compute_plan.cost_spread`) from the samples so far."""
    from composer_algos.analysis.compute_plan import WorkShape, cost_spread

    keys = {key for key, _ in arms.values()}
    classes = {k: (WorkShape(**known["groups"][k]["work"]).work(known["groups"][k]["model"]), _samples(known["groups"][k], clock)) for k in keys}
    return cost_spread(classes, {label: key for label, (key, _) in arms.items()}, reference=reference)


def _warmup_of(yaml: Path, overrides: list[str]) -> str:
    """The run's `scheduler.t_warmup`, from its yaml and overrides.

    Raises:
        PlanError: the configuration does not load (its message lists every bad key).
    """
    from pipeline.config import ConfigError, load_config

    try:
        return str(load_config(yaml, overrides).scheduler.t_warmup)
    except ConfigError as e:
        raise PlanError(f"{yaml} with {overrides}: {e}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _add_run_options(parser)
    _add_compute_budget_options(parser)
    _add_time_budget_and_report_options(parser)
    _add_queue_options(parser)
    return parser


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """The yaml, shards, strategies, variants and seeds of the runs, and `--steps`."""
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
        help="training steps of every run (with --budget-seconds: the step cap and the schedule's horizon)",
    )


def _add_compute_budget_options(parser: argparse.ArgumentParser) -> None:
    """`--compute-budget` and the options of its step costs: given, or calibrated (rounds, target, files)."""
    parser.add_argument(
        "--compute-budget",
        default=None,
        help="equal compute: LABEL=N (the cost of N steps of LABEL, one of --strategies, a --variant's name or a "
        "label of --step-costs; e.g. random=200) or SECONDS of training; "
        "each run trains the steps its measured step cost fits, its schedule (warm-up, decay) over its own steps",
    )
    parser.add_argument(
        "--step-costs",
        default=None,
        help="with --compute-budget: 'calibrate' (default: a short run of each configuration measures it) or "
        "LABEL=SECONDS,... seconds of training per step (e.g. from tools/bench/bench_step.py)",
    )
    parser.add_argument(
        "--cost-clock",
        choices=("wall", "cpu"),
        default=None,
        help="with --compute-budget: the clock step costs and a budget in seconds are measured on: 'wall' "
        "(default: Composer's training wall clock) or 'cpu' (the training process's CPU time, evaluation "
        "excluded: steadier on a CPU shared with other jobs)",
    )
    parser.add_argument(
        "--calibration-steps", type=int, default=None, help="timed steps of each calibration run (default 10)"
    )
    parser.add_argument(
        "--calibration-warmup",
        type=int,
        default=None,
        help="steps of a calibration run before the timed ones (default 2; lazy state is built there)",
    )
    parser.add_argument(
        "--calibration-rounds",
        type=int,
        default=None,
        help="at most this many calibration runs per configuration (default 32: with steps of 10%% CPU-time "
        "noise a 1%% spread took about 28 rounds of 10 on the 2-core machine); rounds stop earlier once every arm's cost spread is "
        "within --calibration-target",
    )
    parser.add_argument(
        "--calibration-target",
        type=float,
        default=None,
        help="the relative spread (bootstrap standard deviation) of each arm's step cost against the "
        "reference's that ends the calibration (default 0.01)",
    )
    parser.add_argument(
        "--calibration",
        type=Path,
        default=None,
        help="the calibration file to read and extend (default OUT/calibration.json): give another "
        "experiment's to plan with its measured costs on the same machine settings",
    )
    parser.add_argument(
        "--calibration-from",
        type=Path,
        default=None,
        help="a directory of finished runs of these configurations (e.g. this study's equal-steps OUT): a "
        "group the calibration file has no samples for takes each finished run's timed steps as one "
        "calibration round instead of running its own (the runs must have been trained with the same "
        "--jobs on this machine); groups with samples keep them",
    )
    parser.add_argument(
        "--sensitivity",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --compute-budget (default on): also train each arm whose cost carries calibration "
        "noise at its planned steps minus and plus that noise's worth of steps, and report whether its "
        "verdict holds across them",
    )


def _add_time_budget_and_report_options(parser: argparse.ArgumentParser) -> None:
    """`--budget-seconds`, then what the reports hold (paired baseline, selected ids, evaluations) and `--out`."""
    parser.add_argument(
        "--budget-seconds",
        type=float,
        default=None,
        help="stop each run once it has trained this many seconds (evaluation excluded); needs --steps, the "
        "schedule's horizon, so a run stopped early is not decayed (prefer --compute-budget)",
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
        "--eval-interval", type=int, default=None, help="evaluate every N steps (default: a run's steps/5)"
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")


def _add_queue_options(parser: argparse.ArgumentParser) -> None:
    """Which runs train (rerun, reuse, report only) and how many at a time, on which GPUs."""
    parser.add_argument("--rerun", action="store_true", help="rerun runs that already have results")
    parser.add_argument(
        "--reuse-from",
        type=Path,
        action="append",
        default=[],
        help="another experiment's output folder (repeatable): a run finished there under the same name and "
        "with the steps planned here is linked instead of trained again (e.g. random's equal-steps runs, "
        "which are its equal-compute runs when the budget is their steps)",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="train nothing: write the tables from the runs already finished in --out (the rest are listed as "
        "missing; a run finished with other settings stops it)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time (default 1); each gets cores/jobs threads (OMP_NUM_THREADS), on GPUs "
        "give each job its own device with CUDA_VISIBLE_DEVICES in --gpus",
    )
    parser.add_argument("--gpus", default=None, help="comma-separated GPU ids handed out to jobs in turn")


def known_strategies() -> tuple[str, ...]:
    """What `algorithms.data_selection.strategy` accepts (the algorithm's names, plugins included).

    Imported here, after argument parsing, so `--help` stays free of torch and Composer.
    """
    from composer_algos.data_selection.algorithm import SELECTION_STRATEGIES
    from composer_algos.selection import strategy_names

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


def plan_runs(strategies: list[str], seeds: list[int], cost: dict[str, float] | None = None) -> list[tuple[str, int]]:
    """(strategy, seed) in seed-major order: every strategy's seed 1 before any seed 2.

    Within a seed the costlier runs come first (`cost`: a label's expected cost, in any unit; ties
    keep the given order), so that `--jobs` > 1 starts the long runs while the short ones fill the
    other slots, and the last seed does not end with its longest run alone.
    """
    order = sorted(strategies, key=lambda s: -(cost or {}).get(s, 0.0))
    return [(s, seed) for seed in seeds for s in order]


def expected_costs(
    args: argparse.Namespace, steps_of: dict[str, int], runs_of: dict[str, tuple[str, list[str]]], extra: list[str],
    plan: dict[str, Any] | None,
) -> dict[str, float]:
    """Each label's expected cost, only to order the queue: steps x the plan's step cost at equal compute;
    otherwise steps x a proxy of the step's work (rows x width trained, 3 passes, plus the same for the
    rows a model pass scores: `compute_plan.config_work`, no model needed)."""
    out = {}
    for label, steps in steps_of.items():
        base = label.split("@", 1)[0]  # a sensitivity run `<label>@<steps>` costs what its arm's steps do
        if plan is not None and base in plan["step_costs_s"]:
            out[label] = steps * plan["step_costs_s"][base]
            continue
        _, work = arm_work(args.yaml, args.shard_dir, runs_of[label][0], extra + runs_of[label][1])
        scored = (work.pool_rows + work.val_rows) * work.scored_width if work.solver is not None else 0
        out[label] = steps * 3.0 * (work.train_rows * work.train_width + scored)
    return out


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
    plan: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write (and print) the comparison, the paired comparison and the selection report.

    `plan` is an equal-compute plan (`plan_compute`): the budget, the step costs and each
    configuration's steps, stated above the table and listed per run.
    """
    from composer_algos.analysis.experiment_stats import format_paired_markdown, paired_comparison

    table = collect(out, strategies, seeds, plan=plan)
    md = format_markdown(table, steps, budget_seconds=budget_seconds, plan=plan)
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
        if paired_baseline in table.get("per_seed_accuracy", {}):
            accuracy = paired_comparison(table["per_seed_accuracy"], baseline=paired_baseline)
            accuracy_md = format_paired_markdown(accuracy).replace(
                "final validation log-perplexity", "exact-match answer accuracy"
            ).replace("negative = lower loss than", "positive = more answers right than")
            print("\n" + accuracy_md)
            (out / "paired_accuracy.md").write_text(accuracy_md + "\n")
            (out / "paired_accuracy.json").write_text(json.dumps(accuracy, indent=2))
            written += [out / "paired_accuracy.md", out / "paired_accuracy.json"]
        if plan is not None and plan.get("sensitivity"):
            written += write_sensitivity(out, plan, seeds, baseline=paired_baseline)
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


def write_sensitivity(out: Path, plan: dict[str, Any], seeds: list[int], *, baseline: str) -> list[Path]:
    """OUT/sensitivity.md and .json: each arm's difference from `baseline` at the edges of its calibration noise."""
    from composer_algos.analysis.experiment_stats import format_sensitivity_markdown, sensitivity

    counts = plan["sensitivity"]
    labels = [baseline, *counts, *(sensitivity_label(a, n) for a, ns in counts.items() for n in ns)]
    per_seed = collect(out, list(dict.fromkeys(labels)), seeds)["per_seed"]
    result = sensitivity(per_seed, counts, plan["steps"], baseline=baseline, label_at=sensitivity_label)
    md = format_sensitivity_markdown(result, baseline=baseline)
    print("\n" + md)
    (out / "sensitivity.md").write_text(md + "\n")
    (out / "sensitivity.json").write_text(json.dumps(result, indent=2))
    return [out / "sensitivity.md", out / "sensitivity.json"]


def collect(out: Path, strategies: list[str], seeds: list[int], *, plan: dict[str, Any] | None = None) -> dict:
    """Aggregate every run's eval_results.json (and train_budget.json) into mean and std per strategy.

    Also keeps each run's final losses under `per_seed[strategy][seed]` for the paired comparison,
    and under `runs` each run's planned and trained steps, training and wall time and estimated
    FLOPs (`composer_algos.analysis.compute_plan.estimate_run_flops`; None where the run lacks the counts).
    """
    from composer_algos.analysis.compute_plan import estimate_run_flops

    table: dict = {"strategies": {}, "seeds": seeds, "per_seed": {}, "runs": []}
    for strategy in strategies:
        per_seed = {}
        for seed in seeds:
            run_dir = out / f"{strategy}-seed{seed}"
            path = run_dir / "eval_results.json"
            if path.exists():
                r = json.loads(path.read_text())
                budget_path = run_dir / "train_budget.json"
                budget = json.loads(budget_path.read_text()) if budget_path.exists() else {}
                r["train_time_s"] = budget.get("train_time_s", math.nan)
                r["flops"] = estimate_run_flops(run_dir)
                per_seed[seed] = r
                table["runs"].append(
                    {
                        "label": strategy,
                        "seed": seed,
                        "planned_steps": (plan or {}).get("steps", {}).get(strategy),
                        "steps": r.get("steps"),
                        "train_time_s": r["train_time_s"],
                        "train_cpu_s": budget.get("train_cpu_s"),
                        "step_time_s": budget.get("step_time_s"),
                        "wall_time_s": r["wall_time_s"],
                        "flops": r["flops"],
                    }
                )
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
        entry["flops"] = _mean_std([r["flops"]["total"] if r["flops"] else math.nan for r in runs])
        table["strategies"][strategy] = entry
        table["per_seed"][strategy] = {
            seed: {"average": r["val_cross_entropy_mean"], "domains": dict(r["val_cross_entropy"])}
            for seed, r in per_seed.items()
            if r["val_cross_entropy_mean"] is not None
        }
        # Exact-match accuracy of greedy answers (the answer_accuracy callback), where the runs measured it.
        accuracy = {
            seed: {"average": r["answer_accuracy_mean"], "domains": dict(r.get("answer_accuracy") or {})}
            for seed, r in per_seed.items()
            if r.get("answer_accuracy_mean") is not None
        }
        if accuracy:
            table.setdefault("per_seed_accuracy", {})[strategy] = accuracy
            entry["accuracy"] = _mean_std([a["average"] for a in accuracy.values()])
    return table


def format_markdown(
    table: dict, steps: int | None, *, budget_seconds: float | None = None, plan: dict[str, Any] | None = None
) -> str:
    """The comparison as a markdown table (mean +- std over seeds), then one row per run."""
    strategies = list(table["strategies"])
    if not strategies:
        return "(no finished runs)"
    domains = list(table["strategies"][strategies[0]]["domains"])
    with_accuracy = any("accuracy" in table["strategies"][s] for s in strategies)
    head = ["strategy", *domains, "average", *(["accuracy"] if with_accuracy else []), "steps", "train s", "wall s",
            "selection %", "est. FLOPs"]
    if plan is not None:
        costs = ", ".join(f"{k} {v:.3f}" for k, v in plan["step_costs_s"].items())
        unit = "CPU s" if plan.get("clock") == "cpu" else "s"
        budget = (
            f"equal compute: {plan['budget']} ({plan['budget_seconds']:.1f} {unit} of training) each; every "
            f"run trains the steps its step cost fits, its learning-rate schedule laid over them ({unit} per "
            f"step, {plan['cost_source']}: {costs})"
        )
    elif budget_seconds is not None:
        budget = (
            f"an equal training-time budget of {budget_seconds:g} s each (evaluation excluded; the "
            f"schedule laid over {steps} steps, the step cap, so a run stopped earlier is not decayed)"
        )
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
        if with_accuracy:
            cells.append(_fmt(e.get("accuracy")))
        wall = e["wall_time_s"]["mean"]
        sel = e["selection_time_s"]["mean"]
        train_s = e["train_time_s"]["mean"]
        cells += [
            f"{e['steps']['mean']:.0f}" if math.isfinite(e["steps"]["mean"]) else "-",
            f"{train_s:.0f}" if math.isfinite(train_s) else "-",
            f"{wall:.0f}",
            f"{100 * sel / wall:.1f}" if wall > 0 else "-",
            _flops(e["flops"]["mean"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Per run: steps planned and trained; training time (evaluation excluded) on the wall clock and in "
        "the process's CPU time; s / step, the wall clock's mean after the first step; wall time with "
        "evaluation; estimated FLOPs (training: 3 forwards of the trained rows, fewer with LoRA; selection: the feature "
        "pass's floor on the scored rows; composer_algos/analysis/compute_plan.py)",
        "",
        "| run | seed | planned steps | steps | train s | train CPU s | s / step | wall s | FLOPs train "
        "| FLOPs selection | FLOPs total |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table.get("runs", []):
        f = r["flops"] or {}
        steps_done, train_s = r["steps"], r["train_time_s"]
        cells = [
            r["label"],
            str(r["seed"]),
            "-" if r["planned_steps"] is None else str(r["planned_steps"]),
            "-" if steps_done is None else str(steps_done),
            f"{train_s:.1f}" if math.isfinite(train_s) else "-",
            "-" if r.get("train_cpu_s") is None else f"{r['train_cpu_s']:.1f}",
            "-" if r.get("step_time_s") is None else f"{r['step_time_s']:.3f}",
            f"{r['wall_time_s']:.1f}",
            _flops(f.get("train")),
            _flops(f.get("selection")),
            _flops(f.get("total")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _flops(value: float | None) -> str:
    return f"{value:.3g}" if value is not None and math.isfinite(value) else "-"


def selection_report(
    out: Path, strategies: list[str], seeds: list[int], *, reference: str = "random"
) -> dict:
    """Per strategy: conflict fraction, induced vs natural mixture and, when logged, overlap with `reference`.

    The induced mixture (`mixture.json` weights: the mean over steps of each domain's share of
    the trained examples) and the natural one (`mixture.json` natural: each domain's share of the
    training split's examples) are both in examples. Overlaps use `selected_ids.jsonl`: for each
    seed the strategy's pools are first checked against the reference's at every step.
    """
    from composer_algos.analysis.experiment_stats import read_selected_ids, selection_overlap
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
) -> list[str]:
    """Run the queued trainings, `jobs` at a time, in order; returns the names of the failed runs."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    running: list[tuple[Path, subprocess.Popen, float, Any]] = []
    started = 0
    failed = []
    while todo or running:
        while todo and len(running) < jobs:
            run_dir, cmd = todo.pop(0)
            _empty_run_dir(run_dir)
            env = run_env(
                dict(os.environ), jobs=jobs, cores=cores, gpu=gpus[started % len(gpus)] if gpus else None
            )
            log = open(run_dir.with_suffix(".log"), "w")
            started += 1
            steps = next(a for a in cmd if a.startswith("max_duration=")).split("=", 1)[1].removesuffix("ba")
            what = f"{steps} steps" + (f" or {budget_seconds:g} s of training" if budget_seconds is not None else "")
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
                print(f"  {run_dir.name} failed (exit {proc.returncode}); see {log.name}{_last_error(Path(log.name))}", flush=True)
            else:
                print(f"  {run_dir.name} done in {time.perf_counter() - t0:.0f}s", flush=True)
    return failed


def _last_error(log_path: Path) -> str:
    """The last line of a failed run's log that says why (an exception or train.py's message), quoted, or ''."""
    try:
        lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    why = [line for line in lines if line.startswith("train.py:") or re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line)]
    return f"\n    {why[-1][:400]}" if why else ""


def _empty_run_dir(run_dir: Path) -> None:
    """An empty `run_dir` for a training to start in.

    What an earlier training left there goes: evaluations are appended to `eval_history.csv`, and a
    result or log the new run does not rewrite (its `eval_results.json` while it trains, a
    `selected_ids.jsonl` it does not log) would be read as its own. A link (`--reuse-from`) is
    removed, not trained through: the run it links to, another experiment's, stays as it is.
    """
    if run_dir.is_symlink():
        run_dir.unlink()
    elif run_dir.is_dir():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)


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
