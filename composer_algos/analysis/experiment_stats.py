"""Paired per-seed comparisons of strategies and the overlap of their selected examples (stdlib only)."""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "format_paired_markdown",
    "format_sensitivity_markdown",
    "sensitivity",
    "verdict_of",
    "jaccard",
    "paired_comparison",
    "paired_summary",
    "read_selected_ids",
    "selection_overlap",
    "t_quantile_975",
]

# Two-sided 95% critical values of Student's t (the 0.975 quantile) for 1..30 degrees of freedom.
_T975 = (
    12.706205,
    4.302653,
    3.182446,
    2.776445,
    2.570582,
    2.446912,
    2.364624,
    2.306004,
    2.262157,
    2.228139,
    2.200985,
    2.178813,
    2.160369,
    2.144787,
    2.131450,
    2.119905,
    2.109816,
    2.100922,
    2.093024,
    2.085963,
    2.079614,
    2.073873,
    2.068658,
    2.063899,
    2.059539,
    2.055529,
    2.051831,
    2.048407,
    2.045230,
    2.042272,
)
_Z975 = 1.959963984540054


def t_quantile_975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (scipy is not a dependency).

    Exact table values up to 30; beyond, the Cornish-Fisher expansion in 1/df around the normal
    quantile (error below 1e-5 from 31 on).

    Raises:
        ValueError: `df` < 1.
    """
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1 (two or more paired seeds), got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z, v = _Z975, float(df)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / v + g2 / v**2 + g3 / v**3 + g4 / v**4


def paired_summary(differences: Sequence[float]) -> dict[str, Any]:
    """Mean, sample standard deviation and 95% t interval of per-seed differences.

    Returns:
        `{n, mean, std, ci_low, ci_high, differences}`; with a single difference the std is 0 and
        the interval NaN (one seed says nothing about seed-to-seed spread).
    """
    d = [float(x) for x in differences]
    n = len(d)
    if n == 0:
        return {
            "n": 0,
            "mean": math.nan,
            "std": math.nan,
            "ci_low": math.nan,
            "ci_high": math.nan,
            "differences": [],
        }
    mean = sum(d) / n
    if n == 1:
        return {"n": 1, "mean": mean, "std": 0.0, "ci_low": math.nan, "ci_high": math.nan, "differences": d}
    std = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return {"n": n, "mean": mean, "std": std, "ci_low": mean - half, "ci_high": mean + half, "differences": d}


def paired_comparison(
    per_seed: Mapping[str, Mapping[int, Mapping[str, Any]]], *, baseline: str
) -> dict[str, Any]:
    """Per-seed differences (strategy minus baseline) of the average and per-domain validation loss.

    Args:
        per_seed: strategy -> seed -> `{"average": float, "domains": {name: float}}` (final
            validation log-perplexity of that run).
        baseline: The strategy every other one is compared with; only seeds both have are paired.

    Returns:
        `{"baseline", "strategies": {name: {"seeds", "average": summary, "domains": {d: summary}}}}`,
        each summary from `paired_summary`. Negative differences mean lower loss than the baseline.

    Raises:
        ValueError: the baseline has no runs.
    """
    base = per_seed.get(baseline)
    if not base:
        raise ValueError(
            f"paired baseline {baseline!r} has no finished runs; strategies with runs: {sorted(per_seed)}"
        )
    out: dict[str, Any] = {"baseline": baseline, "strategies": {}}
    for name, runs in per_seed.items():
        if name == baseline:
            continue
        seeds = sorted(s for s in runs if s in base)
        domains = sorted(set().union(*(runs[s]["domains"] for s in seeds)) if seeds else set())
        entry: dict[str, Any] = {
            "seeds": seeds,
            "average": paired_summary([runs[s]["average"] - base[s]["average"] for s in seeds]),
            "domains": {},
        }
        for d in domains:
            pairs = [s for s in seeds if d in runs[s]["domains"] and d in base[s]["domains"]]
            entry["domains"][d] = paired_summary(
                [runs[s]["domains"][d] - base[s]["domains"][d] for s in pairs]
            )
        out["strategies"][name] = entry
    return out


def format_paired_markdown(paired: Mapping[str, Any]) -> str:
    """The paired comparison as a markdown table: mean difference [95% interval] per column."""
    baseline = paired["baseline"]
    strategies = paired["strategies"]
    if not strategies:
        return f"(no strategy to pair with {baseline})"
    domains = sorted(set().union(*(e["domains"] for e in strategies.values())))
    head = ["strategy - " + baseline, "seeds", "average", *domains]
    lines = [
        f"Paired differences of final validation log-perplexity against {baseline} (strategy minus "
        f"{baseline}, per seed; mean [95% t interval]; negative = lower loss than {baseline})",
        "",
        "| " + " | ".join(head) + " |",
        "|---|---:|" + "---:|" * (len(head) - 2),
    ]
    for name, e in strategies.items():
        cells = [f"{name} - {baseline}", str(e["average"]["n"]), _fmt_ci(e["average"])]
        cells += [_fmt_ci(e["domains"][d]) if d in e["domains"] else "-" for d in domains]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict_of(summary: Mapping[str, Any]) -> str:
    """`lower` / `higher` when the 95% interval of a paired difference lies below / above 0, else `level`."""
    lo, hi = summary.get("ci_low"), summary.get("ci_high")
    if lo is None or hi is None or not (math.isfinite(lo) and math.isfinite(hi)):
        return "n/a"
    return "lower" if hi < 0 else "higher" if lo > 0 else "level"


def sensitivity(
    per_seed: Mapping[str, Mapping[int, Mapping[str, Any]]],
    counts: Mapping[str, Sequence[int]],
    planned: Mapping[str, int],
    *,
    baseline: str,
    label_at: Any,
) -> dict[str, Any]:
    """Each arm's paired difference against `baseline` at its planned steps and at the calibration's edges.

    Args:
        per_seed: as `paired_comparison`'s, holding the arms and their runs at other step counts.
        counts: arm -> the step counts beside its plan (from an equal-compute plan's `sensitivity`).
        planned: arm -> its planned steps.
        label_at: (arm, steps) -> the name its runs at `steps` have in `per_seed`.

    Returns:
        arm -> `{"steps": [...], "average": [summary per step count], "verdicts": [...], "flips": bool}`,
        `flips` when the verdict (`verdict_of`) is not the same at every step count: the difference
        then turns inside the calibration's noise.
    """
    out: dict[str, Any] = {}
    for arm, edges in counts.items():
        steps = sorted([*edges, planned[arm]])
        names = {n: arm if n == planned[arm] else label_at(arm, n) for n in steps}
        subset = {names[n]: per_seed[names[n]] for n in steps if names[n] in per_seed}
        if baseline not in per_seed or len(subset) < len(steps):
            continue
        paired = paired_comparison({**subset, baseline: per_seed[baseline]}, baseline=baseline)["strategies"]
        averages = [paired[names[n]]["average"] for n in steps]
        verdicts = [verdict_of(a) for a in averages]
        out[arm] = {
            "steps": steps, "planned": planned[arm], "average": averages, "verdicts": verdicts,
            "flips": len(set(verdicts)) > 1,
        }
    return out


def format_sensitivity_markdown(result: Mapping[str, Any], *, baseline: str) -> str:
    """The `sensitivity` result as a markdown table (one row per arm, its step counts in increasing order)."""
    if not result:
        return (
            f"(no arm's step count moves within its calibration spread against {baseline}: no sensitivity runs)"
        )
    lines = [
        f"Sensitivity to the calibration: each arm minus {baseline} (average, mean [95% t interval]) at its "
        "planned steps (bold) and at the step counts a cost one calibration spread lower or higher would buy; "
        "'flips' marks a verdict that changes among them, inside the calibration's noise",
        "",
        "| arm | steps | arm - baseline at each | verdict |",
        "|---|---|---|---|",
    ]
    for arm, e in result.items():
        steps = " / ".join(f"**{n}**" if n == e["planned"] else str(n) for n in e["steps"])
        cells = " / ".join(_fmt_ci(a) for a in e["average"])
        verdict = "flips (" + " / ".join(e["verdicts"]) + ")" if e["flips"] else e["verdicts"][0]
        lines.append(f"| {arm} | {steps} | {cells} | {verdict} |")
    return "\n".join(lines)


def jaccard(a: Sequence[int], b: Sequence[int]) -> float:
    """|A & B| / |A | B| of two id collections (1 when both are empty)."""
    sa, sb = set(a), set(b)
    union = sa | sb
    return 1.0 if not union else len(sa & sb) / len(union)


def read_selected_ids(path: str | os.PathLike) -> dict[int, tuple[list[int], list[int]]]:
    """Read a `selected_ids.jsonl` (written by `MixtureMonitor(log_selected_ids=True)`).

    Returns:
        step -> (pool sample ids, selected sample ids); a later line for a step replaces an earlier one.
    """
    out: dict[int, tuple[list[int], list[int]]] = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out[int(row["step"])] = ([int(x) for x in row["pool"]], [int(x) for x in row["selected"]])
    return out


def selection_overlap(
    run: Mapping[int, tuple[Sequence[int], Sequence[int]]],
    reference: Mapping[int, tuple[Sequence[int], Sequence[int]]],
) -> dict[str, Any]:
    """Compare one run's selected ids with a reference run's (e.g. random's) step by step.

    Jaccard overlaps only mean something when both chose from the same pools, so the pools
    (as sets) are checked at every step both logged.

    Returns:
        `{steps, pools_identical, first_pool_mismatch_step, mean_jaccard}`; `mean_jaccard` is over
        the steps whose pools agree (NaN when none do).
    """
    steps = sorted(set(run) & set(reference))
    mismatch = [s for s in steps if set(run[s][0]) != set(reference[s][0])]
    agree = [s for s in steps if s not in set(mismatch)]
    values = [jaccard(run[s][1], reference[s][1]) for s in agree]
    return {
        "steps": len(steps),
        "pools_identical": bool(steps) and not mismatch,
        "first_pool_mismatch_step": mismatch[0] if mismatch else None,
        "mean_jaccard": sum(values) / len(values) if values else math.nan,
    }


def _fmt_ci(s: Mapping[str, Any]) -> str:
    if not s or s["n"] == 0 or not math.isfinite(s["mean"]):
        return "-"
    if not math.isfinite(s["ci_low"]):
        return f"{s['mean']:+.4f}"
    return f"{s['mean']:+.4f} [{s['ci_low']:+.4f}, {s['ci_high']:+.4f}]"
