"""Write docs/results/study_dm_math.md from a finished `tools/studies/study_dm_math.py` output directory.

Example:
    python tools/studies/study_report.py runs/study --doc docs/results/study_dm_math.md
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

SECTIONS = (
    ("main_scratch", "Regime (a): from scratch, equal steps"),
    ("main_finetune", "Regime (b): fine-tuning a base trained on another mixture, equal steps"),
    ("wallclock_scratch", "Regime (a): equal compute (each run trains the steps its measured step cost fits)"),
    ("ablations", "PartitionSel settings, one at a time (regime a, equal steps)"),
    ("ablations_finetune", "PartitionSel settings on regime (b), equal steps"),
)
# The experiment whose `partitionsel` runs (same pools, default settings) each ablation is paired with.
ABLATION_DEFAULTS = {"ablations": "main_scratch", "ablations_finetune": "main_finetune"}
# Variants that change a setting on top of another variant, paired with that one as well: `valavg`
# runs under `precondition: pool` (averaging is rejected with the study yaml's `both`), so its own
# effect is its difference from `prec_pool` on the same pools (and it is not paired with the default).
VARIANT_BASES = {"ps_valavg": "ps_prec_pool"}


def verdict(name: str, baseline: str, summary: dict) -> str:
    """One plain sentence on a paired difference of the average validation loss."""
    lo, hi, mean, n = summary.get("ci_low"), summary.get("ci_high"), summary.get("mean"), summary.get("n", 0)
    if n < 2 or lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return f"{name} vs {baseline}: too few paired seeds to decide ({n})."
    span = f"{mean:+.4f} [{lo:+.4f}, {hi:+.4f}], {n} seeds"
    if hi < 0:
        return f"{name} has lower average validation loss than {baseline} beyond seed noise ({span})."
    if lo > 0:
        return f"{name} has higher average validation loss than {baseline} beyond seed noise ({span})."
    return f"{name} and {baseline} are not distinguishable at this many seeds ({span})."


def paired_table(pairs: list[tuple[str, dict, str, dict]], *, title: str) -> tuple[str, list[str]]:
    """A markdown table of paired differences (first minus second, seeds in common) with verdicts.

    Args:
        pairs: (name, per-seed results, other name, other per-seed results); per-seed results map
            seed -> {"average": ...} as in comparison.json's `per_seed`. Pairs without a common
            seed are left out.
        title: The sentence above the table.

    Returns:
        The table and one verdict sentence per pair ("", [] when no pair has a common seed).
    """
    from composer_algos.analysis.experiment_stats import paired_summary

    rows, verdicts = [], []
    for name, mine, other, theirs in pairs:
        seeds = sorted((s for s in mine if s in theirs), key=str)
        if not seeds:
            continue
        summary = paired_summary([mine[s]["average"] - theirs[s]["average"] for s in seeds])
        lo, hi = summary["ci_low"], summary["ci_high"]
        ci = f"[{lo:+.4f}, {hi:+.4f}]" if math.isfinite(lo) and math.isfinite(hi) else "[n/a]"
        rows.append(f"| {name} - {other} | {summary['n']} | {summary['mean']:+.4f} {ci} |")
        verdicts.append(verdict(name, other, summary))
    if not rows:
        return "", []
    return "\n".join([title, "", "| pairing | seeds | average |", "|---|---:|---:|", *rows]), verdicts


def partitionsel_against_others(
    per_seed: dict, *, subject: str = "partitionsel", against: tuple[str, ...] = ("id", "greats", "colm", "gradnorm")
) -> tuple[str, list[str]]:
    """`subject` minus each other strategy, paired by seed, on the average validation loss.

    Args:
        per_seed: comparison.json's `per_seed` (strategy -> seed -> {"average", "domains"}).

    Returns:
        A markdown table and one verdict sentence per pairing ("", [] when `subject` has no runs).
    """
    mine = per_seed.get(subject)
    if not mine:
        return "", []
    pairs = [(subject, mine, other, per_seed.get(other, {})) for other in against]
    title = (
        f"{subject} against the other selectors (paired by seed, average validation loss; mean [95% t "
        f"interval]; negative = {subject} lower)"
    )
    return paired_table(pairs, title=title)


def variants_against_default(variants: dict, default: dict, *, default_name: str = "partitionsel") -> tuple[str, list[str]]:
    """Each PartitionSel variant (`ps_<name>`) minus the default settings' runs, paired by seed.

    Args:
        variants: The ablation experiment's `per_seed` (its `ps_*` labels are the variants).
        default: The default PartitionSel's per-seed results (the main experiment's `partitionsel`),
            trained on the same pools, so the difference is the one setting's effect.
    """
    pairs = [(label, runs, default_name, default) for label, runs in variants.items() if label.startswith("ps_")]
    title = (
        f"Each setting against the default {default_name} (paired by seed, average validation loss; mean "
        "[95% t interval]; negative = the setting is better)"
    )
    return paired_table(pairs, title=title)


def write_report(out: Path, doc: Path, *, steps: int, early: int) -> None:
    """Assemble the study's tables and figures into `doc` (PNG files beside it)."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    stem = doc.stem
    lines = _report_intro(steps)
    for step in (early, steps):
        path = out / "lookahead" / f"ba{step}" / "summary.md"
        if path.exists():
            lines += [f"### Checkpoint at step {step}", "", path.read_text().strip(), ""]
    conclusions: list[str] = []
    for name, title in SECTIONS:
        if not (out / name / "comparison.md").exists():
            continue
        lines += _experiment_section(out, doc, name, title, conclusions)
    points = frontier_points(out)  # the knobs' plot is a subset: read the tables once
    frontier = _plot_frontier(points, doc.parent / f"{stem}_frontier.png")
    if frontier is not None:
        lines += [
            "## Cost against quality",
            "",
            f"![frontier]({frontier.name})",
            "",
            "Mean training time (evaluation excluded) against the final average validation loss, per",
            "strategy and PartitionSel variant (regime a, equal steps).",
            "",
        ]
    knob_labels = ("partitionsel", "random", *KNOBS)
    knobs = _plot_frontier(
        [p for p in points if p[0] in knob_labels], doc.parent / f"{stem}_knobs_frontier.png", "the cost knobs"
    )
    if knobs is not None:
        lines += [
            f"![cost knobs]({knobs.name})",
            "",
            "The same for issue 15's cost knobs alone: `score_tokens: 32`, features on `mlp.down_proj`",
            "only, and selecting every second step with `between: stale_topk` or `random`, beside the",
            "default PartitionSel and random. The times come from runs made at different moments on a",
            "shared machine; the side-by-side cost of each knob is its feature-time ratio in",
            "docs/data_selection.md (Cost knobs, `tools/studies/knob_fidelity.py`).",
            "",
        ]
    if conclusions:
        lines += ["## What the paired comparisons say", "", *conclusions, ""]
    # The hand-written reading of the tables lives beside the document, so a re-run keeps it.
    reading = doc.with_name(f"{stem}_reading.md")
    if reading.exists():
        lines += [reading.read_text().strip(), ""]
    doc.write_text("\n".join(lines))


def _report_intro(steps: int) -> list[str]:
    """The document's title, the study's setting and the introduction of the one-step-ahead section."""
    return [
        "# Selection study on dm_math",
        "",
        "Written by `python tools/studies/study_dm_math.py --out OUT` (which calls `tools/studies/study_report.py`); every",
        "number below comes from that command's output directory. Corpus: `../shared/data/dm_math` (8",
        "domains, unequal sizes), a small Llama (`yamls/study/dm_math.yaml`), pools of 32, 16 trained a",
        f"step, {steps} steps. Evaluation reads the held-out half of each domain's val split; selection is",
        "guided by the other half.",
        "",
        "## One step ahead (tools/studies/lookahead.py)",
        "",
        "Drop of the mean per-example loss after one step on each arm's subset, minus the mean drop of",
        "random subsets with the same per-domain capacities (positive = better than random), on held-out",
        "examples (`eval`) and on the guiding set (`guide`), for one SGD step and one step of the run's",
        "optimizer (`opt`, its state from the checkpoint). Arms: `before` = the settings before the",
        "signal-chain fixes (preconditioner on both sides, 128-wide features, 4 guiding examples,",
        "unweighted); `default` = the study yaml's settings (both sides, 1024-wide, 4 guiding examples);",
        "`pool` = preconditioner on the pool side only; `_1024` = 1024-wide features; `_w` = trained on",
        "the refit weights; `_g64` = guided by 64 examples (a stand-in for averaging validation",
        "features over steps); `id` = per-domain GREATS; `oracle_*` select by exact full-model",
        "scores (`oracle_eval` by the evaluation set's own gradient: an upper bound).",
        "",
    ]


def _experiment_section(out: Path, doc: Path, name: str, title: str, conclusions: list[str]) -> list[str]:
    """One experiment's tables (comparison, paired, against other arms and variants, selection) and curves.

    Its verdicts are added to `conclusions`; the curves are copied beside `doc`.
    """
    exp = out / name
    stem = doc.stem
    lines = [f"## {title}", "", (exp / "comparison.md").read_text().strip(), ""]
    if (exp / "paired.md").exists():
        lines += [(exp / "paired.md").read_text().strip(), ""]
        paired = json.loads((exp / "paired.json").read_text())
        for strat, entry in paired["strategies"].items():
            conclusions.append(f"- {title}: " + verdict(strat, paired["baseline"], entry["average"]))
    if (exp / "comparison.json").exists():
        per_seed = json.loads((exp / "comparison.json").read_text()).get("per_seed", {})
        table, verdicts = partitionsel_against_others(per_seed)
        if table:
            lines += [table, ""]
            conclusions += [f"- {title}: {v}" for v in verdicts]
        stacked = [(v, per_seed[v], b, per_seed[b]) for v, b in VARIANT_BASES.items() if v in per_seed and b in per_seed]
        table, verdicts = paired_table(
            stacked,
            title="Settings changed on top of another variant, against that variant (paired by seed, average "
            "validation loss; mean [95% t interval]; negative = the added setting is better)",
        )
        if table:
            lines += [table, ""]
            conclusions += [f"- {title}: {v}" for v in verdicts]
        default = out / ABLATION_DEFAULTS.get(name, "") / "comparison.json"
        if name in ABLATION_DEFAULTS and default.exists():
            main_runs = json.loads(default.read_text()).get("per_seed", {}).get("partitionsel", {})
            # A variant built on another differs from the default in two settings: paired with its base above.
            alone = {k: v for k, v in per_seed.items() if k not in VARIANT_BASES}
            table, verdicts = variants_against_default(alone, main_runs)
            if table:
                lines += [table, ""]
                conclusions += [f"- {title}: {v}" for v in verdicts]
    if (exp / "selection.md").exists():
        lines += [(exp / "selection.md").read_text().strip(), ""]
    if (exp / "curves.png").exists():
        png = doc.parent / f"{stem}_{name}_curves.png"
        shutil.copyfile(exp / "curves.png", png)
        lines += [f"![validation curves]({png.name})", ""]
    return lines


# Issue 15's cost knobs among the ablations, plotted on their own frontier beside the default.
KNOBS = ("ps_score_tokens32", "ps_mlp_only", "ps_interval2_stale", "ps_interval2_random")


def frontier_points(out: Path, only: tuple[str, ...] | None = None) -> list[tuple[str, float, float]]:
    """(label, mean training seconds, mean final average validation loss) per strategy and variant.

    Main-experiment strategies and ablation variants of regime (a); `only` keeps those labels.
    """
    points = []
    for name in ("main_scratch", "ablations"):
        table = out / name / "comparison.json"
        if not table.exists():
            continue
        for strat, entry in json.loads(table.read_text())["strategies"].items():
            if only is not None and strat not in only:
                continue
            if name == "ablations" and strat == "random":
                continue  # the same runs as main_scratch's random
            t, loss = entry["train_time_s"]["mean"], entry["average"]["mean"]
            if t is not None and loss is not None and math.isfinite(t) and math.isfinite(loss):
                points.append((strat, t, loss))
    return points


def _plot_frontier(points: list[tuple[str, float, float]], path: Path, title: str = "cost against quality") -> Path | None:
    if not points:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for strat, t, loss in points:
        ax.scatter(t, loss)
        ax.annotate(strat, (t, loss), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("training time per run (s, evaluation excluded)")
    ax.set_ylabel("final average validation loss")
    ax.set_title(f"dm_math: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the study's output directory")
    p.add_argument(
        "--doc", type=Path, default=Path(__file__).resolve().parents[2] / "docs/results/study_dm_math.md"
    )
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--early", type=int, default=50)
    args = p.parse_args(argv)
    write_report(args.out, args.doc, steps=args.steps, early=args.early)
    print(f"wrote {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
