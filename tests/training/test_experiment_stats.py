"""Paired statistics and selection-overlap helpers of the experiment harness, on hand-computed examples."""

from __future__ import annotations

import json
import math

import pytest

from composer_algos.analysis.experiment_stats import (
    format_paired_markdown,
    jaccard,
    paired_comparison,
    paired_summary,
    read_selected_ids,
    selection_overlap,
    t_quantile_975,
)


@pytest.mark.parametrize(
    ("df", "expected"),
    # Published two-sided 95% Student t critical values (any statistics table).
    [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423), (40, 2.0211), (120, 1.9799)],
)
def test_t_quantile_matches_tables(df, expected):
    assert t_quantile_975(df) == pytest.approx(expected, abs=2e-3)


def test_t_quantile_rejects_bad_df():
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile_975(0)


def test_paired_summary_hand_computed():
    # diffs -0.1, -0.3, -0.2: mean -0.2, sample sd 0.1, se 0.1/sqrt(3), t(0.975, 2) = 4.302653
    s = paired_summary([-0.1, -0.3, -0.2])
    half = 4.302653 * 0.1 / math.sqrt(3)
    assert s["n"] == 3
    assert s["mean"] == pytest.approx(-0.2)
    assert s["std"] == pytest.approx(0.1)
    assert s["ci_low"] == pytest.approx(-0.2 - half, abs=1e-5)
    assert s["ci_high"] == pytest.approx(-0.2 + half, abs=1e-5)


def test_paired_summary_single_seed_has_no_interval():
    s = paired_summary([0.5])
    assert s["n"] == 1 and s["mean"] == 0.5
    assert math.isnan(s["ci_low"]) and math.isnan(s["ci_high"])


def test_paired_comparison_pairs_by_seed():
    per_seed = {
        "random": {
            1: {"average": 2.0, "domains": {"a": 1.0, "b": 3.0}},
            2: {"average": 2.5, "domains": {"a": 2.0, "b": 3.0}},
            3: {"average": 3.0, "domains": {"a": 2.0, "b": 4.0}},
        },
        "partitionsel": {
            # seed 4 has no baseline partner and must be ignored
            1: {"average": 1.9, "domains": {"a": 0.8, "b": 3.0}},
            2: {"average": 2.2, "domains": {"a": 1.6, "b": 2.8}},
            3: {"average": 2.8, "domains": {"a": 1.8, "b": 3.8}},
            4: {"average": 9.0, "domains": {"a": 9.0, "b": 9.0}},
        },
    }
    out = paired_comparison(per_seed, baseline="random")
    assert out["baseline"] == "random"
    assert list(out["strategies"]) == ["partitionsel"]
    entry = out["strategies"]["partitionsel"]
    assert entry["seeds"] == [1, 2, 3]
    assert entry["average"]["differences"] == pytest.approx([-0.1, -0.3, -0.2])
    assert entry["average"]["mean"] == pytest.approx(-0.2)
    half = 4.302653 * 0.1 / math.sqrt(3)
    assert entry["average"]["ci_high"] == pytest.approx(-0.2 + half, abs=1e-5)
    # domain a: -0.2, -0.4, -0.2 -> mean -0.26667, sd sqrt(((0.0667)^2*2 + 0.1333^2)/2) = 0.11547
    a = entry["domains"]["a"]
    assert a["mean"] == pytest.approx(-0.8 / 3)
    assert a["std"] == pytest.approx(0.115470, abs=1e-5)
    md = format_paired_markdown(out)
    assert "partitionsel - random" in md and "-0.2000" in md
    json.dumps(out)  # serialisable


def test_paired_comparison_unknown_baseline():
    with pytest.raises(ValueError, match="baseline 'random' has no finished runs"):
        paired_comparison({"greats": {1: {"average": 1.0, "domains": {}}}}, baseline="random")


def test_jaccard():
    assert jaccard([1, 2, 3], [2, 3, 4]) == pytest.approx(0.5)
    assert jaccard([], []) == 1.0
    assert jaccard([1], [2]) == 0.0


def test_selection_overlap_checks_pools(tmp_path):
    def write(name, rows):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return read_selected_ids(path)

    ref = write(
        "random",
        [
            {"step": 0, "pool": [1, 2, 3, 4], "selected": [1, 2]},
            {"step": 1, "pool": [5, 6, 7, 8], "selected": [5, 6]},
        ],
    )
    same = write(
        "ps",
        [
            {"step": 0, "pool": [4, 3, 2, 1], "selected": [2, 3]},
            {"step": 1, "pool": [5, 6, 7, 8], "selected": [5, 6]},
        ],
    )
    other = write(
        "gr",
        [
            {"step": 0, "pool": [1, 2, 3, 4], "selected": [1, 2]},
            {"step": 1, "pool": [5, 6, 7, 9], "selected": [5, 6]},
        ],
    )
    ok = selection_overlap(same, ref)
    # step 0: |{2}| / |{1,2,3}| = 1/3; step 1: 1
    assert ok["pools_identical"] is True and ok["steps"] == 2
    assert ok["mean_jaccard"] == pytest.approx((1 / 3 + 1) / 2)
    bad = selection_overlap(other, ref)
    assert bad["pools_identical"] is False and bad["first_pool_mismatch_step"] == 1
