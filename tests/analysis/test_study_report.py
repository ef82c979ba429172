"""The study report's verdicts and assembly from a fake study directory."""

from __future__ import annotations

import json

import study_report  # noqa: E402


def test_verdicts_follow_the_interval():
    below = {"n": 3, "mean": -0.2, "ci_low": -0.3, "ci_high": -0.1}
    above = {"n": 3, "mean": 0.2, "ci_low": 0.1, "ci_high": 0.3}
    across = {"n": 3, "mean": -0.05, "ci_low": -0.2, "ci_high": 0.1}
    assert "lower" in study_report.verdict("ps", "random", below)
    assert "higher" in study_report.verdict("ps", "random", above)
    assert "not distinguishable" in study_report.verdict("ps", "random", across)
    assert "too few" in study_report.verdict("ps", "random", {"n": 1, "mean": 0.1, "ci_low": float("nan")})


def test_report_collects_tables_and_verdicts(tmp_path):
    exp = tmp_path / "study" / "main_scratch"
    exp.mkdir(parents=True)
    (exp / "comparison.md").write_text("| strategy | average |\n|---|---|\n| random | 1.0 |")
    (exp / "paired.md").write_text("paired table")
    summary = {"n": 3, "mean": -0.2, "ci_low": -0.3, "ci_high": -0.1}
    (exp / "paired.json").write_text(
        json.dumps({"baseline": "random", "strategies": {"partitionsel": {"average": summary}}})
    )
    la = tmp_path / "study" / "lookahead" / "ba50"
    la.mkdir(parents=True)
    (la / "summary.md").write_text("| arm | lookahead table |")
    doc = tmp_path / "docs" / "study.md"
    study_report.write_report(tmp_path / "study", doc, steps=200, early=50)
    text = doc.read_text()
    assert "lookahead table" in text and "paired table" in text
    assert "partitionsel has lower average validation loss than random beyond seed noise" in text


def test_partitionsel_is_paired_against_each_selector_by_seed():
    # Hand-computed: partitionsel - id per seed = -0.1, -0.3 (seed 3 has no id run) -> mean -0.2.
    per_seed = {
        "partitionsel": {"1": {"average": 1.0}, "2": {"average": 1.1}, "3": {"average": 0.9}},
        "id": {"1": {"average": 1.1}, "2": {"average": 1.4}},
        "greats": {"1": {"average": 0.5}},
    }
    table, verdicts = study_report.partitionsel_against_others(per_seed, against=("id", "greats", "colm"))
    assert "| partitionsel - id | 2 | -0.2000 [" in table
    assert "| partitionsel - greats | 1 | +0.5000 [n/a] |" in table
    assert "colm" not in table
    assert "too few paired seeds" in verdicts[1]
    assert study_report.partitionsel_against_others({"id": per_seed["id"]}) == ("", [])


def test_variants_are_paired_against_the_default_partitionsel_on_common_seeds():
    # Hand-computed: ps_a - default over seeds 1, 2 = (-0.1, -0.3) -> mean -0.2; ps_b has one common seed.
    default = {"1": {"average": 2.0}, "2": {"average": 2.5}, "3": {"average": 9.0}}
    variants = {
        "ps_a": {"1": {"average": 1.9}, "2": {"average": 2.2}},
        "ps_b": {"3": {"average": 9.5}},
        "random": {"1": {"average": 0.0}},
    }
    table, verdicts = study_report.variants_against_default(variants, default)
    assert "| ps_a - partitionsel | 2 | -0.2000 [" in table
    assert "| ps_b - partitionsel | 1 | +0.5000 [n/a] |" in table
    assert "random" not in table and len(verdicts) == 2
    assert study_report.variants_against_default({"ps_a": {"4": {"average": 1.0}}}, default) == ("", [])


def test_frontier_points_filter_labels_and_skip_the_ablations_copy_of_random(tmp_path):
    def write(name, strategies):
        (tmp_path / name).mkdir()
        table = {s: {"train_time_s": {"mean": t}, "average": {"mean": loss}} for s, (t, loss) in strategies.items()}
        (tmp_path / name / "comparison.json").write_text(json.dumps({"strategies": table}))

    write("main_scratch", {"partitionsel": (500.0, 1.87), "random": (200.0, 1.89), "id": (480.0, 1.92)})
    write("ablations", {"random": (150.0, 1.89), "ps_mlp_only": (400.0, 1.88), "ps_r4": (900.0, float("nan"))})
    assert study_report.frontier_points(tmp_path) == [
        ("partitionsel", 500.0, 1.87),
        ("random", 200.0, 1.89),
        ("id", 480.0, 1.92),
        ("ps_mlp_only", 400.0, 1.88),
    ]
    only = study_report.frontier_points(tmp_path, ("random", "ps_mlp_only"))
    assert only == [("random", 200.0, 1.89), ("ps_mlp_only", 400.0, 1.88)]


def test_regime_b_ablations_are_paired_with_regime_b_defaults(tmp_path):
    out, doc = tmp_path / "study", tmp_path / "docs" / "study.md"

    def write(name, per_seed):
        (out / name).mkdir(parents=True)
        (out / name / "comparison.md").write_text(f"table of {name}")
        (out / name / "comparison.json").write_text(json.dumps({"strategies": {}, "per_seed": per_seed}))

    # Hand-computed: regime (b) variant minus regime (b) default = (-0.1, -0.1); regime (a)'s default differs.
    write("main_scratch", {"partitionsel": {"1": {"average": 5.0}, "2": {"average": 5.0}}})
    write("main_finetune", {"partitionsel": {"1": {"average": 2.0}, "2": {"average": 2.5}}})
    write("ablations_finetune", {"ps_prec_pool": {"1": {"average": 1.9}, "2": {"average": 2.4}}})
    study_report.write_report(out, doc, steps=200, early=50)
    text = doc.read_text()
    assert "## PartitionSel settings on regime (b), equal steps" in text
    assert "| ps_prec_pool - partitionsel | 2 | -0.1000 [" in text


def test_a_variant_built_on_another_is_paired_with_it(tmp_path):
    out, doc = tmp_path / "study", tmp_path / "docs" / "study.md"
    (out / "ablations").mkdir(parents=True)
    (out / "ablations" / "comparison.md").write_text("table of ablations")
    # Hand-computed: ps_valavg - ps_prec_pool per seed = +0.1, +0.3 -> mean +0.2 (valavg runs under pool).
    per_seed = {
        "ps_prec_pool": {"1": {"average": 1.8}, "2": {"average": 1.9}},
        "ps_valavg": {"1": {"average": 1.9}, "2": {"average": 2.2}},
    }
    (out / "ablations" / "comparison.json").write_text(json.dumps({"strategies": {}, "per_seed": per_seed}))
    (out / "main_scratch").mkdir()
    main = {"partitionsel": {"1": {"average": 2.0}, "2": {"average": 2.0}}}
    (out / "main_scratch" / "comparison.json").write_text(json.dumps({"strategies": {}, "per_seed": main}))
    study_report.write_report(out, doc, steps=200, early=50)
    text = doc.read_text()
    assert "| ps_valavg - ps_prec_pool | 2 | +0.2000 [" in text
    # Two settings away from the default: not paired with it; its base is.
    assert "ps_valavg - partitionsel" not in text and "| ps_prec_pool - partitionsel | 2 | -0.1500 [" in text
