"""Conflict analysis on selection_log.csv files written here in the callback's column layout."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
from comparison_plots import plot_conflicts  # tools/comparison_plots.py

from pipeline.evaluation.conflicts import (
    aggregate_by_strategy,
    load_conflict_curves,
    read_selection_log,
    smooth_curve,
    summarize_conflicts,
)
from tests.common.paths import REPO_ROOT

# The layout the selection callback writes (composer_algos.data_selection.mixture_monitor.SELECTION_LOG_COLUMNS,
# then mixture/<domain> and pool/<domain>); spelled out so this test does not import Composer.
_COLUMNS = [
    "step", "strategy", "conflict_fraction", "objective", "time_features_s", "time_solve_s",
    "time_exchange_s", "kept_samples", "kept_tokens", "fallback",
]
_DOMAINS = ["GSM_AnsAug", "MATH_SV"]


def _write_log(run_dir, strategy, values, start=1, empty_every=0):
    """A selection_log.csv whose conflict_fraction column is `values` (blank every `empty_every` rows)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "selection_log.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(_COLUMNS + [f"mixture/{d}" for d in _DOMAINS] + [f"pool/{d}" for d in _DOMAINS])
        for i, v in enumerate(values):
            blank = empty_every and i % empty_every == 0
            value = "" if blank else repr(float(v))
            metrics = ["0.5", "0.01", "0.002", "", "8", "512", "False"]
            w.writerow([start + i, strategy, value, *metrics, "0.75", "0.25", "0.5", "0.5"])
    return run_dir


def _slow_centred_mean(values, window):
    """Reference: for each point, the mean of the points within the window that exist."""
    out = []
    for i in range(len(values)):
        lo, hi = i - (window - 1) // 2, i + window // 2
        chunk = [values[j] for j in range(lo, hi + 1) if 0 <= j < len(values)]
        out.append(sum(chunk) / len(chunk))
    return np.array(out)


def test_read_selection_log_types(tmp_path):
    run = _write_log(tmp_path / "r", "partitionsel", [0.25, 0.5], empty_every=0)
    rows = read_selection_log(run / "selection_log.csv")
    assert rows[0]["step"] == 1 and rows[0]["strategy"] == "partitionsel"
    assert rows[1]["conflict_fraction"] == 0.5 and rows[0]["kept_samples"] == 8.0
    assert math.isnan(rows[0]["time_exchange_s"]) and rows[0]["fallback"] == 0.0
    assert rows[0]["mixture/GSM_AnsAug"] == 0.75


def test_missing_column_is_named(tmp_path):
    path = tmp_path / "selection_log.csv"
    path.write_text("step,strategy\n1,id\n")
    with pytest.raises(ValueError, match=r"\['conflict_fraction'\] missing"):
        read_selection_log(path)
    with pytest.raises(FileNotFoundError, match="selection_log.csv"):
        load_conflict_curves([tmp_path / "nope"])


def test_curves_skip_blank_steps(tmp_path):
    run = _write_log(tmp_path / "id_seed0", "id", [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], empty_every=3)
    (curve,) = load_conflict_curves([run])
    assert curve.strategy == "id" and curve.run.endswith("id_seed0")
    np.testing.assert_array_equal(curve.steps, [2, 3, 5, 6])
    np.testing.assert_allclose(curve.conflict_fraction, [0.2, 0.3, 0.5, 0.6])


@pytest.mark.parametrize("window", [1, 2, 3, 4, 7, 50])
def test_smoothing_matches_reference(window):
    rng = np.random.default_rng(0)
    values = rng.random(23)
    np.testing.assert_allclose(smooth_curve(values, window), _slow_centred_mean(list(values), window), rtol=1e-12)
    with pytest.raises(ValueError, match="`window` must be >= 1"):
        smooth_curve(values, 0)


def test_aggregate_and_summary_over_seeds(tmp_path):
    a = _write_log(tmp_path / "p0", "partitionsel", [0.2, 0.4, 0.6])
    b = _write_log(tmp_path / "p1", "partitionsel", [0.6, 0.8], start=2)
    c = _write_log(tmp_path / "i0", "id", [0.5, 0.5, 0.5, 0.7])
    curves = load_conflict_curves([a, b, c])
    aggs = {g.strategy: g for g in aggregate_by_strategy(curves)}
    p = aggs["partitionsel"]
    assert p.n_runs == 2
    np.testing.assert_array_equal(p.steps, [1, 2, 3])
    np.testing.assert_allclose(p.mean, [0.2, 0.5, 0.7])
    np.testing.assert_allclose(p.low, [0.2, 0.4, 0.6])
    np.testing.assert_allclose(p.high, [0.2, 0.6, 0.8])
    summary = summarize_conflicts(curves)
    assert summary["partitionsel"]["mean"] == pytest.approx((0.2 + 0.4 + 0.6 + 0.6 + 0.8) / 5)
    assert summary["partitionsel"]["last"] == pytest.approx((0.6 + 0.8) / 2)
    assert summary["id"]["median"] == pytest.approx(0.5) and summary["id"]["n_runs"] == 1
    assert summarize_conflicts(curves, skip_steps=4)["id"]["mean"] == pytest.approx(0.7)


def test_plot_writes_an_image(tmp_path):
    rng = np.random.default_rng(1)
    runs = [
        _write_log(tmp_path / "id", "id", list(0.4 + 0.05 * rng.standard_normal(60))),
        _write_log(tmp_path / "ps0", "partitionsel", list(0.3 + 0.05 * rng.standard_normal(60))),
        _write_log(tmp_path / "ps1", "partitionsel", list(0.3 + 0.05 * rng.standard_normal(60))),
    ]
    out = plot_conflicts(load_conflict_curves(runs), tmp_path / "figs" / "conflicts.png", window=9)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
    with pytest.raises(ValueError, match="no conflict curves"):
        plot_conflicts([], tmp_path / "empty.png")


def test_plot_conflicts_tool(tmp_path, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("plot_conflicts", REPO_ROOT / "tools" / "studies" / "plot_conflicts.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    runs = [_write_log(tmp_path / "id", "id", [0.5, 0.6]), _write_log(tmp_path / "ps", "partitionsel", [0.1, 0.3])]
    out = tmp_path / "c.png"
    summary = tmp_path / "s.json"
    assert tool.main([str(r) for r in runs] + ["--out", str(out), "--window", "1", "--summary-json", str(summary)]) == 0
    printed = capsys.readouterr().out
    assert "partitionsel" in printed and out.exists()
    assert json.loads(summary.read_text())["id"]["mean"] == pytest.approx(0.55)
