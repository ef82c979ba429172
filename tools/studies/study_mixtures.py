"""The mixture study of issue 21.5: does PartitionSel, allowed to move budget between domains, move it
toward the domains the validation set needs, and does that train better? (docs/results/mixtures.md)

Corpora (--corpus): dm_math (8 unequal math domains, question -> answer; yamls/study/dm_math.yaml,
shards made as tools/studies/study_dm_math.py makes them) and ghpile (6 sources of long documents, 512-token
rows; yamls/study/ghpile.yaml, shards from `tools/studies/study_ghpile.py --parts setup`), or both.

Parts (each reuses what an earlier, interrupted invocation finished):
  doremi  the project's three DoReMi stages on the study's shards and tokenizer: (a) reference, the
          study yaml's model trained on the natural mixture (no selection, 16 rows a step), (b) proxy,
          the same with the `doremi` algorithm against the frozen reference: its
          OUT/<corpus>/doremi/proxy/doremi/mixture.json is the weights file every DoReMi arm reads;
          (c) main, the model trained on streams in DoReMi's proportions, runs inside `study` as the
          arm doremi_main (so it is paired and seeded like the others). Stage yamls: the study yaml
          with `algorithms.data_selection` replaced (OUT/<corpus>/doremi/{reference,proxy}.yaml).
  study   one tools/run_experiment.py per corpus at equal steps, --seeds, paired against proportional
          PartitionSel (the label `partitionsel`), arms (ARMS): slack 1.5, 2 and unbounded; adaptive;
          capacities in DoReMi's proportions (`fractions` from the proxy's weights file);
          the domain-balanced validation target; DoReMi's stage (c); random and ID for the conflict
          fraction. Random computes no gradient features, so its arm sets
          `algorithms.data_selection.log_conflicts: true`: the pool's features are computed for the
          log only (its picks are unchanged; its steps cost a feature pass more, which an
          equal-steps comparison does not charge). Selected ids are logged (a few ints a step).
  report  OUT/mixtures.md: per corpus the paired table (per-domain and average held-out loss, arm
          minus proportional PartitionSel, 95% t intervals, from paired.json), each arm's induced
          mixture (mean over steps and seeds of its share of the trained examples,
          mixture_steps.csv), its total-variation distance from the natural mixture (the training
          split's example shares, selection.json) and from DoReMi's weights, its signed departure
          from the natural mixture per domain, and its conflict fraction (selection.json); and
          OUT/<corpus>_mixture.png, the induced mixture against step per arm (seed-mean; thin: per
          step, thick: running mean, dashed: capacities or slack bounds) with DoReMi's weights as
          dotted horizontal lines. Proportional PartitionSel's TV from the natural mixture is the
          measure of what rounding and pool noise alone give: a departure is one well above it.

Example:
    python tools/studies/study_mixtures.py --out runs/mixtures --corpus both --parts doremi,study,report --jobs 2
    python tools/studies/study_mixtures.py --out runs/mixtures --corpus dm_math --parts report   # tables from what finished
    python tools/studies/study_mixtures.py --out /tmp/mx --corpus dm_math --steps 4 --seeds 1    # a smoke test

Every DoReMi stage runs with one thread (OMP_NUM_THREADS=1); run_experiment gives each of its --jobs
trainings cores / jobs threads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import study_dm_math  # noqa: E402  (tools/studies/study_dm_math.py: its yaml, data and shard layout)
import study_ghpile  # noqa: E402  (tools/studies/study_ghpile.py: its yaml, shards, overrides and job queue)

PARTS = ("doremi", "study", "report")
CORPORA = ("dm_math", "ghpile")
SEL = study_ghpile.SEL
BASELINE = "partitionsel"  # proportional capacities, the library's default policy
# Overrides of every arm (and, those outside algorithms.*, of the DoReMi stages). A 16-row guide: the
# adaptive policy's per-domain utilities and the domain-balanced target read each domain's validation
# rows, and 4 rows a step leave most of dm_math's 8 domains unseen every step; every arm gets the same
# guide so that only the capacities (or the target) differ from the baseline. ghpile's are its study's.
DM_MATH_OVERRIDES = [f"{SEL}.validation.batch_size=16"]


@dataclass(frozen=True)
class Corpus:
    """Where a corpus's study reads from and what every run of it gets."""

    name: str
    yaml: Path
    shards: Path
    steps: int  # the default equal-steps length (that corpus's own study's)
    overrides: tuple[str, ...]
    final_eval_only: bool  # evaluate at the last step only (else run_experiment's default: 5 evaluations)


def corpora(dm_math_root: Path, ghpile_root: Path) -> dict[str, Corpus]:
    """The two corpora, from the other studies' constants (their shard layouts and run settings)."""
    return {
        "dm_math": Corpus(
            "dm_math", study_dm_math.YAML, dm_math_root / "shards" / "dm_math", 200, tuple(DM_MATH_OVERRIDES), False
        ),
        # Evaluation only at the last step: ghpile's evaluation documents cost about 16 random steps a pass.
        # Every arm scores the first 64 tokens of each row (the pretraining recipe's setting,
        # yamls/llama1b_dolma.yaml): the ghpile study put it level with whole rows at equal steps (-0.076
        # against -0.097, both minus random) at 1.04x random's step cost instead of 2.4x, which is what
        # fits this study's 30 runs in about an hour on two cores.
        "ghpile": Corpus(
            "ghpile", study_ghpile.YAML, ghpile_root / "shards" / "s512", 80,
            ("variables.max_seq_len=512", *study_ghpile.STUDY_OVERRIDES, f"{SEL}.features.score_window=64"), True,
        ),
    }


def doremi_weights_path(out: Path, corpus: str) -> Path:
    """The proxy's learned weights (this project's mixture.json; `capacities: fractions` reads it)."""
    return out / corpus / "doremi" / "proxy" / "doremi" / "mixture.json"


def arms(weights_file: Path) -> dict[str, tuple[str, list[str]]]:
    """label -> (strategy, overrides): every arm of the study (the baseline first).

    Overrides hold no commas (run_experiment's --variant splits on them): mappings are spelled key by key.
    """
    caps = f"{SEL}.capacities"
    return {
        BASELINE: ("partitionsel", []),
        "ps_slack1_5": ("partitionsel", [f"{caps}.policy=slack", f"{caps}.factor=1.5"]),
        "ps_slack2": ("partitionsel", [f"{caps}.policy=slack", f"{caps}.factor=2"]),
        # factor inf: upper bounds at the pool's counts, domain-free selection (capacity_policy.SlackPolicy)
        "ps_slack_inf": ("partitionsel", [f"{caps}.policy=slack", f"{caps}.factor=inf"]),
        "ps_adaptive": ("partitionsel", [f"{caps}=adaptive"]),
        "ps_doremi": ("partitionsel", [f"{caps}.policy=fractions", f"{caps}.file={weights_file}"]),
        "ps_balanced": ("partitionsel", [f"{SEL}.validation.target=domain_balanced"]),
        # DoReMi's stage (c): streams in DoReMi's proportions, a random half of each pool trained on.
        "doremi_main": ("random", [f"train_loader.dataset.domain_weights_file={weights_file}"]),
        "random": ("random", [f"{SEL}.log_conflicts=true"]),
        "id": ("id", []),
    }


def study_command(
    corpus: Corpus, *, out: Path, seeds: str, steps: int, jobs: int, weights_file: Path,
    only: list[str] | None = None,
) -> list[str]:
    """The tools/run_experiment.py command of one corpus's study (equal steps, paired against the baseline).

    `only`: a subset of the arms (the baseline is always run).
    """
    chosen = {k: v for k, v in arms(weights_file).items() if only is None or k == BASELINE or k in only}
    plain = [label for label, (strategy, extra) in chosen.items() if not extra and label == strategy]
    cmd = [
        sys.executable, "tools/run_experiment.py", "--yaml", str(corpus.yaml), "--shard-dir", str(corpus.shards),
        "--strategies", ",".join(plain), "--seeds", seeds, "--steps", str(steps),
        "--paired-baseline", BASELINE, "--jobs", str(jobs), "--log-selected-ids",
        "--out", str(out / corpus.name / "study"),
    ]
    if corpus.final_eval_only:
        cmd += ["--eval-interval", str(steps)]
    for label, (strategy, extra) in chosen.items():
        if label not in plain:
            cmd += ["--variant", ",".join([f"{label}={strategy}", *extra])]
    return cmd + ["--", *corpus.overrides]


# ----------------------------------------------------------------------------- DoReMi


def doremi_stage_yaml(corpus: Corpus, stage: str, *, reference: Path | None = None) -> str:
    """The study yaml with `algorithms.data_selection` replaced: none (reference) or `doremi` (proxy)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(corpus.yaml)
    cfg.algorithms = {}
    if stage == "proxy":
        assert reference is not None
        # The paper's settings (docs/doremi.md): eta_dro 1, smoothing 1e-3, from uniform weights.
        cfg.algorithms = {
            "doremi": {"reference": str(reference), "eta_dro": 1.0, "smoothing": 1.0e-3, "initial_weights": "uniform"}
        }
    elif stage != "reference":
        raise ValueError(f"stage must be reference or proxy, got {stage!r}")
    head = (
        f"# DoReMi stage {'(a) reference' if stage == 'reference' else '(b) proxy'} for the mixture study "
        f"(tools/studies/study_mixtures.py), generated from {corpus.yaml.relative_to(REPO)}: its model, data and\n"
        "# recipe, without data selection (16 rows a step from the natural mixture).\n"
    )
    return head + OmegaConf.to_yaml(cfg)


def doremi_commands(corpus: Corpus, *, out: Path, steps: int) -> list[tuple[str, Path, Path, list[str]]]:
    """(stage, yaml to write, run directory, train.py command) of the reference and the proxy."""
    root = out / corpus.name / "doremi"
    tail = [o for o in corpus.overrides if not o.startswith("algorithms.")]
    result = []
    for stage in ("reference", "proxy"):
        run_dir = root / stage
        yaml = root / f"{stage}.yaml"
        cmd = [
            sys.executable, str(REPO / "train.py"), str(yaml), f"variables.shard_dir={corpus.shards}",
            f"max_duration={steps}ba", f"save_folder={run_dir}", f"save_interval={steps}ba", "save_overwrite=true",
            "eval_loader=null", f"run_name=mixtures-{corpus.name}-doremi-{stage}", *tail,
        ]
        result.append((stage, yaml, run_dir, cmd))
    return result


def run_doremi(corpus_list: list[Corpus], *, out: Path, steps_of: dict[str, int], jobs: int) -> None:
    """Stages (a) then (b) of every corpus (the corpora's stages side by side, `jobs` at a time)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for stage in ("reference", "proxy"):
        todo = []
        for corpus in corpus_list:
            for name, yaml, run_dir, cmd in doremi_commands(corpus, out=out, steps=steps_of[corpus.name]):
                if name != stage:
                    continue
                done = run_dir / "latest-rank0.pt" if stage == "reference" else doremi_weights_path(out, corpus.name)
                if done.exists():
                    continue
                reference = out / corpus.name / "doremi" / "reference" / "latest-rank0.pt"
                yaml.parent.mkdir(parents=True, exist_ok=True)
                yaml.write_text(doremi_stage_yaml(corpus, stage, reference=reference))
                todo.append((run_dir, cmd))
        study_ghpile._queue(todo, env, jobs=jobs)


# ----------------------------------------------------------------------------- report


def seed_mean_trajectory(study: Path, label: str, seeds: list[int], *, file: str = "mixture_steps.csv"):
    """(steps, names, shares_SC) averaged over the seeds' `file` on the steps every seed logged; None if none did."""
    import numpy as np

    from composer_algos.mixture_io import read_mixture_csv

    tables = []
    for seed in seeds:
        path = study / f"{label}-seed{seed}" / file
        if path.is_file():
            steps, names, values = read_mixture_csv(path)
            if steps:
                tables.append((steps, names, values))
    if not tables:
        return None
    names = tables[0][1]
    common = sorted(set.intersection(*(set(s) for s, _, _ in tables)))
    stacked = []
    for steps, n, values in tables:
        row_of = {s: i for i, s in enumerate(steps)}
        cols = [n.index(x) for x in names]
        stacked.append(values[[row_of[s] for s in common]][:, cols])
    return common, names, np.mean(stacked, axis=0)


def induced_per_seed(study: Path, label: str, seeds: list[int]) -> dict[int, dict[str, float]]:
    """seed -> the arm's mean share per domain over that seed's logged steps (mixture_steps.csv)."""
    from composer_algos.mixture_io import read_mixture_csv

    result = {}
    for seed in seeds:
        path = study / f"{label}-seed{seed}" / "mixture_steps.csv"
        if path.is_file():
            steps, names, values = read_mixture_csv(path)
            if steps:
                result[seed] = dict(zip(names, values.mean(axis=0).tolist()))
    return result


def seed_mean(per_seed: dict[int, dict[str, float]]) -> dict[str, float] | None:
    """The mean over seeds of per-seed mixtures (missing domains count as 0); None without any seed."""
    if not per_seed:
        return None
    names = sorted(set().union(*per_seed.values()))
    return {n: sum(m.get(n, 0.0) for m in per_seed.values()) / len(per_seed) for n in names}


def departure_from_baseline(
    arm: dict[int, dict[str, float]], base: dict[int, dict[str, float]], *,
    reference: dict[str, float] | None, natural: dict[str, float] | None,
) -> tuple[float | None, float | None]:
    """(TV, toward) from per-seed induced mixtures (`induced_per_seed`) of an arm and of proportional
    PartitionSel: how far the arm moved from the baseline on the same seed (the same pools, so what the pools'
    own drift gives cancels), the total-variation distance per seed averaged over the seeds both finished; and
    the cosine of the seed-mean move (arm - baseline) with the reference's (DoReMi's weights - natural), None
    where either did not move."""
    from composer_algos.doremi.compare import total_variation

    common = [s for s in arm if s in base]
    if not common:
        return None, None
    arm_mean, base_mean = seed_mean({s: arm[s] for s in common}), seed_mean({s: base[s] for s in common})
    names = sorted(set(arm_mean) | set(base_mean))
    tv = sum(total_variation(arm[s], base[s], names) for s in common) / len(common)
    if reference is None or natural is None:
        return tv, None
    move = [arm_mean.get(n, 0.0) - base_mean.get(n, 0.0) for n in names]
    return tv, _cosine(move, [reference.get(n, 0.0) - natural.get(n, 0.0) for n in names])


def pool_departure(study: Path, label: str, seeds: list[int]) -> float | None:
    """How far the arm's selection moves from its own pool, step by step: the total-variation distance between
    the selected rows' domain shares and the pool's (`mixture/*` against `pool/*` in selection_log.csv), mean
    over steps, then over the seeds that logged it. Proportional capacities give the rounding alone."""
    import csv

    per_seed = []
    for seed in seeds:
        path = study / f"{label}-seed{seed}" / "selection_log.csv"
        if not path.is_file():
            continue
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows:
            continue
        domains = [k[len("mixture/"):] for k in rows[0] if k.startswith("mixture/") and f"pool/{k[8:]}" in rows[0]]
        tvs = []
        for row in rows:
            try:
                sel = [float(row[f"mixture/{d}"]) for d in domains]
                pool = [float(row[f"pool/{d}"]) for d in domains]
            except (TypeError, ValueError):
                continue  # a step logged without shares
            tvs.append(0.5 * sum(abs(a - b) for a, b in zip(sel, pool)))
        if tvs:
            per_seed.append(sum(tvs) / len(tvs))
    return sum(per_seed) / len(per_seed) if per_seed else None


def _cosine(a: list[float], b: list[float]) -> float | None:
    """Cosine of two vectors; None when either is zero (nothing moved)."""
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    if na < 1e-12 or nb < 1e-12:
        return None
    return sum(x * y for x, y in zip(a, b)) / (na * nb)


def corpus_report(study: Path, *, weights_file: Path | None, seeds: list[int], png: Path | None) -> tuple[str, dict]:
    """The markdown section of one corpus and its numbers (`{arm: {tv_natural, tv_doremi, conflict, induced}}`)."""
    from composer_algos.analysis.experiment_stats import format_paired_markdown
    from composer_algos.data_selection.capacity_policy import read_domain_weights_file
    from composer_algos.doremi.compare import total_variation

    comparison = _read_json(study / "comparison.json") or {}
    paired = _read_json(study / "paired.json")
    selection = _read_json(study / "selection.json") or {}
    doremi = read_domain_weights_file(weights_file) if weights_file is not None and weights_file.exists() else None
    natural = selection.get("natural")
    labels = list(comparison.get("strategies") or {})
    labels += [x for x in (selection.get("strategies") or {}) if x not in labels]
    lines = []
    if paired:
        lines += [format_paired_markdown(paired), ""]
    else:
        lines += ["(no paired.json: the study has not run)", ""]
    numbers: dict[str, dict] = {}
    baseline = induced_per_seed(study, BASELINE, seeds)
    for label in labels:
        per_seed = induced_per_seed(study, label, seeds)
        induced = seed_mean(per_seed)
        tv_proportional, toward_doremi = departure_from_baseline(per_seed, baseline, reference=doremi, natural=natural)
        conflict = ((selection.get("strategies") or {}).get(label) or {}).get("conflict_fraction")
        avg = ((comparison.get("strategies") or {}).get(label) or {}).get("average") or {}
        names = sorted(set(induced or {}) | set(natural or {}) | set(doremi or {}))
        numbers[label] = {
            "induced": induced,
            "tv_natural": total_variation(induced, natural, names) if induced and natural else None,
            "tv_doremi": total_variation(induced, doremi, names) if induced and doremi else None,
            "tv_pool_step": pool_departure(study, label, seeds),
            "tv_proportional": tv_proportional,
            "toward_doremi": toward_doremi,
            "conflict_fraction": conflict,
            "average_loss": avg.get("mean"),
        }
    domains = sorted(set(natural or {}) | set(doremi or {}) | {d for v in numbers.values() for d in (v["induced"] or {})})
    lines += [
        "Induced mixture: each arm's share of the trained examples, mean over steps and seeds (mixture_steps.csv); "
        "TV = total-variation distance (half the L1 distance) of that mixture from the natural one (the training "
        "split's example shares) and from DoReMi's learned weights; TV vs pool / step: the distance of each step's "
        "selected shares from that step's pool shares, mean over steps and seeds (selection_log.csv), the "
        "selection's own departure from what it was offered (proportional capacities: the rounding); TV vs "
        f"proportional: the distance of the arm's induced mixture from {BASELINE}'s on the same seed (the same "
        "pools, so the pools' own drift cancels), mean over seeds; toward DoReMi: the cosine of that move (arm - "
        f"{BASELINE}, seed mean) with DoReMi's (weights - natural), +1 = budget moved the way DoReMi moves it, "
        "blank where nothing moved; conflict fraction: share of selected pairs with "
        "<g_i, g_j> < 0, mean over steps and seeds (random: `log_conflicts`).",
        "",
        "| arm | avg loss | TV vs natural | TV vs DoReMi | TV vs proportional | toward DoReMi | TV vs pool / step | conflict fraction |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, v in numbers.items():
        lines.append(
            f"| {label} | {_num(v['average_loss'])} | {_num(v['tv_natural'])} | {_num(v['tv_doremi'])} | "
            f"{_num(v['tv_proportional'])} | {_num(v['toward_doremi'])} | {_num(v['tv_pool_step'])} | {_num(v['conflict_fraction'])} |"
        )
    if domains:
        lines += [
            "",
            "Shares per domain (natural, DoReMi) and each arm's departure from the natural share (induced - natural):",
            "",
            "| mixture | " + " | ".join(domains) + " |",
            "|---|" + "---:|" * len(domains),
        ]
        if natural:
            lines.append("| natural | " + " | ".join(f"{natural.get(d, 0.0):.4f}" for d in domains) + " |")
        if doremi:
            lines.append("| DoReMi | " + " | ".join(f"{doremi.get(d, 0.0):.4f}" for d in domains) + " |")
        for label, v in numbers.items():
            if v["induced"] and natural:
                cells = [f"{v['induced'].get(d, 0.0) - natural.get(d, 0.0):+.4f}" for d in domains]
                lines.append(f"| {label} - natural | " + " | ".join(cells) + " |")
    if png is not None:
        written = plot_mixtures(study, list(numbers), seeds, png, doremi=doremi, weights_file=weights_file)
        if written is not None:
            lines += ["", f"![induced mixture per arm]({written.name})"]
    return "\n".join(lines), numbers


def plot_mixtures(
    study: Path, labels: list[str], seeds: list[int], path: Path, *, doremi: dict[str, float] | None,
    weights_file: Path | None,
) -> Path | None:
    """The induced mixture against step per arm (seed-mean), DoReMi's weights as dotted lines (tools/comparison_plots.py)."""
    from comparison_plots import plot_trajectories  # tools/comparison_plots.py

    from composer_algos.doremi.compare import Trajectory, load_trajectory

    trajectories = []
    for label in labels:
        mix = seed_mean_trajectory(study, label, seeds)
        if mix is None:
            continue
        t = Trajectory(label, *mix)
        caps = seed_mean_trajectory(study, label, seeds, file="capacity_steps.csv")
        if caps is not None and caps[1] == t.domain_names:
            t.capacity_steps, t.capacities_SC = caps[0], caps[2]
        trajectories.append(t)
    if weights_file is not None and weights_file.exists():
        proxy = load_trajectory("DoReMi proxy (learned weights)", weights_file)
        if proxy is not None:
            trajectories.append(proxy)
    if not trajectories:
        return None
    return plot_trajectories(
        trajectories, path, title=f"induced mixture per arm, mean over seeds ({study})", reference=doremi
    )


def write_report(out: Path, corpus_names: list[str], seeds: list[int]) -> str:
    """OUT/mixtures.md (and the PNGs beside it) for the corpora whose study has files."""
    sections = [
        "# The induced mixture study (issue 21.5)",
        "",
        f"Written by `tools/studies/study_mixtures.py --parts report` from {out}; seeds {seeds}; paired baseline "
        f"`{BASELINE}` (proportional capacities).",
        "",
    ]
    for name in corpus_names:
        study = out / name / "study"
        if not study.is_dir():
            continue
        weights = doremi_weights_path(out, name)
        text, _ = corpus_report(study, weights_file=weights, seeds=seeds, png=out / f"{name}_mixture.png")
        sections += [f"## {name}", "", text, ""]
    text = "\n".join(sections)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mixtures.md").write_text(text + "\n")
    return text


def _read_json(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _num(x: float | None) -> str:
    return f"{x:.4f}" if isinstance(x, (int, float)) and math.isfinite(x) else "-"


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "mixtures", help="output root (default runs/mixtures)")
    p.add_argument("--corpus", choices=(*CORPORA, "both"), default="both", help="which corpus (default both)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)} (default all)")
    p.add_argument("--seeds", default="1,2,3", help="seeds of every arm (default 1,2,3)")
    p.add_argument(
        "--steps", type=int, default=None,
        help="training steps of every study run and DoReMi stage (default: each corpus's own study's: dm_math 200, ghpile 80)",
    )
    p.add_argument("--jobs", type=int, default=2, help="training processes at once (default 2)")
    p.add_argument(
        "--arms", default=None,
        help=f"study: a comma-separated subset of the arms (the baseline {BASELINE} always runs; default all: "
        f"{','.join(arms(Path('W')))})",
    )
    p.add_argument(
        "--dm-math-root", type=Path, default=REPO / "runs" / "study",
        help="tools/studies/study_dm_math.py's --out: its shards/dm_math are used, made there first if missing (default runs/study)",
    )
    p.add_argument(
        "--ghpile-root", type=Path, default=REPO / "runs" / "ghpile",
        help="tools/studies/study_ghpile.py's --out: its shards/s512 are used, made by its setup part if missing (default runs/ghpile)",
    )
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}; allowed: {', '.join(PARTS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    if not seeds or args.jobs < 1 or (args.steps is not None and args.steps < 1):
        p.error("give at least one seed, --jobs >= 1 and --steps >= 1")
    names = list(CORPORA) if args.corpus == "both" else [args.corpus]
    only = [x for x in args.arms.split(",") if x] if args.arms else None
    unknown = sorted(set(only or []) - set(arms(Path("W"))))
    if unknown:
        p.error(f"--arms: unknown {unknown}; allowed: {', '.join(arms(Path('W')))}")
    out = args.out.resolve()
    all_corpora = corpora(args.dm_math_root.resolve(), args.ghpile_root.resolve())
    chosen = [all_corpora[n] for n in names]
    steps_of = {c.name: args.steps or c.steps for c in chosen}

    if "doremi" in parts or "study" in parts:
        ensure_shards(chosen, dm_math_root=args.dm_math_root.resolve(), ghpile_root=args.ghpile_root.resolve())
    if "doremi" in parts:
        run_doremi(chosen, out=out, steps_of=steps_of, jobs=args.jobs)
    if "study" in parts:
        for corpus in chosen:
            weights = doremi_weights_path(out, corpus.name)
            if not weights.exists():
                p.error(f"{weights} is missing: run --parts doremi first (the DoReMi arms read it)")
            cmd = study_command(
                corpus, out=out, seeds=",".join(map(str, seeds)), steps=steps_of[corpus.name], jobs=args.jobs,
                weights_file=weights, only=only,
            )
            print("+ " + " ".join(cmd), flush=True)
            subprocess.run(cmd, cwd=REPO, check=True)
    if "report" in parts:
        print(write_report(out, names, seeds))
    return 0


def ensure_shards(chosen: list[Corpus], *, dm_math_root: Path, ghpile_root: Path) -> None:
    """Make missing shards with the other studies' own parts (dm_math: `shard`; ghpile: `setup`)."""
    for corpus in chosen:
        if (corpus.shards / "manifest.json").exists():
            continue
        if corpus.name == "dm_math":
            study_dm_math.main(["--out", str(dm_math_root), "--parts", "shard"])
        else:
            study_ghpile.main(["--out", str(ghpile_root), "--parts", "setup"])


if __name__ == "__main__":
    raise SystemExit(main())
