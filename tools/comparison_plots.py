"""Figures that compare runs: domain-weight bars and weight trajectories (tools/compare_mixtures.py)
and gradient-conflict curves (tools/studies/plot_conflicts.py).

Plotting lives in tools/, outside the library packages; the data it draws comes from
`composer_algos.doremi.compare` and `pipeline.evaluation.conflicts`.

Example:
    python tools/compare_mixtures.py --doremi runs/doremi-demo-proxy/doremi/mixture.json --runs runs/x --out cmp
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer_algos.doremi.compare import MixtureColumn, Trajectory  # noqa: E402
from pipeline.evaluation.conflicts import ConflictCurve, aggregate_by_strategy, smooth_curve  # noqa: E402

__all__ = ["plot_grouped_bars", "plot_trajectories", "plot_conflicts"]

# The paper's figure draws ID in blue and PartitionSel in red; keep that and give others tab10.
_COLORS = {"partitionsel": "#b2182b", "id": "#2166ac"}
_DISPLAY = {
    "partitionsel": "PartitionSel",
    "id": "ID",
    "iwd": "IWD",
    "greats": "GREATS",
    "colm": "COLM",
    "gradnorm": "GradNorm",
    "random": "Random",
    "random_stratified": "Random (stratified)",
    "doremi": "DoReMi",
}


def plot_grouped_bars(
    names: Sequence[str],
    columns: Sequence[MixtureColumn],
    path: str | os.PathLike,
    *,
    title: str | None = None,
) -> Path:
    """Grouped bar chart, one group per domain and one bar per method (the paper's domain-weights figure).

    Returns:
        The written path.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_cols = len(columns)
    x = np.arange(len(names))
    width = 0.8 / max(num_cols, 1)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(names) + 2), 4.2))
    colors = _colors(columns)
    for i, col in enumerate(columns):
        vals = [col.weights.get(n, 0.0) for n in names]
        ax.bar(
            x - 0.4 + width * (i + 0.5),
            vals,
            width,
            label=col.label,
            color=colors[i],
            edgecolor="black",
            linewidth=0.3,
        )
    ax.set_xticks(x)
    ax.set_xticklabels(names, rotation=35, ha="right")
    ax.set_ylabel("Domain weights")
    # Headroom above the tallest bar for the legend row(s).
    ax.set_ylim(0, 1.4 * max([c.weights.get(n, 0.0) for c in columns for n in names] + [0.1]))
    ax.grid(axis="y", color="0.85")
    ax.set_axisbelow(True)
    ax.legend(frameon=False, loc="upper left", ncol=min(num_cols, 4))
    if title:
        ax.set_title(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def plot_trajectories(
    trajectories: Sequence[Trajectory],
    path: str | os.PathLike,
    *,
    title: str | None = None,
    reference: dict[str, float] | None = None,
    reference_label: str = "DoReMi",
) -> Path:
    """One panel per method: per-step weights (thin) and their running mean (thick), per domain.

    The running mean over the rows is what `mixture.json` reports (for DoReMi the first row is
    the initial weights, which the average includes). A selection run's capacities
    (`capacity_steps.csv`: each domain's capacity as a share of the trained examples; with
    `capacities: slack` its upper bound) are drawn beside them, dashed, as their running mean.
    `reference` (domain -> weight, e.g. DoReMi's learned weights) is drawn in every panel as
    dotted horizontal lines in the domains' colours.

    Returns:
        The written path.

    Raises:
        ValueError: If `trajectories` is empty.
    """
    if not trajectories:
        raise ValueError("no trajectories to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_names: list[str] = []
    for t in trajectories:
        all_names += [n for n in t.domain_names if n not in all_names]
    cmap = plt.get_cmap("tab10" if len(all_names) <= 10 else "tab20")
    color = {n: cmap(i % cmap.N) for i, n in enumerate(all_names)}
    ncols = min(3, len(trajectories))
    nrows = math.ceil(len(trajectories) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.6 * nrows), squeeze=False, sharey=True)
    for ax, t in zip(axes.flat, trajectories):
        running_SC = np.cumsum(t.weights_SC, axis=0) / np.arange(1, len(t.steps) + 1)[:, None]
        for c, n in enumerate(t.domain_names):
            ax.plot(t.steps, t.weights_SC[:, c], color=color[n], alpha=0.3, linewidth=0.7)
            ax.plot(t.steps, running_SC[:, c], color=color[n], linewidth=1.8, label=n)
        if t.capacities_SC is not None and t.capacity_steps:
            caps_SC = np.cumsum(t.capacities_SC, axis=0) / np.arange(1, len(t.capacity_steps) + 1)[:, None]
            for c, n in enumerate(t.domain_names):
                ax.plot(t.capacity_steps, caps_SC[:, c], color=color[n], linewidth=1.0, linestyle="--")
        if reference:
            for n in t.domain_names:
                if n in reference:
                    ax.axhline(reference[n], color=color[n], linestyle=":", linewidth=1.0)
        notes = [" (dashed: capacity)"] if t.capacities_SC is not None else []
        if reference:
            notes.append(f" (dotted: {reference_label})")
        ax.set_title(t.label + "".join(notes), fontsize=9)
        ax.set_xlabel("step")
        ax.grid(color="0.9")
    for ax in list(axes.flat)[len(trajectories) :]:
        ax.set_visible(False)
    axes[0][0].set_ylabel("weight (thin: per step, thick: running mean)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    for ax in list(axes.flat)[1 : len(trajectories)]:
        h, lab = ax.get_legend_handles_labels()
        seen.update({k: v for k, v in zip(lab, h) if k not in seen})
    fig.legend(
        list(seen.values()), list(seen.keys()), loc="lower center", ncol=min(len(seen), 8), frameon=False
    )
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_conflicts(
    curves: Sequence[ConflictCurve],
    out_path: str | Path,
    *,
    window: int = 25,
    show_band: bool = True,
    title: str | None = None,
) -> Path:
    """Plot the smoothed per-step conflict fraction of each strategy (the paper's conflict figure).

    Each strategy's runs are averaged step by step (`aggregate_by_strategy`), smoothed with a
    centred moving average of ``window`` steps, and drawn as a line; with several runs the
    smoothed min-max range over runs is shaded.

    Args:
        curves: From `load_conflict_curves`.
        out_path: Image path (format from the suffix, e.g. ``.png`` or ``.pdf``).
        window: Smoothing window in logged steps (default 25; 1 disables smoothing).
        show_band: Shade the range over runs when a strategy has several (default True).
        title: Optional title.

    Returns:
        The written path.

    Raises:
        ValueError: If there are no curves.
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on training/eval machines
    import matplotlib.pyplot as plt

    if not curves:
        raise ValueError("no conflict curves to plot (no selection_log.csv row had a conflict_fraction)")
    fig, ax = plt.subplots(figsize=(5.0, 3.75))
    fallback_colors = itertools.cycle(plt.get_cmap("tab10").colors)  # type: ignore[attr-defined]
    for agg in aggregate_by_strategy(curves):
        color = _COLORS.get(agg.strategy.lower()) or next(fallback_colors)
        w = min(window, max(1, agg.steps.size))
        label = _DISPLAY.get(agg.strategy.lower(), agg.strategy)
        if agg.n_runs > 1:
            label += f" ({agg.n_runs} runs)"
        ax.plot(agg.steps, smooth_curve(agg.mean, w), color=color, linewidth=1.5, label=label)
        if show_band and agg.n_runs > 1:
            low, high = smooth_curve(agg.low, w), smooth_curve(agg.high, w)
            ax.fill_between(agg.steps, low, high, color=color, alpha=0.15, linewidth=0)
    ax.set_xlabel("Steps")
    ax.set_ylabel("Gradient conflicts\n" + r"fraction of pairs with $\langle g_i, g_j\rangle < 0$")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(True, linestyle="--", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def _colors(columns: Sequence[MixtureColumn]) -> list:
    import matplotlib.pyplot as plt

    fixed = {"natural": "0.55", "DoReMi initial": "0.8", "DoReMi": "tab:blue"}
    cycle = [c for c in plt.get_cmap("tab10").colors if c != plt.get_cmap("tab10").colors[0]]  # type: ignore[attr-defined]
    out, k = [], 0
    for col in columns:
        if col.label in fixed:
            out.append(fixed[col.label])
        else:
            out.append(cycle[(k + 2) % len(cycle)])  # start at red, as the paper's PartitionSel bars
            k += 1
    return out
