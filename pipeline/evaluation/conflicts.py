"""Gradient-conflict analysis: per-step fraction of conflicting selected pairs per strategy from the logs."""

from __future__ import annotations

import csv
import logging
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "SELECTION_LOG_NAME",
    "ConflictCurve",
    "StrategyConflicts",
    "aggregate_by_strategy",
    "load_conflict_curves",
    "read_selection_log",
    "smooth_curve",
    "summarize_conflicts",
]

log = logging.getLogger(__name__)

#: File the selection callback (`composer_algos.data_selection.mixture_monitor.MixtureMonitor`) writes per run.
SELECTION_LOG_NAME = "selection_log.csv"
_REQUIRED = ("step", "strategy", "conflict_fraction")


@dataclass
class ConflictCurve:
    """The logged conflict fraction of one strategy in one run.

    Args:
        run: The run directory.
        strategy: The ``strategy`` column.
        steps: Steps that logged a conflict fraction (ascending).
        conflict_fraction: Fraction of selected pairs with ``<g_i, g_j> < 0`` at those steps.
    """

    run: str
    strategy: str
    steps: np.ndarray
    conflict_fraction: np.ndarray


@dataclass
class StrategyConflicts:
    """One strategy's curves combined over runs (seeds).

    Args:
        strategy: Strategy name.
        steps: Union of the runs' steps.
        mean: Mean over the runs that logged each step.
        low: Minimum over those runs.
        high: Maximum over those runs.
        n_runs: Number of runs combined.
    """

    strategy: str
    steps: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    n_runs: int


def read_selection_log(path: str | Path) -> list[dict[str, Any]]:
    """Read a ``selection_log.csv``; numeric cells become floats (empty cells NaN), ``step`` an int.

    Args:
        path: The CSV file.

    Returns:
        One dict per row, keyed by the header.

    Raises:
        ValueError: If ``step``, ``strategy`` or ``conflict_fraction`` is not in the header, or a
            ``step`` is not an integer.
    """
    path = Path(path)
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames or []
        missing = [c for c in _REQUIRED if c not in header]
        if missing:
            raise ValueError(f"{path}: column(s) {missing} missing; the header is {header}")
        rows = []
        for lineno, raw in enumerate(reader, start=2):
            row: dict[str, Any] = {}
            for key, value in raw.items():
                if key == "strategy":
                    row[key] = (value or "").strip()
                elif key == "step":
                    try:
                        row[key] = int(value)
                    except (TypeError, ValueError) as err:
                        raise ValueError(f"{path}: line {lineno} has step {value!r}, expected an integer") from err
                else:
                    row[key] = _to_float(value)
            rows.append(row)
    return rows


def load_conflict_curves(run_dirs: Sequence[str | Path]) -> list[ConflictCurve]:
    """Conflict curves of every (run, strategy) in the given run directories.

    Rows without a conflict fraction (steps where nothing was selected, or strategies that do not
    compute gradient features) are skipped; a (run, strategy) with no such row gives no curve.

    Args:
        run_dirs: Run directories holding ``selection_log.csv``, or the CSV files themselves.

    Returns:
        Curves, ordered as the inputs (then by strategy).

    Raises:
        FileNotFoundError: If a run has no ``selection_log.csv``.
    """
    curves = []
    for run in map(Path, run_dirs):
        path = run if run.is_file() else run / SELECTION_LOG_NAME
        if not path.exists():
            raise FileNotFoundError(f"{path} not found; pass run directories written by train.py (MixtureMonitor)")
        per_strategy: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for row in read_selection_log(path):
            value = row["conflict_fraction"]
            if not math.isnan(value):
                per_strategy[row["strategy"] or "none"].append((row["step"], value))
        name = str(path.parent if path.name == SELECTION_LOG_NAME else path)
        for strategy in sorted(per_strategy):
            # A resumed run may have rewritten steps; keep the last value written for each step.
            latest = dict(per_strategy[strategy])
            steps = np.array(sorted(latest), dtype=np.int64)
            values = np.array([latest[s] for s in steps], dtype=np.float64)
            curves.append(ConflictCurve(name, strategy, steps, values))
        if not per_strategy:
            log.warning("%s: no row has a conflict_fraction", path)
    return curves


def smooth_curve(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average over ``window`` points, averaging fewer points at the edges.

    Args:
        values: A 1-D array.
        window: Points per average (1 leaves the values unchanged).

    Returns:
        The smoothed array (same length).

    Raises:
        ValueError: If ``window`` < 1.
    """
    if window < 1:
        raise ValueError(f"`window` must be >= 1, got {window}")
    values = np.asarray(values, dtype=np.float64)
    if window == 1 or values.size == 0:
        return values.copy()
    kernel = np.ones(window)
    total = np.convolve(values, kernel, mode="full")
    count = np.convolve(np.ones_like(values), kernel, mode="full")
    # "full" output j sums inputs j-window+1..j; input i's window i-(window-1)//2 .. i+window//2
    # therefore ends at j = i + window//2.
    start = window // 2
    return total[start : start + values.size] / count[start : start + values.size]


def aggregate_by_strategy(curves: Sequence[ConflictCurve]) -> list[StrategyConflicts]:
    """Combine the runs of each strategy step by step (mean, min, max over the runs logging the step).

    Args:
        curves: From `load_conflict_curves`.

    Returns:
        One entry per strategy, in first-seen order.
    """
    groups: dict[str, list[ConflictCurve]] = {}
    for c in curves:
        groups.setdefault(c.strategy, []).append(c)
    out = []
    for strategy, group in groups.items():
        steps = np.unique(np.concatenate([c.steps for c in group]))
        table_RS = np.full((len(group), steps.size), np.nan)  # R runs x S steps
        for r, c in enumerate(group):
            table_RS[r, np.searchsorted(steps, c.steps)] = c.conflict_fraction
        out.append(
            StrategyConflicts(
                strategy,
                steps,
                np.nanmean(table_RS, axis=0),
                np.nanmin(table_RS, axis=0),
                np.nanmax(table_RS, axis=0),
                len(group),
            )
        )
    return out


def summarize_conflicts(curves: Sequence[ConflictCurve], skip_steps: int = 0) -> dict[str, dict[str, float]]:
    """Per-strategy summary: mean and median conflict fraction over steps (and runs), and the last value.

    Args:
        curves: From `load_conflict_curves`.
        skip_steps: Ignore steps below this (e.g. warm-up).

    Returns:
        ``{strategy: {"mean", "median", "last", "n_steps", "n_runs"}}`` (``last``: mean over runs of
        each run's final logged value).
    """
    summary = {}
    for agg in aggregate_by_strategy(curves):
        keep = agg.steps >= skip_steps
        values = np.concatenate(
            [c.conflict_fraction[c.steps >= skip_steps] for c in curves if c.strategy == agg.strategy]
        )
        lasts = [c.conflict_fraction[-1] for c in curves if c.strategy == agg.strategy and c.steps.size]
        summary[agg.strategy] = {
            "mean": float(values.mean()) if values.size else math.nan,
            "median": float(np.median(values)) if values.size else math.nan,
            "last": float(np.mean(lasts)) if lasts else math.nan,
            "n_steps": float(keep.sum()),
            "n_runs": float(agg.n_runs),
        }
    return summary


def _to_float(value: str | None) -> float:
    """A CSV cell as float; empty or non-numeric cells (``True``/``False`` become 1/0) as NaN."""
    if value is None or value == "":
        return math.nan
    if value in ("True", "False"):
        return float(value == "True")
    try:
        return float(value)
    except ValueError:
        return math.nan
