"""tools/studies/study_ghpile.py: the study's arms reach train.py as valid configs; its report reads run_experiment's files."""

from __future__ import annotations

import json

import pytest
import run_experiment  # noqa: E402
import study_ghpile  # noqa: E402

SEL = "algorithms.data_selection"


def _arms_of(cmd: list[str]) -> dict[str, tuple[str, list[str]]]:
    """The arms a run_experiment command line names: plain strategies and parsed variants."""
    arms = {s: (s, []) for s in cmd[cmd.index("--strategies") + 1].split(",")}
    for i, a in enumerate(cmd):
        if a == "--variant":
            label, strategy, overrides = run_experiment.parse_variant(cmd[i + 1])
            arms[label] = (strategy, overrides)
    return arms


def test_full_profile_runs_every_arm_at_equal_compute_and_at_equal_steps(tmp_path):
    cmds = study_ghpile.study_commands(
        tmp_path, shards=tmp_path / "s512", seq_len=512, profile="full", seeds="1,2,3", budget_steps=80, jobs=2
    )
    assert len(cmds) == 2
    compute, steps = cmds
    assert compute[compute.index("--compute-budget") + 1] == "random=80"
    assert steps[steps.index("--steps") + 1] == "80" and "--compute-budget" not in steps
    assert compute[compute.index("--out") + 1] != steps[steps.index("--out") + 1]
    for cmd in cmds:
        assert _arms_of(cmd) == study_ghpile.STUDY_ARMS
        assert cmd[cmd.index("--paired-baseline") + 1] == "random"
        assert int(cmd[cmd.index("--eval-interval") + 1]) > 80  # evaluated at the last step only
        # The overrides after `--` reach every run: the schedule's warm-up in `dur` and the sequence length.
        tail = cmd[cmd.index("--") + 1 :]
        assert "scheduler.t_warmup=0.1dur" in tail and "variables.max_seq_len=512" in tail
    # The arms: two window sizes at r = 2 and one window at r = 4 and 8, whole rows, the baselines.
    windows = {
        label: (o.get(f"{SEL}.features.score_window"), o.get(f"{SEL}.oversampling", "2"))
        for label, (strategy, extra) in study_ghpile.STUDY_ARMS.items()
        if strategy == "partitionsel"
        for o in [dict(x.split("=", 1) for x in extra)]
    }
    assert sorted(windows.values(), key=str) == sorted(
        [(None, "2"), ("64", "2"), ("128", "2"), ("128", "4"), ("128", "8")], key=str
    )
    assert {"random", "random_stratified", "id", "colm", "gradnorm"} <= set(study_ghpile.STUDY_ARMS)


def test_quick_profile_is_the_equal_compute_main_table_only(tmp_path):
    cmds = study_ghpile.study_commands(
        tmp_path, shards=tmp_path / "s512", seq_len=512, profile="quick", seeds="1,2,3", budget_steps=80, jobs=2
    )
    assert len(cmds) == 1 and "--compute-budget" in cmds[0]
    assert set(_arms_of(cmds[0])) == set(study_ghpile.QUICK_ARMS)


@pytest.mark.parametrize("label", list(study_ghpile.STUDY_ARMS))
def test_each_arm_loads_as_a_config_with_the_study_overrides(label):
    from composer_algos.registry import load_run_config

    strategy, extra = study_ghpile.STUDY_ARMS[label]
    cfg = load_run_config(
        study_ghpile.YAML, [f"{SEL}.strategy={strategy}", *extra, *study_ghpile.STUDY_OVERRIDES]
    )
    ds = cfg.algorithms["data_selection"]
    assert ds["strategy"] == strategy
    assert ds["validation"]["batch_size"] == 16


def _write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_report_tables_and_frontier_from_run_experiment_files(tmp_path):
    exp = tmp_path / "equal_compute"
    strategies = {
        "random": {"average": {"mean": 6.5, "std": 0.01}, "flops": {"mean": 2.0e12}},
        "ps_w128": {"average": {"mean": 6.45, "std": 0.02}, "flops": {"mean": 2.1e12}},
    }
    _write(exp / "comparison.json", {"strategies": strategies})
    _write(
        exp / "paired.json",
        {
            "baseline": "random",
            "strategies": {
                "ps_w128": {
                    "average": {"n": 3, "mean": -0.05, "ci_low": -0.08, "ci_high": -0.02},
                    "domains": {"code": {"n": 3, "mean": -0.1, "ci_low": -0.3, "ci_high": 0.1}},
                }
            },
        },
    )
    _write(exp / "plan.json", {"steps": {"random": 80, "ps_w128": 77}, "step_costs_s": {"random": 2.4, "ps_w128": 2.5}})
    text = study_ghpile.study_report(tmp_path)
    main_rows = [line for line in text.splitlines() if line.startswith("| ") and "+-" in line][1:]  # after the header
    assert main_rows == [
        "| random | 80 | 2.400 | 6.5000 +- 0.0100 | 2e+12 | - |",  # no difference of random with itself
        "| ps_w128 | 77 | 2.500 | 6.4500 +- 0.0200 | 2.1e+12 | -0.0500 [-0.0800, -0.0200], 3 |",
    ]
    assert "| ps_w128 | -0.100 [-0.300, +0.100] |" in text  # the per-domain row
    assert (tmp_path / "frontier.png").stat().st_size > 0
    assert (tmp_path / "study.md").read_text().strip() == text.strip()
    assert "Equal steps" not in text  # an experiment that has not run is left out, not invented


def test_the_full_profiles_equal_steps_experiment_reuses_the_equal_compute_runs_of_the_same_length(tmp_path):
    compute, steps = study_ghpile.study_commands(
        tmp_path, shards=tmp_path / "s", seq_len=512, profile="full", seeds="1", budget_steps=80, jobs=2
    )
    assert "--reuse-from" not in compute
    assert steps[steps.index("--reuse-from") + 1] == str(tmp_path / "equal_compute")  # run_experiment checks steps and settings


def test_report_pairs_partitionsel_arms_with_random_stratified_too(tmp_path):
    exp = tmp_path / "equal_steps"
    seeds = {
        "random": {"1": 6.0, "2": 6.2},
        "random_stratified": {"1": 5.9, "2": 6.0},
        "ps_w64": {"1": 6.0, "2": 6.3},  # +0.1 and +0.3 over random_stratified: mean +0.2
        "id": {"1": 6.5, "2": 6.5},  # not a PartitionSel arm: left out of that line
    }
    per_seed = {k: {s: {"average": v, "domains": {"code": v}} for s, v in runs.items()} for k, runs in seeds.items()}
    strategies = {k: {"average": {"mean": sum(v.values()) / 2, "std": 0.0}} for k, v in seeds.items()}
    _write(exp / "comparison.json", {"strategies": strategies, "per_seed": per_seed})
    text = study_ghpile.study_report(tmp_path)
    line = next(x for x in text.splitlines() if x.startswith("Against random_stratified"))
    # Two differences 0.1, 0.3: std 0.1414, t(1) 12.706, half-width 12.706 x 0.1414 / sqrt(2) = 1.2706.
    assert "ps_w64 +0.2000 [-1.0706, +1.4706]" in line
    assert "id" not in line


def test_more_seeds_reuse_the_study_calibration_so_every_seed_trains_the_studys_steps(tmp_path):
    calibration = tmp_path / "equal_compute" / "calibration.json"
    _write(calibration, {"format": 2, "machine": {}, "groups": {}})
    cmd = study_ghpile.more_seeds_command(tmp_path, shards=tmp_path / "s", seq_len=512, seeds="1,2,3,4,5", jobs=2)
    assert set(_arms_of(cmd)) == set(study_ghpile.MORE_ARMS)
    assert _arms_of(cmd)["ps_w64"] == study_ghpile.STUDY_ARMS["ps_w64"]
    assert cmd[cmd.index("--calibration") + 1] == str(calibration) and "--step-costs" not in cmd
    assert cmd[cmd.index("--reuse-from") + 1] == str(tmp_path / "equal_compute")  # the study's finished seeds
    assert cmd[cmd.index("--compute-budget") + 1] == "random=80"
    assert cmd[cmd.index("--out") + 1] == str(tmp_path / "equal_compute_more")
    assert cmd[cmd.index("--cost-clock") + 1] == "cpu"


def test_more_seeds_calibrate_anew_without_a_study_calibration_of_this_format(tmp_path):
    cmd = study_ghpile.more_seeds_command(tmp_path, shards=tmp_path, seq_len=512, seeds="1", jobs=1, budget_steps=40)
    assert "--calibration" not in cmd and cmd[cmd.index("--compute-budget") + 1] == "random=40"
    _write(tmp_path / "equal_compute" / "calibration.json", {"random": {"step_cpu_s": 2.0}})  # the old format
    assert "--calibration" not in study_ghpile.more_seeds_command(tmp_path, shards=tmp_path, seq_len=512, seeds="1", jobs=1)
