"""Plots of one run directory: the induced domain mixture and the per-domain validation curves.

Reads the files `train.py` writes into a run directory (`mixture_steps.csv`, `selection_log.csv`,
`mixture.json`, `eval_history.csv`) and writes PNGs next to them. `tools/demo.py` calls it at the
end of the demo; it also runs on its own.

Example:
    python tools/plots.py demo_out/runs/demo-partitionsel            # writes mixture.png, val_curves.png
    python tools/plots.py runs/x --window 50
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from collections import defaultdict
from pathlib import Path

__all__ = ["moving_average", "plot_mixture", "plot_val_curves", "read_eval_history", "read_mixture"]


def read_mixture(run_dir: Path) -> dict:
    """The run's mixture per step (selected and pool) and its summary shares.

    Args:
        run_dir: a run directory with `mixture.json` and `selection_log.csv`.

    Returns:
        A dict with ``domains`` (list), ``steps`` (list of int), ``selected`` and ``pool`` (domain ->
        per-step shares), ``capacity`` (domain -> per-step capacity share of the trained examples,
        NaN on steps without capacities; empty when the run logged none), and ``natural``,
        ``pool_mean``, ``selected_mean``, ``capacity_mean`` (domain -> share; NaN without capacities).

    Raises:
        FileNotFoundError: when one of the two files is missing.
    """
    mix = json.loads((run_dir / "mixture.json").read_text())
    with open(run_dir / "selection_log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    names = list(mix["domains"])
    steps = [int(r["step"]) for r in rows]
    selected = {n: [float(r[f"mixture/{n}"]) for r in rows] for n in names}
    pool = {n: [float(r[f"pool/{n}"]) for r in rows] for n in names}
    # Capacity shares (selection_log.csv of runs since issue 21); with capacities: slack they are upper bounds.
    capacity = {n: [float(r.get(f"capacity/{n}") or "nan") for r in rows] for n in names}
    if not any(math.isfinite(x) for v in capacity.values() for x in v):
        capacity = {}
    natural = mix.get("natural") or {}
    return {
        "domains": names,
        "steps": steps,
        "selected": selected,
        "pool": pool,
        "natural": {n: float(natural.get(n, math.nan)) for n in names},
        "pool_mean": {n: sum(v) / len(v) if v else math.nan for n, v in pool.items()},
        "selected_mean": {n: float(mix["weights"][n]) for n in names},
        "capacity": capacity,
        "capacity_mean": {n: _finite_mean(capacity.get(n, [])) for n in names},
    }


def read_eval_history(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Per-domain validation cross-entropy by step from `eval_history.csv` (domain -> [(step, loss)]).

    Args:
        run_dir: a run directory.

    Returns:
        Domain -> sorted ``(step, cross_entropy)`` pairs; empty when the file is missing.
    """
    path = run_dir / "eval_history.csv"
    if not path.exists():
        return {}
    curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            curves[row["domain"]].append((int(row["step"]), float(row["cross_entropy"])))
    return {d: sorted(v) for d, v in curves.items()}


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over at most ``window`` values (shorter at the start), same length as ``values``."""
    if window < 1:
        raise ValueError(f"`window` must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_mixture(run_dir: Path, out_path: Path, *, window: int = 25) -> Path:
    """Two panels: selected vs pool (and capacity) share per domain over the steps, and the mean shares as bars.

    The capacities (dotted; with `capacities: slack` the upper bounds) and their bar appear when the
    run logged them.

    Args:
        run_dir: the run directory (see ``read_mixture``).
        out_path: the PNG to write.
        window: moving-average window in steps for the left panel (default 25).

    Returns:
        ``out_path``.
    """
    plt = _pyplot()
    mix = read_mixture(run_dir)
    names, steps = mix["domains"], mix["steps"]
    colors = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]  # ListedColormap has .colors
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11.0, 4.0), gridspec_kw={"width_ratios": [3, 2]})
    w = max(1, min(window, len(steps)))
    for i, n in enumerate(names):
        c = colors[i % len(colors)]
        ax_t.plot(steps, moving_average(mix["selected"][n], w), color=c, label=n)
        ax_t.plot(steps, moving_average(mix["pool"][n], w), color=c, linestyle="--", linewidth=0.8)
        if mix["capacity"]:
            cap_steps = [s for s, x in zip(steps, mix["capacity"][n]) if math.isfinite(x)]
            cap = [x for x in mix["capacity"][n] if math.isfinite(x)]
            ax_t.plot(cap_steps, moving_average(cap, max(1, min(w, len(cap)))), color=c, linestyle=":", linewidth=1.2)
    ax_t.set_xlabel("step")
    ax_t.set_ylabel(f"share ({w}-step moving average)")
    what = "selected (solid), pool (dashed), capacity (dotted)" if mix["capacity"] else "selected (solid) vs pool (dashed)"
    ax_t.set_title(f"{what} per domain")
    ax_t.legend(fontsize=8, loc="best")
    bars = [("natural", "natural"), ("pool_mean", "pool"), ("selected_mean", "selected")]
    if mix["capacity"]:
        bars.append(("capacity_mean", "capacity"))
    width = 0.8 / len(bars)
    xs = range(len(names))
    for j, (key, label) in enumerate(bars):
        offset = (j - (len(bars) - 1) / 2) * width
        ax_b.bar([x + offset for x in xs], [mix[key][n] for n in names], width, label=label)
    ax_b.set_xticks(list(xs))
    ax_b.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax_b.set_ylabel("share")
    ax_b.set_title(f"mixture over {len(steps)} steps")
    ax_b.legend(fontsize=8)
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def plot_val_curves(run_dir: Path, out_path: Path) -> Path:
    """Per-domain validation cross-entropy by step, with the unweighted average in black.

    Args:
        run_dir: the run directory (``eval_history.csv``).
        out_path: the PNG to write.

    Returns:
        ``out_path``.

    Raises:
        ValueError: when the run has no evaluation history.
    """
    curves = read_eval_history(run_dir)
    if not curves:
        raise ValueError(f"no validation history in {run_dir / 'eval_history.csv'}; was evaluation enabled?")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for name, points in curves.items():
        ax.plot([s for s, _ in points], [v for _, v in points], marker=".", label=name)
    by_step: dict[int, list[float]] = defaultdict(list)
    for points in curves.values():
        for s, v in points:
            by_step[s].append(v)
    avg = sorted((s, sum(v) / len(v)) for s, v in by_step.items())
    ax.plot([s for s, _ in avg], [v for _, v in avg], color="black", linewidth=2, label="average")
    ax.set_xlabel("step")
    ax.set_ylabel("validation cross-entropy (nats/token)")
    ax.set_title("per-domain validation loss")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def _finite_mean(values: list[float]) -> float:
    finite = [x for x in values if math.isfinite(x)]
    return sum(finite) / len(finite) if finite else math.nan


def _pyplot():
    """matplotlib.pyplot on the file-only backend (imported late: it is slow and only plots need it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def main(argv: list[str] | None = None) -> int:
    """Write `mixture.png` and `val_curves.png` into (or next to) a run directory."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="a run directory written by train.py")
    parser.add_argument("--out", type=Path, help="folder for the PNGs (default: the run directory)")
    parser.add_argument("--window", type=int, default=25, help="moving-average window in steps (default 25)")
    args = parser.parse_args(argv)
    out = args.out or args.run_dir
    print(plot_mixture(args.run_dir, out / "mixture.png", window=args.window))
    print(plot_val_curves(args.run_dir, out / "val_curves.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
